//! `ferrotron validate-cost`: the cost model against this machine. Each layout of each model
//! size is trained for a few steps (its own `train` process, ranks as threads sharing the
//! cores) and predicted by the same cost model `plan --hardware cpu-local` uses, with this
//! engine's kernels timed on this machine just before the run and again just after it
//! (`ferrotron_bench::kernel_times`; the two timings averaged, so that a machine whose speed drifts
//! drifts for both) and the collectives `bench-comm` measured; the table compares tokens per
//! second and the step's parts. The prediction uses kernel timings only, never the run's
//! own measurements; the summary also gives the errors of the kernels timed before the run
//! alone.

use std::path::PathBuf;

use anyhow::Context;
use ferrotron_bench::validate::{median, rounds, LayoutRun, Rounds, Row, Timing, LAYOUTS};

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

/// `ferrotron validate-cost`: every layout's rounds, the table and the errors' summary.
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
            ferrotron_bench::presets::PRESETS.contains(&size.as_str()),
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
    let mut runs: Vec<LayoutRun> = Vec::new();
    for size in &a.sizes {
        let mut base = ferrotron_bench::presets::preset(size).expect("checked above");
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
    } = rounds(
        &std::env::current_exe()?,
        (&runs, a.rounds),
        &root,
        timing,
        &mut |line| eprintln!("{line}"),
    );
    println!("\n| size | layout | measured tok/s | predicted tok/s | error | measured step, exposed comm, pipeline wait | predicted step = compute + bubble + exposed comm + host |\n|---|---|---|---|---|---|---|");
    for r in rows.iter().flatten() {
        println!("{}", r.line());
    }
    print_errors(&rows, &before, a.rounds);
    anyhow::ensure!(
        failed.is_empty(),
        "layouts failed to train:\n{}",
        failed.join("\n")
    );
    Ok(())
}

/// The summary of the errors: the median and worst of the layouts' median rounds, and of
/// the predictions from the kernels timed before each run only.
fn print_errors(rows: &[Option<Row>], before: &[Option<f64>], rounds: usize) {
    let errors: Vec<f64> = rows.iter().flatten().map(|r| r.error().abs()).collect();
    if errors.is_empty() {
        return;
    }
    let worst = |v: &[f64]| 100.0 * v.iter().fold(0.0f64, |w, e| w.max(*e));
    let runs = match rounds {
        1 => "one run each".to_string(),
        n => format!("each its median of {n} rounds"),
    };
    println!(
        "\n{} layouts ({runs}): median |predicted − measured| / measured {:.1}%, worst {:.1}%",
        errors.len(),
        100.0 * median(errors.clone()),
        worst(&errors)
    );
    let before: Vec<f64> = before.iter().flatten().map(|e| e.abs()).collect();
    println!(
        "predicted from the kernels timed before each run only (each layout's median round by that error): median {:.1}%, worst {:.1}%",
        100.0 * median(before.clone()),
        worst(&before)
    );
}
