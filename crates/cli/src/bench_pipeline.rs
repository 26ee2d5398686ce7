//! `ferrotron bench-pipeline`: each pipeline rank's idle time inside a step, for every
//! schedule, against the theory `(p − 1)/(v·m)` of bubble over compute — ranks as threads.

use ferrotron_config::{Config, PpSchedule};
use ferrotron_train::launch::on_thread_ranks;
use ferrotron_train::Init;

/// Arguments of `bench-pipeline`.
#[derive(clap::Args)]
pub struct BenchPipelineArgs {
    /// Pipeline stages.
    #[arg(long, default_value_t = 4)]
    pp: usize,
    /// Micro-batches per step, comma separated.
    #[arg(long, default_value = "4,8,16", value_delimiter = ',')]
    micro_batches: Vec<usize>,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Override a model setting, e.g. `--set model.hidden=256` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
}

const SCHEDULES: [(PpSchedule, usize, &str); 5] = [
    (PpSchedule::Afab, 1, "afab"),
    (PpSchedule::OneFOneB, 1, "1f1b"),
    (PpSchedule::Interleaved, 2, "interleaved v=2"),
    (PpSchedule::ZeroBubble, 1, "zero_bubble"),
    (PpSchedule::DualPipeV, 1, "dualpipev"),
];

pub fn run(a: BenchPipelineArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.pp >= 2,
        "--pp {}: a pipeline has at least 2 stages (use --pp 2 or more)",
        a.pp
    );
    anyhow::ensure!(a.steps >= 1, "--steps must be at least 1");
    anyhow::ensure!(
        !a.micro_batches.is_empty() && a.micro_batches.iter().all(|&m| m >= 1),
        "--micro-batches must list counts of at least 1, e.g. 4,8,16"
    );
    println!("| schedule | m | theory: bubble/compute | theory: idle share | measured idle share per rank |\n|---|---|---|---|---|");
    let (mut rows, mut last_error) = (0, None);
    for (kind, v, name) in SCHEDULES {
        for &m in &a.micro_batches {
            let mut sets = vec![
                "model.hidden=128".to_string(),
                "model.layers=8".into(),
                "model.ffn=384".into(),
                "model.seq_len=64".into(),
                "train.micro_batch=2".into(),
                "train.threads=1".into(),
            ];
            sets.extend(a.set.iter().cloned());
            let mut c = Config::load(None, &sets)?;
            c.parallel.pp = a.pp;
            c.parallel.pp_schedule = kind;
            c.parallel.virtual_stages = v;
            c.train.grad_accum = m;
            c.train.steps = a.steps + 1;
            if let Err(e) = c.validate() {
                last_error = Some(e); // e.g. interleaved needs m divisible by p, DualPipeV m ≥ 2p
                continue;
            }
            rows += 1;
            let shares = on_thread_ranks(&c, Init::Fresh, |mut t| {
                let stats = t.run(|_| {})?;
                let timed = &stats[1..];
                let wait: f64 = timed.iter().map(|s| s.pipeline_wait_s).sum();
                let total: f64 = timed.iter().map(|s| s.step_time_s).sum();
                Ok(wait / total)
            })?;
            let bubble = match kind {
                PpSchedule::ZeroBubble => (a.pp as f64 - 1.0) / (3.0 * m as f64),
                PpSchedule::DualPipeV => (a.pp as f64 - 1.0) / (6.0 * m as f64),
                _ => (a.pp as f64 - 1.0) / (v as f64 * m as f64),
            };
            let measured: Vec<String> = shares
                .iter()
                .map(|s| format!("{:.1}%", s * 100.0))
                .collect();
            println!(
                "| {name} | {m} | {:.3} | {:.1}% | {} |",
                bubble,
                100.0 * bubble / (1.0 + bubble),
                measured.join(" ")
            );
        }
    }
    if rows == 0 {
        let why = last_error.map_or_else(String::new, |e| format!(": {e}"));
        anyhow::bail!("no schedule can run with --pp {}{why}", a.pp);
    }
    println!("\nTheory assumes backward = 2 × forward (zero bubble and DualPipeV: B = W = F; ZB-H1 loses (p−1)(F+B−W), DualPipeV one chunk's forward (half a stage's) per stage); the idle share of a step is bubble/(1 + bubble).");
    println!("Measured: time each rank blocked waiting for activations or gradients, over its step time. Ranks are threads sharing this machine's cores, so a rank also waits while a busy neighbour is descheduled.");
    Ok(())
}
