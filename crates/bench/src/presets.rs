//! The training benchmark: its model presets (issue-defined sizes), one preset's throughput
//! and step profile, and the matmul peak `bench` measures and caches.

use ferrotron_config::{Config, ModelConfig};
use ferrotron_train::trainer::thread_pool;
use ferrotron_train::{mfu, Trainer};
use serde::{Deserialize, Serialize};

use crate::profile::{measure_bandwidth, profile, StepProfile};
use crate::{peak, BenchError};

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

/// What every preset of one benchmark runs on: compute threads, matmul library, precision.
#[derive(Debug, Clone, Copy)]
pub struct Host {
    /// Compute threads (`train.threads`; 0: all cores).
    pub threads: usize,
    /// The linear layers' matmul library (`train.matmul`).
    pub matmul: ferrotron_config::Matmul,
    /// Storage precision (`train.dtype`).
    pub dtype: ferrotron_config::DType,
}

impl Host {
    /// Preset `name` set up for this host: threads, library, precision.
    ///
    /// # Errors
    ///
    /// [`BenchError::Failed`] naming the presets for an unknown `name`.
    pub fn preset(&self, name: &str) -> Result<Config, BenchError> {
        let mut config = preset(name).ok_or_else(|| {
            BenchError::Failed(format!(
                "unknown preset `{name}`: use tiny, small or medium"
            ))
        })?;
        config.train.threads = self.threads;
        config.train.matmul = self.matmul;
        config.train.dtype = self.dtype;
        Ok(config)
    }
}

/// One preset's throughput on one host: the row of `ferrotron bench`'s table.
#[derive(Debug, Serialize, Deserialize)]
pub struct PresetResult {
    /// The preset's name.
    pub config: String,
    /// Compute threads.
    pub threads: usize,
    /// Parameters of the model.
    pub params: usize,
    /// Median tokens per second of the timed steps.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation against `peak_gflops`.
    pub mfu: f64,
    /// The matmul peak MFU is against (cached, or measured when none is).
    pub peak_gflops: f64,
    /// Peak resident memory of this process, MiB.
    pub peak_rss_mib: f64,
}

/// Trains preset `name` on `host` for one warm-up and `steps` timed steps, in this process
/// (its peak RSS is the process's: run it in a process of its own).
///
/// # Errors
///
/// An unknown preset, or the run's own error.
pub fn run_preset(name: &str, host: Host, steps: usize) -> Result<PresetResult, BenchError> {
    let mut config = host.preset(name)?;
    config.train.steps = steps + 1;
    let mut trainer = Trainer::new(config)?;
    // One rank of `threads` threads on this machine (one MFU definition: `mfu::Occupancy`).
    let occupancy = mfu::Occupancy {
        ranks: 1,
        threads_per_rank: host.threads,
        shared_host: true,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let (peak_threads, _) = occupancy.peak_shape();
    let products = peak::Products::of(host.matmul);
    let peak = match peak::cached_peak_of(peak_threads, products) {
        Some(p) => p,
        None => thread_pool(peak_threads)?.install(|| peak::measure_matmul_peak_of(products, 7)),
    };
    trainer.metrics.peak_flops = Some(peak);
    let stats = trainer.run(|_| {})?;
    let summary = trainer.summary(&stats, None);
    Ok(PresetResult {
        config: name.into(),
        threads: host.threads,
        params: summary.params,
        tokens_per_s: summary.tokens_per_s,
        mfu: summary.mfu.unwrap_or(0.0),
        peak_gflops: peak / 1e9,
        peak_rss_mib: peak_rss_bytes().unwrap_or(0) as f64 / (1 << 20) as f64,
    })
}

/// The step profile of preset `name` on `host` (after 2 warm-up steps), against the cached
/// (or measured) matmul peak and the measured memory bandwidth of its threads.
///
/// # Errors
///
/// An unknown preset, or the run's own error.
pub fn profile_preset(name: &str, host: Host, steps: usize) -> Result<StepProfile, BenchError> {
    let config = host.preset(name)?;
    let pool = thread_pool(host.threads)?;
    let limits = pool.install(|| {
        let products = peak::Products::of(host.matmul);
        let peak = peak::cached_peak_of(pool.current_num_threads(), products)
            .unwrap_or_else(|| peak::measure_matmul_peak_of(products, 7));
        (peak, measure_bandwidth(9))
    });
    Ok(profile(config, 2, steps, limits)?)
}

/// A matmul peak measured for `bench`: the measurement and what the cache did with it.
#[derive(Debug)]
pub struct MeasuredPeak {
    /// The pool's threads.
    pub threads: usize,
    /// The products measured.
    pub products: peak::Products,
    /// The measurement.
    pub measurement: peak::PeakMeasurement,
    /// Whether it was cached as the MFU denominator.
    pub stored: peak::Stored,
}

impl MeasuredPeak {
    /// What the cache did, in words.
    pub fn verdict(&self) -> String {
        match self.stored {
            peak::Stored::Kept => "cached as the MFU denominator".to_string(),
            peak::Stored::BetterCached => format!(
                "a better quiet measurement stays cached ({:.1} GFLOP/s)",
                peak::cached_peak_of(self.threads, self.products).unwrap_or(0.0) / 1e9
            ),
            peak::Stored::NotQuiet => "NOT cached: other processes competed for the cores or the repeats disagree; rerun on a quiet machine".into(),
        }
    }
}

/// Measures the matmul peak of `products` on `threads` threads (15 repeats), caching it if
/// it was quiet.
///
/// # Errors
///
/// The pool could not be built.
pub fn measure_peak(threads: usize, products: peak::Products) -> Result<MeasuredPeak, BenchError> {
    let pool = thread_pool(threads)?;
    let threads = pool.current_num_threads();
    let measurement = pool.install(|| peak::measure_peak_of(products, 15));
    let stored = peak::store_peak_of(threads, products, measurement);
    Ok(MeasuredPeak {
        threads,
        products,
        measurement,
        stored,
    })
}
