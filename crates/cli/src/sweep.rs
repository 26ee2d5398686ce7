//! `ferrotron sweep`: trains every layout of a grid of configuration values one after
//! another, each as a child `ferrotron train --quiet` in its own run directory, and collects
//! the results into `sweep.csv` and `sweep.svg` (tokens/s per rank and MFU per layout, the
//! way the Ultra-Scale Playbook compares layouts). With `--backend slurm` it only writes one
//! batch script per layout and a `submit_all.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferrotron_config::Config;
use ferrotron_report::{
    check_template, classify, error_message, expand_layouts, parse_grid, read_summary, shell_quote,
    slurm_script, sweep_csv, sweep_svg, write_atomic, Layout, SlurmJob, Status, SweepBar, SweepRow,
    DEFAULT_SLURM_TEMPLATE,
};
use indicatif::{ProgressBar, ProgressStyle};

mod launch;

use launch::{exit_signal, launch, make_executable};

const DEFAULT_MPIRUN: &str = "mpirun -np {world} --allow-run-as-root --oversubscribe";

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

/// What every launch shares.
struct Sweep<'a> {
    args: &'a SweepArgs,
    exe: String,
    config: Option<String>,
    out: PathBuf,
    timeout: Option<Duration>,
}

/// A path as UTF-8 text (the child's arguments and scripts need one).
fn utf8(path: &Path, what: &str) -> anyhow::Result<String> {
    match path.to_str() {
        Some(s) => Ok(s.to_string()),
        None => bail!("{what} {}: the path must be valid UTF-8", path.display()),
    }
}

/// Runs (or, for Slurm, scripts) every layout of the grid.
pub fn run(args: SweepArgs) -> anyhow::Result<()> {
    let axes = parse_grid(&args.grid)?;
    let layouts = expand_layouts(&axes);
    let keys: Vec<String> = axes.iter().map(|a| a.key.clone()).collect();
    note_sets(&args.set, &keys)?;
    let sweep = Sweep::new(&args)?;
    if args.backend == SweepBackend::Slurm {
        return sweep.write_slurm(&layouts);
    }
    // A signal is forwarded to the run in progress; the sweep stops after it.
    crate::signals::install(false).context("installing the signal handlers")?;
    let rows = sweep.run_all(&layouts, &keys)?;
    sweep.report(&rows, &keys)?;
    match crate::signals::received() {
        Some(r) => Err(crate::signals::Interrupted {
            cause: ferrotron_train::stop::StopCause::Signal(r.first),
            message: format!(
                "sweep stopped by {} after {} of {} layouts; the interrupted run saved its checkpoint",
                ferrotron_train::stop::signal_name(r.first),
                rows.len(),
                layouts.len()
            ),
        }
        .into()),
        None => Ok(()),
    }
}

/// Refuses a `--set` that is not `section.key=value`, and says which ones the grid or the
/// sweep replaces.
fn note_sets(sets: &[String], keys: &[String]) -> anyhow::Result<()> {
    for item in sets {
        let Some((key, _)) = item.split_once('=') else {
            bail!("--set `{item}`: expected section.key=value, e.g. --set train.steps=20");
        };
        if keys.iter().any(|k| k == key.trim()) {
            eprintln!("note: --set {item} is replaced by the --grid values of {key}");
        } else if key.trim() == "run.dir" {
            eprintln!("note: --set {item} is ignored: each layout runs in <out>/<layout>");
        }
    }
    Ok(())
}

impl<'a> Sweep<'a> {
    /// Checks the arguments (the base configuration readable, the output directory created,
    /// a positive timeout, a launcher for MPI) before anything runs.
    fn new(args: &'a SweepArgs) -> anyhow::Result<Sweep<'a>> {
        let config = match &args.config {
            Some(path) => {
                std::fs::metadata(path).with_context(|| {
                    format!(
                        "--config {}: cannot read the base configuration",
                        path.display()
                    )
                })?;
                let abs = std::path::absolute(path)
                    .with_context(|| format!("--config {}", path.display()))?;
                Some(utf8(&abs, "--config")?)
            }
            None => None,
        };
        std::fs::create_dir_all(&args.out).with_context(|| {
            format!(
                "--out {}: cannot create the output directory",
                args.out.display()
            )
        })?;
        let out = std::path::absolute(&args.out)
            .with_context(|| format!("--out {}", args.out.display()))?;
        utf8(&out, "--out")?;
        let exe = std::env::current_exe()
            .context("cannot locate the ferrotron executable to launch runs")?;
        let timeout = match args.timeout_s {
            Some(s) => Some(
                Duration::try_from_secs_f64(s)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .with_context(|| {
                        format!("--timeout-s {s}: give a positive number of seconds")
                    })?,
            ),
            None => None,
        };
        if args.backend == SweepBackend::Mpi && args.mpirun.split_whitespace().next().is_none() {
            bail!("--mpirun is empty: give a launcher such as \"{DEFAULT_MPIRUN}\"");
        }
        Ok(Sweep {
            args,
            exe: utf8(&exe, "executable")?,
            config,
            out,
            timeout,
        })
    }

    /// Runs every layout in turn, rewriting `sweep.csv` after each.
    fn run_all(&self, layouts: &[Layout], keys: &[String]) -> anyhow::Result<Vec<SweepRow>> {
        let bar = ProgressBar::new(layouts.len() as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} layouts [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .context("progress bar template")?,
        );
        let csv_path = self.out.join("sweep.csv");
        let mut rows: Vec<SweepRow> = Vec::with_capacity(layouts.len());
        for (i, layout) in layouts.iter().enumerate() {
            bar.set_message(layout.name.clone());
            let mut row = self.run_layout(layout);
            let signalled = crate::signals::received().is_some();
            if signalled && row.status != Status::Ok {
                row.status = Status::Interrupted;
            }
            bar.suspend(|| eprintln!("[{}/{}] {}", i + 1, layouts.len(), row.describe()));
            rows.push(row);
            write_atomic(&csv_path, sweep_csv(keys, &rows).as_bytes())?;
            bar.inc(1);
            if signalled {
                break;
            }
        }
        bar.finish_and_clear();
        Ok(rows)
    }

    /// Writes `sweep.svg` and says how many layouts ran, the best, and where the results are.
    fn report(&self, rows: &[SweepRow], keys: &[String]) -> anyhow::Result<()> {
        let bars: Vec<SweepBar> = rows.iter().map(SweepRow::bar).collect();
        let ok = rows.iter().filter(|r| r.status == Status::Ok).count();
        let over = if keys.is_empty() {
            "the base configuration".to_string()
        } else {
            keys.join(" × ")
        };
        let title = format!("Sweep over {over}: {ok} of {} layouts ran", rows.len());
        let svg_path = self.out.join("sweep.svg");
        write_atomic(&svg_path, sweep_svg(&title, &bars).as_bytes())?;
        let best = bars
            .iter()
            .filter_map(|b| Some((b.tokens_per_s_per_rank?, &b.name)))
            .max_by(|a, b| a.0.total_cmp(&b.0));
        eprintln!("sweep: {ok} of {} layouts ran", rows.len());
        if let Some((tps, name)) = best {
            eprintln!("best: {name} at {tps:.0} tokens/s per rank");
        }
        eprintln!(
            "results: {}\nchart: {}",
            self.out.join("sweep.csv").display(),
            svg_path.display()
        );
        Ok(())
    }
}

/// A TOML basic string holding `text`.
fn toml_string(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A one-line version of a multi-line message.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl Sweep<'_> {
    /// Every `--set` of one layout: the fixed ones, the grid's, its run directory, and the
    /// MPI backend when the launcher starts one process per rank.
    fn overrides(&self, layout: &Layout, dir: &Path) -> Vec<String> {
        let mut all = self.args.set.clone();
        all.extend(layout.overrides());
        all.push(format!("run.dir={}", toml_string(&dir.to_string_lossy())));
        if self.args.backend != SweepBackend::Threads {
            all.push("parallel.backend=mpi".to_string());
        }
        all
    }

    /// The arguments of `ferrotron` for one layout: `train --quiet [--config F] --set ...`.
    fn train_args(&self, overrides: &[String]) -> Vec<String> {
        let mut argv = vec!["train".to_string(), "--quiet".to_string()];
        if let Some(config) = &self.config {
            argv.extend(["--config".to_string(), config.clone()]);
        }
        for item in overrides {
            argv.extend(["--set".to_string(), item.clone()]);
        }
        argv
    }

    /// Ranks of a layout, or why its configuration is refused.
    fn world(&self, overrides: &[String]) -> Result<usize, String> {
        Config::load(self.config.as_deref().map(Path::new), overrides)
            .map(|c| c.parallel.world_size())
            .map_err(|e| one_line(&e.to_string()))
    }

    /// Runs one layout to completion and classifies the outcome; never fails the sweep.
    fn run_layout(&self, layout: &Layout) -> SweepRow {
        let dir = self.out.join(&layout.name);
        let mut row = SweepRow {
            layout: layout.name.clone(),
            values: layout.assignments.iter().map(|(_, v)| v.clone()).collect(),
            status: Status::Crashed,
            world: None,
            summary: None,
            error: String::new(),
            wall_s: 0.0,
        };
        let overrides = self.overrides(layout, &dir);
        let world = self.world(&overrides);
        row.world = world.as_ref().ok().copied();
        let mut cmd = match (self.args.backend, &world) {
            (SweepBackend::Mpi, Err(e)) => {
                // Without a valid layout there is no world size to launch.
                row.status = Status::InvalidLayout;
                row.error = e.clone();
                return row;
            }
            (SweepBackend::Mpi, Ok(w)) => {
                let line = self.args.mpirun.replace("{world}", &w.to_string());
                let mut words = line.split_whitespace();
                let mut cmd = Command::new(words.next().unwrap_or("mpirun"));
                cmd.args(words).arg(&self.exe);
                cmd
            }
            _ => Command::new(&self.exe),
        };
        cmd.args(self.train_args(&overrides));
        let started = Instant::now();
        let under_mpirun = self.args.backend == SweepBackend::Mpi;
        let result = launch(&mut cmd, &dir, (self.timeout, under_mpirun));
        row.wall_s = started.elapsed().as_secs_f64();
        let status = match result {
            Ok(status) => status,
            Err(e) => {
                row.error = e;
                return row;
            }
        };
        let stderr = std::fs::read(dir.join("stderr.log")).unwrap_or_default();
        let stderr = String::from_utf8_lossy(&stderr);
        let signal = exit_signal(&status);
        row.status = classify(status.success(), signal, &stderr);
        if row.status == Status::Ok {
            match read_summary(&dir.join("summary.json")) {
                Ok(summary) => row.summary = Some(summary),
                Err(e) => {
                    row.status = Status::Crashed;
                    row.error = format!("exited successfully but wrote no usable summary: {e}");
                }
            }
        } else {
            let fallback = match signal {
                Some(s) => format!("killed by signal {s}"),
                None => format!("exited with {status}"),
            };
            row.error = error_message(&stderr, &fallback);
        }
        row
    }

    /// Writes `<out>/<layout>/job.sbatch` per valid layout and `<out>/submit_all.sh`.
    fn write_slurm(&self, layouts: &[Layout]) -> anyhow::Result<()> {
        let (template, from) = match &self.args.slurm_template {
            Some(path) => (
                std::fs::read_to_string(path).with_context(|| {
                    format!("--slurm-template {}: cannot read it", path.display())
                })?,
                path.display().to_string(),
            ),
            None => (DEFAULT_SLURM_TEMPLATE.to_string(), "(default)".to_string()),
        };
        if let Err(why) = check_template(&template) {
            bail!("--slurm-template {from}: {why}");
        }
        if self.args.gpus_per_node == 0 {
            bail!("--gpus-per-node 0: give the number of GPUs (ranks) per node, e.g. 8");
        }
        let mut submit = String::from("#!/bin/sh\n# Submits every layout of this sweep (written by `ferrotron sweep --backend slurm`).\nset -e\n");
        let mut written = 0;
        for layout in layouts {
            let dir = self.out.join(&layout.name);
            let overrides = self.overrides(layout, &dir);
            let world = match self.world(&overrides) {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("{}: invalid_layout, no script — {e}", layout.name);
                    submit.push_str(&format!(
                        "# skipped {} (invalid_layout): {e}\n",
                        layout.name
                    ));
                    continue;
                }
            };
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let mut argv = vec![self.exe.clone()];
            argv.extend(self.train_args(&overrides));
            let dir_text = dir.to_string_lossy();
            let job = SlurmJob {
                layout: &layout.name,
                world,
                gpus_per_node: self.args.gpus_per_node,
                dir: &dir_text,
                argv: &argv,
            };
            let path = dir.join("job.sbatch");
            write_atomic(&path, slurm_script(&template, &job).as_bytes())?;
            make_executable(&path)?;
            submit.push_str(&format!(
                "sbatch {}\n",
                shell_quote(&path.to_string_lossy())
            ));
            written += 1;
        }
        let path = self.out.join("submit_all.sh");
        write_atomic(&path, submit.as_bytes())?;
        make_executable(&path)?;
        eprintln!(
            "wrote {written} of {} batch scripts; submit them with `sh {}` (nothing was run)",
            layouts.len(),
            path.display()
        );
        Ok(())
    }
}
