//! `ferrotron sweep` ([`ferrotron_engine::sweep`]): trains every layout of a grid of configuration values one after
//! another, each as a child `ferrotron train --quiet` in its own run directory, and collects
//! the results into `sweep.csv` and `sweep.svg` (tokens/s per rank and MFU per layout, the
//! way the Ultra-Scale Playbook compares layouts). With `--backend slurm` it only writes one
//! batch script per layout and a `submit_all.sh`.

use std::path::PathBuf;

use anyhow::Context;
use ferrotron_engine::sweep::{sweep, SweepOptions, DEFAULT_MPIRUN};
use ferrotron_engine::Console;
use indicatif::{ProgressBar, ProgressStyle};

/// How the layouts of a sweep are run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SweepBackend {
    /// Ranks as threads of each child process.
    Threads,
    /// Each child under the `--mpirun` launcher, one process per rank.
    Mpi,
    /// Write Slurm batch scripts and `submit_all.sh`; run nothing.
    Slurm,
}

/// Arguments of `sweep`.
#[derive(clap::Args)]
pub struct SweepArgs {
    /// Base TOML configuration shared by every layout (defaults for every missing key).
    #[arg(long)]
    config: Option<PathBuf>,
    /// A swept key and its comma-separated values, e.g. `--grid parallel.dp=1,2,4`
    /// (repeatable; every combination of the grids is one layout).
    #[arg(long = "grid", value_name = "SECTION.KEY=V1,V2,...")]
    grid: Vec<String>,
    /// A fixed override applied to every layout, e.g. `--set train.steps=20` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Output directory: a run directory per layout, `sweep.csv` and `sweep.svg`.
    #[arg(long)]
    out: PathBuf,
    /// Where the layouts run.
    #[arg(long, value_enum, default_value_t = SweepBackend::Threads)]
    backend: SweepBackend,
    /// Launcher for `--backend mpi`, split on whitespace; `{world}` becomes the layout's
    /// number of ranks (dp·tp·pp·cp).
    #[arg(long, default_value = DEFAULT_MPIRUN)]
    mpirun: String,
    /// Batch-script template for `--backend slurm`, with placeholders {command}, {job_name},
    /// {layout}, {nodes}, {ntasks}, {ntasks_per_node}, {gpus_per_node}, {world} and {dir}.
    #[arg(long)]
    slurm_template: Option<PathBuf>,
    /// GPUs per node for `--backend slurm` (a layout of N ranks asks for ⌈N / this⌉ nodes).
    #[arg(long, default_value_t = 8)]
    gpus_per_node: usize,
    /// Stop a run still going after this many seconds and record it as crashed.
    #[arg(long, value_name = "SECONDS")]
    timeout_s: Option<f64>,
}

impl SweepBackend {
    fn engine(self) -> ferrotron_engine::sweep::SweepBackend {
        use ferrotron_engine::sweep::SweepBackend as B;
        match self {
            SweepBackend::Threads => B::Threads,
            SweepBackend::Mpi => B::Mpi,
            SweepBackend::Slurm => B::Slurm,
        }
    }
}

/// Runs (or, for Slurm, scripts) every layout of the grid, with a progress bar of layouts.
pub fn run(args: SweepArgs) -> anyhow::Result<()> {
    let options = SweepOptions {
        config: args.config,
        grid: args.grid,
        set: args.set,
        out: args.out,
        backend: args.backend.engine(),
        mpirun: args.mpirun,
        slurm_template: args.slurm_template,
        gpus_per_node: args.gpus_per_node,
        timeout_s: args.timeout_s,
        exe: std::env::current_exe()
            .context("cannot locate the ferrotron executable to launch runs")?,
        signals: true,
    };
    match sweep(&options, &Layouts(ProgressBar::hidden()))? {
        Some(stop) => Err(stop.into()),
        None => Ok(()),
    }
}

/// The sweep's progress: a bar of layouts, its lines above it.
struct Layouts(ProgressBar);

impl Console for Layouts {
    fn say(&self, line: &str) {
        self.0.suspend(|| eprintln!("{line}"));
    }

    fn task(&self, done: usize, total: usize, name: &str) {
        if done == 0 {
            self.0
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
            self.0.set_length(total as u64);
            self.0.set_style(
                ProgressStyle::with_template(
                    "{bar:30} {pos}/{len} layouts [{elapsed_precise}<{eta_precise}] {msg}",
                )
                .expect("valid template"),
            );
        }
        self.0.set_position(done as u64);
        self.0.set_message(name.to_string());
    }

    fn end(&self) {
        self.0.finish_and_clear();
    }
}
