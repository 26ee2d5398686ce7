//! `ferrotron validate-cost`: the cost model against this machine. Each layout of each model
//! size is trained for a few steps (its own `train` process, ranks as threads sharing the
//! cores) and predicted by the same cost model `plan --hardware cpu-local` uses, with this
//! engine's kernels timed on this machine just before the run ([`crate::kernel_times`], so a
//! machine whose speed drifts drifts for both) and the collectives `bench-comm` measured; the
//! table compares tokens per second and the step's parts.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use ferrotron_config::Config;
use ferrotron_plan::{cpu_kernels, step_cost, CostModel, Job, StepCost};

/// Arguments of `validate-cost`.
#[derive(clap::Args)]
pub struct ValidateCostArgs {
    /// Model sizes (the `bench` presets), comma separated.
    #[arg(long, default_value = "tiny,small", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Timed steps per layout (after 2 warm-up steps; the median step counts).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Only the layouts whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Where the runs write (default: a folder under the system's temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// (name, ranks, overrides) of every layout validated.
const LAYOUTS: [(&str, usize, &[&str]); 14] = [
    ("dp1", 1, &[]),
    ("dp2", 2, &["parallel.dp=2"]),
    (
        "tp2",
        2,
        &["parallel.tp=2", "parallel.sequence_parallel=false"],
    ),
    (
        "tp2 sp",
        2,
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
    ),
    (
        "pp2 afab m8",
        2,
        &[
            "parallel.pp=2",
            "parallel.pp_schedule=\"afab\"",
            "train.grad_accum=8",
        ],
    ),
    (
        "pp2 1f1b m8",
        2,
        &[
            "parallel.pp=2",
            "parallel.pp_schedule=\"1f1b\"",
            "train.grad_accum=8",
        ],
    ),
    (
        "pp2 interleaved v2 m8",
        2,
        &[
            "parallel.pp=2",
            "parallel.pp_schedule=\"interleaved\"",
            "parallel.virtual_stages=2",
            "train.grad_accum=8",
        ],
    ),
    (
        "pp2 zero-bubble m8",
        2,
        &[
            "parallel.pp=2",
            "parallel.pp_schedule=\"zero_bubble\"",
            "train.grad_accum=8",
        ],
    ),
    ("cp2", 2, &["parallel.cp=2"]),
    (
        "ep2 moe",
        2,
        &[
            "parallel.dp=2",
            "parallel.ep=2",
            "model.experts=4",
            "model.top_k=2",
        ],
    ),
    ("dp2 zero1", 2, &["parallel.dp=2", "parallel.zero=1"]),
    ("dp2 zero2", 2, &["parallel.dp=2", "parallel.zero=2"]),
    ("dp2 zero3", 2, &["parallel.dp=2", "parallel.zero=3"]),
    ("dp1 full recompute", 1, &["parallel.recompute=\"full\""]),
];

/// A run's measured step: median over the timed steps.
struct Measured {
    tokens_per_s: f64,
    exposed_comm_s: f64,
    pipeline_wait_s: f64,
    step_s: f64,
}

/// The median (the mean of the two middle values of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Trains `config` with `overrides` in a child `train` process in `dir`; its median step.
fn measure(config: &Path, overrides: &[String], dir: &Path) -> anyhow::Result<Measured> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["train", "--quiet", "--overwrite", "--config"])
        .arg(config);
    for o in overrides {
        cmd.args(["--set", o]);
    }
    let quoted = toml::Value::String(dir.display().to_string()).to_string();
    cmd.args(["--set", &format!("run.dir={quoted}")]);
    let out = cmd.output()?;
    anyhow::ensure!(
        out.status.success(),
        "train in {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dir.join("metrics.jsonl"))?;
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|r: &serde_json::Value| r["step"].as_u64().is_some_and(|s| s > 2))
        .collect();
    anyhow::ensure!(!rows.is_empty(), "no timed steps in {}", dir.display());
    let col = |k: &str| median(rows.iter().map(|r| r[k].as_f64().unwrap_or(0.0)).collect());
    let step_s = col("step_time_s");
    Ok(Measured {
        tokens_per_s: col("tokens") / step_s,
        exposed_comm_s: col("reduce_exposed_s"),
        pipeline_wait_s: col("pipeline_wait_s"),
        step_s,
    })
}

/// The cost model's prediction of `config` on this machine.
fn predict(config: &Config, ranks: usize) -> anyhow::Result<StepCost> {
    let job = Job::from_config(config)?;
    let needs = cpu_kernels::kernel_needs(&job.model, &job.layout);
    let mut kernels = crate::kernel_times::kernel_times(&needs, config.train.threads, ranks, true)?;
    kernels.peak_flops = ferrotron_train::peak::cached_peak(kernels.threads).unwrap_or(0.0);
    let (mut hw, _) = crate::plan::load_hardware("cpu-local")?;
    hw.gpus_per_node = hw.gpus_per_node.max(ranks);
    hw.kernels = Some(kernels);
    Ok(step_cost(&job, &hw, &CostModel::default())?)
}

pub fn run(a: ValidateCostArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.steps >= 1, "--steps {}: time at least 1 step", a.steps);
    for size in &a.sizes {
        anyhow::ensure!(
            ferrotron_train::bench::PRESETS.contains(&size.as_str()),
            "--sizes: unknown size `{size}`: use tiny, small or medium"
        );
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let root = a.dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("ferrotron-validate-cost-{}", std::process::id()))
    });
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let (hw, notes) = crate::plan::load_hardware("cpu-local")?;
    println!("runs in {}", root.display());
    for n in notes.iter().filter(|n| !n.starts_with("kernels:")) {
        println!("{n}");
    }
    if hw.latency.intra_us == 0.0 {
        println!("collectives: the profile's placeholders; measure them first with `ferrotron bench-comm --ranks 2`");
    }
    println!("\n| size | layout | measured tok/s | predicted tok/s | error | measured step = … + exposed comm + pipeline wait | predicted step = compute + bubble + exposed comm + host |\n|---|---|---|---|---|---|---|");
    let (mut errors, mut failed) = (Vec::new(), 0);
    for size in &a.sizes {
        let mut base = ferrotron_train::bench::preset(size).expect("checked above");
        base.train.steps = 2 + a.steps;
        base.checkpoint.every = 0;
        let path = root.join(format!("{size}.toml"));
        std::fs::write(&path, toml::to_string(&base)?)?;
        for (name, ranks, sets) in LAYOUTS {
            if a.only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
                continue;
            }
            let threads = (cores / ranks).max(1);
            let mut overrides: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            overrides.push(format!("train.threads={threads}"));
            let config = Config::load(Some(&path), &overrides)?;
            let predicted = predict(&config, ranks)?;
            let dir = root.join(format!("{size}-{}", name.replace(' ', "-")));
            let m = match measure(&path, &overrides, &dir) {
                Ok(m) => m,
                Err(e) => {
                    println!(
                        "| {size} | {name} | failed: {} | | | | |",
                        e.to_string().lines().next().unwrap_or("")
                    );
                    failed += 1;
                    continue;
                }
            };
            let p_tps = predicted.tokens_per_step / predicted.step_s;
            let err = (p_tps - m.tokens_per_s) / m.tokens_per_s;
            errors.push(err.abs());
            println!(
                "| {size} | {name} | {:.0} | {:.0} | {:+.1}% | {:.1} ms, {:.1}, {:.1} | {:.1} ms = {:.1} + {:.1} + {:.1} + {:.1} |",
                m.tokens_per_s,
                p_tps,
                100.0 * err,
                1e3 * m.step_s,
                1e3 * m.exposed_comm_s,
                1e3 * m.pipeline_wait_s,
                1e3 * predicted.step_s,
                1e3 * predicted.compute_s,
                1e3 * predicted.bubble_s,
                1e3 * predicted.exposed_comm_s,
                1e3 * predicted.host_s,
            );
        }
    }
    if !errors.is_empty() {
        let worst = errors.iter().fold(0.0f64, |w, e| w.max(*e));
        println!(
            "\n{} runs: median |predicted − measured| / measured {:.1}%, worst {:.1}%",
            errors.len(),
            100.0 * median(errors),
            100.0 * worst
        );
    }
    anyhow::ensure!(failed == 0, "{failed} layouts failed to train (rows above)");
    Ok(())
}
