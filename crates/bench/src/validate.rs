//! `validate-cost`'s measurement: the cost model against this machine. Each layout of each
//! model size is trained for a few steps (its own `train` process, ranks as threads sharing
//! the cores) and predicted by the same cost model `plan --hardware cpu-local` uses, with
//! this engine's kernels timed on this machine just before the run and again just after it
//! ([`crate::kernel_times`]; the two timings averaged, so that a machine whose speed drifts
//! drifts for both) and the collectives `bench-comm` measured. The prediction uses kernel
//! timings only, never the run's own measurements; the errors of the kernels timed before
//! the run alone are kept too.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrotron_config::Config;
use ferrotron_plan::cpu_kernels::{self, KernelRates};
use ferrotron_plan::{step_cost, CostModel, Job, StepCost};

use crate::BenchError;

/// Results of this module.
type Result<T> = std::result::Result<T, BenchError>;

/// The error of an I/O `action` on `path`.
fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> BenchError + 'a {
    move |source| BenchError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// One layout of one size to validate: the size, the layout, the size's config file.
pub type LayoutRun = (String, LayoutSpec, PathBuf);

/// A layout validated: its name, ranks and overrides.
pub type LayoutSpec = (&'static str, usize, &'static [&'static str]);

/// Every layout validated.
pub const LAYOUTS: [LayoutSpec; 14] = [
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
#[derive(Debug)]
pub struct Measured {
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Communication the step waited for, s.
    pub exposed_comm_s: f64,
    /// Time the pipeline waited for other stages, s.
    pub pipeline_wait_s: f64,
    /// The step, s.
    pub step_s: f64,
}

/// The median (the mean of the two middle values of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Trains `config` with `overrides` in a child `train` process of `exe` (the `ferrotron`
/// binary) in `dir`; its median step.
fn measure(exe: &Path, config: &Path, overrides: &[String], dir: &Path) -> Result<Measured> {
    let mut cmd = Command::new(exe);
    cmd.args(["train", "--quiet", "--overwrite", "--config"])
        .arg(config);
    for o in overrides {
        cmd.args(["--set", o]);
    }
    let quoted = toml::Value::String(dir.display().to_string()).to_string();
    cmd.args(["--set", &format!("run.dir={quoted}")]);
    let out = cmd.output().map_err(io("run", exe))?;
    if !out.status.success() {
        return Err(BenchError::Failed(format!(
            "train in {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).map_err(io("read", &metrics))?;
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|r: &serde_json::Value| r["step"].as_u64().is_some_and(|s| s > 2))
        .collect();
    if rows.is_empty() {
        return Err(BenchError::Failed(format!(
            "no timed steps in {}",
            dir.display()
        )));
    }
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
fn time_kernels(config: &Config, ranks: usize) -> Result<KernelRates> {
    let job = Job::from_config(config)?;
    let needs = cpu_kernels::kernel_needs(&job.model, &job.layout);
    let mut kernels = crate::kernel_times::kernel_times(&needs, config.train.threads, ranks, true)?;
    kernels.peak_flops = crate::peak::cached_peak(kernels.threads).unwrap_or(0.0);
    Ok(kernels)
}

/// The cost model's prediction of `config` on this machine from the kernel times `kernels`.
fn predict(config: &Config, ranks: usize, kernels: KernelRates) -> Result<StepCost> {
    let job = Job::from_config(config)?;
    let (mut hw, _) = crate::hardware::load_hardware("cpu-local")?;
    hw.gpus_per_node = hw.gpus_per_node.max(ranks);
    hw.kernels = Some(kernels);
    Ok(step_cost(&job, &hw, &CostModel::default())?)
}

/// One layout's kept run: the measured step and the predictions from its kernels timed just
/// before it (`before`) and, averaged, before and after it (`predicted`).
#[derive(Debug)]
pub struct Row {
    /// The model size (preset).
    pub size: String,
    /// The layout's name.
    pub name: &'static str,
    /// The run's measured step.
    pub measured: Measured,
    /// Predicted from the kernels timed before and after the run, averaged.
    pub predicted: StepCost,
    /// Predicted from the kernels timed before the run only.
    pub before: StepCost,
}

impl Row {
    /// Signed error of the prediction from the kernels timed before and after the run.
    pub fn error(&self) -> f64 {
        self.error_of(&self.predicted)
    }

    /// Signed error of the prediction from the kernels timed before the run only.
    pub fn error_before(&self) -> f64 {
        self.error_of(&self.before)
    }

    fn error_of(&self, p: &StepCost) -> f64 {
        let p_tps = p.tokens_per_step / p.step_s;
        (p_tps - self.measured.tokens_per_s) / self.measured.tokens_per_s
    }

    /// The row of the table (size, layout, measured and predicted tok/s, error, the step's
    /// parts measured and predicted).
    pub fn line(&self) -> String {
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
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Timed steps, at least.
    pub steps: usize,
    /// Seconds of timed steps, at least.
    pub min_seconds: f64,
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
    exe: &Path,
    (size, (name, ranks, sets), path): &LayoutRun,
    dir: &Path,
    timing: Timing,
) -> Result<Row> {
    let (name, ranks) = (*name, *ranks);
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
    let measured = measure(exe, path, &overrides, dir)?;
    // Timed again after the run: this machine's speed drifts over seconds, and the mean of
    // the two timings brackets the run.
    let after = time_kernels(&config, ranks)?;
    Ok(Row {
        size: size.clone(),
        name,
        measured,
        predicted: predict(&config, ranks, kernels.mean(&after))?,
        before,
    })
}

/// What the rounds kept, per layout, and the layouts that failed.
#[derive(Debug)]
pub struct Rounds {
    /// The median round by the error of the prediction from the kernels timed around it.
    pub rows: Vec<Option<Row>>,
    /// The median error of the predictions from the kernels timed before each run only.
    pub before: Vec<Option<f64>>,
    /// Layouts that failed to train, with the first line of their error.
    pub failed: Vec<String>,
}

/// Runs every layout `n` times, all of them once per round; per layout, its median round:
/// the run whose error (the prediction from the kernels timed around it against its
/// measurement) is the median of its rounds' errors.
/// Each run trains in a child `train` process of `exe` (the `ferrotron` binary) under
/// `root`; `progress` hears of each run as it starts and ends.
pub fn rounds(
    exe: &Path,
    (runs, n): (&[LayoutRun], usize),
    root: &Path,
    timing: Timing,
    progress: &mut dyn FnMut(&str),
) -> Rounds {
    let mut all: Vec<Vec<Row>> = runs.iter().map(|_| Vec::new()).collect();
    let mut failed = Vec::new();
    for round in 1..=n {
        for (i, run) in runs.iter().enumerate() {
            let (size, layout, _) = run;
            let dir = root.join(format!("{size}-{}", layout.0.replace(' ', "-")));
            progress(&format!("round {round}/{n}: {size} {}", layout.0));
            match run_layout(exe, run, &dir, timing) {
                Ok(row) => {
                    progress(&format!(
                        "  {} (before the run only: {:+.1}%)",
                        row.line(),
                        100.0 * row.error_before()
                    ));
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
pub fn median_by<T>(mut items: Vec<T>, key: impl Fn(&T) -> f64) -> Option<T> {
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
