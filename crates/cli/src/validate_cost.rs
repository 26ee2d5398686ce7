//! `ferrotron validate-cost`: the cost model against this machine. Each layout of each model
//! size is trained for a few steps (its own `train` process, ranks as threads sharing the
//! cores) and predicted by the same cost model `plan --hardware cpu-local` uses, with this
//! engine's kernels timed on this machine just before the run and again just after it
//! ([`ferrotron_bench::kernel_times`]; the two timings averaged, so that a machine whose speed drifts
//! drifts for both) and the collectives `bench-comm` measured; the table compares tokens per
//! second and the step's parts. The prediction uses kernel timings only, never the run's
//! own measurements; the summary also gives the errors of the kernels timed before the run
//! alone.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use ferrotron_config::Config;
use ferrotron_plan::cpu_kernels::{self, KernelRates};
use ferrotron_plan::{step_cost, CostModel, Job, StepCost};

/// Arguments of `validate-cost`.
#[derive(clap::Args)]
pub struct ValidateCostArgs {
    /// Model sizes (the `bench` presets), comma separated.
    #[arg(long, default_value = "tiny,small", value_delimiter = ',')]
    sizes: Vec<String>,
    /// Timed steps per layout, at least (after 2 warm-up steps; the median step counts).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Seconds of timed steps per layout, at least: a layout whose predicted step is short
    /// runs more than `--steps` steps, so that its median is taken over this long (one
    /// tiny step lasts about 80 ms here, and this machine's speed moves within a second).
    #[arg(long, default_value_t = 1.0)]
    min_seconds: f64,
    /// Only the layouts whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Where the runs write (default: a folder under the system's temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Times every layout is predicted and run, in turn (all layouts once, then again, …);
    /// each layout reports its median round by error, each round's prediction from kernels
    /// timed just before and just after its run (so that a shared machine's drift moves
    /// both), and a round a busy moment disturbed falls out of the median.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// A layout validated: its name, ranks and overrides.
type LayoutSpec = (&'static str, usize, &'static [&'static str]);

/// Every layout validated.
const LAYOUTS: [LayoutSpec; 14] = [
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

/// The kernel times `config`'s step needs, measured now on this machine by `ranks` ranks.
fn time_kernels(config: &Config, ranks: usize) -> anyhow::Result<KernelRates> {
    let job = Job::from_config(config)?;
    let needs = cpu_kernels::kernel_needs(&job.model, &job.layout);
    let mut kernels =
        ferrotron_bench::kernel_times::kernel_times(&needs, config.train.threads, ranks, true)?;
    kernels.peak_flops = ferrotron_train::peak::cached_peak(kernels.threads).unwrap_or(0.0);
    Ok(kernels)
}

/// The cost model's prediction of `config` on this machine from the kernel times `kernels`.
fn predict(config: &Config, ranks: usize, kernels: KernelRates) -> anyhow::Result<StepCost> {
    let job = Job::from_config(config)?;
    let (mut hw, _) = ferrotron_bench::hardware::load_hardware("cpu-local")?;
    hw.gpus_per_node = hw.gpus_per_node.max(ranks);
    hw.kernels = Some(kernels);
    Ok(step_cost(&job, &hw, &CostModel::default())?)
}

/// One layout's kept run: the measured step and the predictions from its kernels timed just
/// before it (`before`) and, averaged, before and after it (`predicted`).
struct Row {
    size: String,
    name: &'static str,
    measured: Measured,
    predicted: StepCost,
    before: StepCost,
}

impl Row {
    /// Signed error of the prediction from the kernels timed before and after the run.
    fn error(&self) -> f64 {
        self.error_of(&self.predicted)
    }

    /// Signed error of the prediction from the kernels timed before the run only.
    fn error_before(&self) -> f64 {
        self.error_of(&self.before)
    }

    fn error_of(&self, p: &StepCost) -> f64 {
        let p_tps = p.tokens_per_step / p.step_s;
        (p_tps - self.measured.tokens_per_s) / self.measured.tokens_per_s
    }

    fn line(&self) -> String {
        let (m, p) = (&self.measured, &self.predicted);
        format!(
            "| {} | {} | {:.0} | {:.0} | {:+.1}% | {:.1} ms, {:.1}, {:.1} | {:.1} ms = {:.1} + {:.1} + {:.1} + {:.1} |",
            self.size,
            self.name,
            m.tokens_per_s,
            p.tokens_per_step / p.step_s,
            100.0 * self.error(),
            1e3 * m.step_s,
            1e3 * m.exposed_comm_s,
            1e3 * m.pipeline_wait_s,
            1e3 * p.step_s,
            1e3 * p.compute_s,
            1e3 * p.bubble_s,
            1e3 * p.exposed_comm_s,
            1e3 * p.host_s,
        )
    }
}

/// How long each layout is timed: at least `steps` steps and `min_seconds` of them.
#[derive(Clone, Copy)]
struct Timing {
    steps: usize,
    min_seconds: f64,
}

impl Timing {
    /// Timed steps for a layout whose step is predicted to last `step_s`.
    fn steps_for(&self, step_s: f64) -> usize {
        let by_time = (self.min_seconds / step_s.max(1e-3)).ceil() as usize;
        self.steps.max(by_time)
    }
}

/// Predicts and runs one layout of `size` (its preset's config at `path`), timing as many
/// steps as `timing` asks for its predicted step.
fn run_layout(
    size: &str,
    (name, ranks, sets): LayoutSpec,
    path: &Path,
    dir: &Path,
    timing: Timing,
) -> anyhow::Result<Row> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / ranks).max(1);
    let mut overrides: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    overrides.push(format!("train.threads={threads}"));
    let config = Config::load(Some(path), &overrides)?;
    let kernels = time_kernels(&config, ranks)?;
    let before = predict(&config, ranks, kernels.clone())?;
    overrides.push(format!(
        "train.steps={}",
        2 + timing.steps_for(before.step_s)
    ));
    let measured = measure(path, &overrides, dir)?;
    // Timed again after the run: this machine's speed drifts over seconds, and the mean of
    // the two timings brackets the run.
    let after = time_kernels(&config, ranks)?;
    Ok(Row {
        size: size.to_string(),
        name,
        measured,
        predicted: predict(&config, ranks, kernels.mean(&after))?,
        before,
    })
}

pub fn run(a: ValidateCostArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.steps >= 1, "--steps {}: time at least 1 step", a.steps);
    anyhow::ensure!(a.rounds >= 1, "--rounds {}: run at least 1 round", a.rounds);
    anyhow::ensure!(
        a.min_seconds.is_finite() && (0.0..=600.0).contains(&a.min_seconds),
        "--min-seconds {}: give 0 to 600 seconds of timed steps per layout",
        a.min_seconds
    );
    let timing = Timing {
        steps: a.steps,
        min_seconds: a.min_seconds,
    };
    for size in &a.sizes {
        anyhow::ensure!(
            ferrotron_train::bench::PRESETS.contains(&size.as_str()),
            "--sizes: unknown size `{size}`: use tiny, small or medium"
        );
    }
    let root = a.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("ferrotron-validate-cost-{}", std::process::id()))
    });
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let (hw, notes) = ferrotron_bench::hardware::load_hardware("cpu-local")?;
    println!("runs in {}", root.display());
    for n in notes.iter().filter(|n| !n.starts_with("kernels:")) {
        println!("{n}");
    }
    if hw.latency.intra_us == 0.0 {
        println!("collectives: the profile's placeholders; measure them first with `ferrotron bench-comm --ranks 2`");
    }
    let mut runs: Vec<(String, LayoutSpec, PathBuf)> = Vec::new();
    for size in &a.sizes {
        let mut base = ferrotron_train::bench::preset(size).expect("checked above");
        base.train.steps = 2 + a.steps;
        base.checkpoint.every = 0;
        let path = root.join(format!("{size}.toml"));
        std::fs::write(&path, toml::to_string(&base)?)?;
        let only = |name: &str| a.only.as_ref().is_none_or(|o| name.contains(o.as_str()));
        runs.extend(
            LAYOUTS
                .into_iter()
                .filter(|l| only(l.0))
                .map(|l| (size.clone(), l, path.clone())),
        );
    }
    let Rounds {
        rows,
        before,
        failed,
    } = rounds(&runs, a.rounds, &root, timing);
    println!("\n| size | layout | measured tok/s | predicted tok/s | error | measured step, exposed comm, pipeline wait | predicted step = compute + bubble + exposed comm + host |\n|---|---|---|---|---|---|---|");
    for r in rows.iter().flatten() {
        println!("{}", r.line());
    }
    let errors: Vec<f64> = rows.iter().flatten().map(|r| r.error().abs()).collect();
    if !errors.is_empty() {
        let worst = errors.iter().fold(0.0f64, |w, e| w.max(*e));
        let runs = match a.rounds {
            1 => "one run each".to_string(),
            n => format!("each its median of {n} rounds"),
        };
        println!(
            "\n{} layouts ({runs}): median |predicted − measured| / measured {:.1}%, worst {:.1}%",
            errors.len(),
            100.0 * median(errors),
            100.0 * worst
        );
        let before: Vec<f64> = before.iter().flatten().map(|e| e.abs()).collect();
        println!(
            "predicted from the kernels timed before each run only (each layout's median round by that error): median {:.1}%, worst {:.1}%",
            100.0 * median(before.clone()),
            100.0 * before.iter().fold(0.0f64, |w, e| w.max(*e))
        );
    }
    anyhow::ensure!(
        failed.is_empty(),
        "layouts failed to train:\n{}",
        failed.join("\n")
    );
    Ok(())
}

/// What the rounds kept, per layout, and the layouts that failed.
struct Rounds {
    /// The median round by the error of the prediction from the kernels timed around it.
    rows: Vec<Option<Row>>,
    /// The median error of the predictions from the kernels timed before each run only.
    before: Vec<Option<f64>>,
    /// Layouts that failed to train, with the first line of their error.
    failed: Vec<String>,
}

/// Runs every layout `n` times, all of them once per round; per layout, its median round:
/// the run whose error (the prediction from the kernels timed around it against its
/// measurement) is the median of its rounds' errors.
fn rounds(runs: &[(String, LayoutSpec, PathBuf)], n: usize, root: &Path, timing: Timing) -> Rounds {
    let mut all: Vec<Vec<Row>> = runs.iter().map(|_| Vec::new()).collect();
    let mut failed = Vec::new();
    for round in 1..=n {
        for (i, (size, layout, path)) in runs.iter().enumerate() {
            let dir = root.join(format!("{size}-{}", layout.0.replace(' ', "-")));
            eprintln!("round {round}/{n}: {size} {}", layout.0);
            match run_layout(size, *layout, path, &dir, timing) {
                Ok(row) => {
                    eprintln!(
                        "  {} (before the run only: {:+.1}%)",
                        row.line(),
                        100.0 * row.error_before()
                    );
                    all[i].push(row);
                }
                Err(e) => failed.push(format!(
                    "{size} {}: {}",
                    layout.0,
                    e.to_string().lines().next().unwrap_or("")
                )),
            }
        }
    }
    let before = all
        .iter()
        .map(|rows| median_by(rows.iter().map(Row::error_before).collect(), |e| *e))
        .collect();
    Rounds {
        rows: all
            .into_iter()
            .map(|rows| median_by(rows, Row::error))
            .collect(),
        before,
        failed,
    }
}

/// The item whose `key` is the median of `items`' (the lower middle of an even count); none
/// of none.
fn median_by<T>(mut items: Vec<T>, key: impl Fn(&T) -> f64) -> Option<T> {
    items.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let mid = items.len().saturating_sub(1) / 2;
    items.into_iter().nth(mid)
}

#[cfg(test)]
mod tests {
    use super::{median_by, Timing};

    #[test]
    fn a_layout_reports_its_median_round() {
        // Signed errors of 5 rounds: the median is +0.08, whichever order they ran in.
        let rounds = vec![(1, 0.31), (2, 0.08), (3, -0.02), (4, 0.12), (5, 0.05)];
        assert_eq!(median_by(rounds, |r| r.1), Some((2, 0.08)));
        // An even count takes the lower middle; no rounds, no row.
        assert_eq!(median_by(vec![0.3, -0.1, 0.2, 0.0], |x| *x), Some(0.0));
        assert_eq!(median_by(Vec::<f64>::new(), |x| *x), None);
    }

    #[test]
    fn short_steps_are_timed_for_at_least_the_minimum_seconds() {
        let t = Timing {
            steps: 3,
            min_seconds: 1.0,
        };
        // An 80 ms step: 13 steps fill a second; a 0.5 s step: --steps' 3 already do.
        assert_eq!(t.steps_for(0.08), 13);
        assert_eq!(t.steps_for(0.5), 3);
        let none = Timing {
            steps: 3,
            min_seconds: 0.0,
        };
        assert_eq!(none.steps_for(0.08), 3);
    }
}
