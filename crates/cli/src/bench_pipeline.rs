//! `ferrotron bench-pipeline`: each pipeline rank's idle time inside a step, for every
//! schedule, against the theory `(p − 1)/(v·m)` of bubble over compute — ranks as threads.

use ferrotron_bench::pipeline::{base_config, idle_shares, PipelineCase, SCHEDULES};

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

/// `ferrotron bench-pipeline`: the table of every schedule at every micro-batch count.
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
    // A bad --set is refused here; a layout a schedule cannot run only skips that row.
    let base = base_config(&a.set)?;
    println!("| schedule | m | theory: bubble/compute | theory: idle share | measured idle share per rank |\n|---|---|---|---|---|");
    let (mut rows, mut last_error) = (0, None);
    for (kind, v, name) in SCHEDULES {
        for &m in &a.micro_batches {
            let case = PipelineCase {
                pp: a.pp,
                schedule: kind,
                virtual_stages: v,
                m,
                steps: a.steps,
            };
            let c = match case.config(&base) {
                Ok(c) => c,
                Err(e) => {
                    last_error = Some(e); // e.g. interleaved needs m divisible by p
                    continue;
                }
            };
            rows += 1;
            let shares = idle_shares(&c)?;
            let bubble = case.bubble();
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
