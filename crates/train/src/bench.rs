//! The training benchmark's model presets (issue-defined sizes).

use ferrotron_config::{Config, ModelConfig};

/// The preset called `name` (`tiny`, `small`, `medium`) as a full config, fp32.
pub fn preset(name: &str) -> Option<Config> {
    let (model, micro_batch) = match name {
        "tiny" => (
            ModelConfig {
                vocab: 256,
                hidden: 128,
                layers: 4,
                heads: 4,
                kv_heads: 4,
                ffn: 384,
                seq_len: 128,
                ..ModelConfig::default()
            },
            8,
        ),
        "small" => (
            ModelConfig {
                vocab: 8192,
                hidden: 512,
                layers: 8,
                heads: 8,
                kv_heads: 4,
                ffn: 1536,
                seq_len: 256,
                ..ModelConfig::default()
            },
            4,
        ),
        "medium" => (
            ModelConfig {
                vocab: 32000,
                hidden: 768,
                layers: 12,
                heads: 12,
                kv_heads: 12,
                ffn: 2048,
                seq_len: 512,
                ..ModelConfig::default()
            },
            2,
        ),
        _ => return None,
    };
    let mut c = Config {
        model,
        ..Config::default()
    };
    c.train.micro_batch = micro_batch;
    c.train.grad_accum = 1;
    c.train.warmup_steps = 1;
    c.train.lr = 1e-4;
    c.train.min_lr = 1e-5;
    Some(c)
}

/// Names of the presets, smallest first.
pub const PRESETS: [&str; 3] = ["tiny", "small", "medium"];

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if readable.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// Resident set size of this process now, in bytes (Linux `VmRSS`), if readable.
pub fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
