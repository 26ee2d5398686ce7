//! A sweep (`ferrotron sweep`): trains every layout of a grid of configuration values one after
//! another, each as a child `ferrotron train --quiet` in its own run directory, and collects
//! the results into `sweep.csv` and `sweep.svg` (tokens/s per rank and MFU per layout, the
//! way the Ultra-Scale Playbook compares layouts). With `--backend slurm` it only writes one
//! batch script per layout and a `submit_all.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ferrotron_config::Config;
use ferrotron_report::{
    check_template, classify, error_message, expand_layouts, parse_grid, read_summary, shell_quote,
    slurm_script, sweep_csv, sweep_svg, write_atomic, Layout, SlurmJob, Status, SweepBar, SweepRow,
    DEFAULT_SLURM_TEMPLATE,
};

mod launch;

use crate::signals::Interrupted;
use crate::{say, Console, EngineError, Result};
use launch::{exit_signal, launch, make_executable};

/// The launcher `--backend mpi` uses unless told otherwise.
pub const DEFAULT_MPIRUN: &str = "mpirun -np {world} --allow-run-as-root --oversubscribe";

/// How the layouts of a sweep are run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SweepBackend {
    /// Ranks as threads of each child process.
    Threads,
    /// Each child under the `--mpirun` launcher, one process per rank.
    Mpi,
    /// Write Slurm batch scripts and `submit_all.sh`; run nothing.
    Slurm,
}

/// A sweep to run: the command line's `sweep` flags.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// Base TOML configuration shared by every layout.
    pub config: Option<PathBuf>,
    /// Swept keys and their values, `SECTION.KEY=V1,V2,...` each; every combination is one
    /// layout.
    pub grid: Vec<String>,
    /// Fixed overrides applied to every layout, `SECTION.KEY=VALUE` each.
    pub set: Vec<String>,
    /// Output directory: a run directory per layout, `sweep.csv` and `sweep.svg`.
    pub out: PathBuf,
    /// Where the layouts run.
    pub backend: SweepBackend,
    /// Launcher for [`SweepBackend::Mpi`], split on whitespace; `{world}` becomes the
    /// layout's number of ranks.
    pub mpirun: String,
    /// Batch-script template for [`SweepBackend::Slurm`] (default: the built-in one).
    pub slurm_template: Option<PathBuf>,
    /// GPUs per node for [`SweepBackend::Slurm`].
    pub gpus_per_node: usize,
    /// Stop a run still going after this many seconds and record it as crashed.
    pub timeout_s: Option<f64>,
    /// The `ferrotron` executable each layout runs (`train --quiet ...`).
    pub exe: PathBuf,
    /// Catch SIGTERM, SIGINT and SIGUSR1 for the sweep's duration: each is forwarded to
    /// the run in progress, which saves its checkpoint, and the sweep stops after it.
    pub signals: bool,
}

/// What every launch shares.
struct Sweep<'a> {
    args: &'a SweepOptions,
    exe: String,
    config: Option<String>,
    out: PathBuf,
    timeout: Option<Duration>,
}

/// A path as UTF-8 text (the child's arguments and scripts need one).
fn utf8(path: &Path, what: &str) -> Result<String> {
    match path.to_str() {
        Some(s) => Ok(s.to_string()),
        None => Err(refused(format!(
            "{what} {}: the path must be valid UTF-8",
            path.display()
        ))),
    }
}

/// An option refused before any work.
fn refused(message: String) -> EngineError {
    EngineError::Refused(message)
}

/// An I/O error while doing `what`.
fn failed<E: std::fmt::Display>(what: String) -> impl FnOnce(E) -> EngineError {
    move |e| EngineError::Failed(format!("{what}: {e}"))
}

/// Runs (or, for Slurm, scripts) every layout of the grid; `console` hears each layout as
/// it starts ([`Console::task`]) and ends. Returns how a stop signal interrupted it, if one
/// did.
///
/// # Errors
///
/// A refused option before any work, or a results file that could not be written; a
/// layout that fails is a row of the results, not an error.
pub fn sweep(args: &SweepOptions, console: &dyn Console) -> Result<Option<Interrupted>> {
    let axes = parse_grid(&args.grid).map_err(|e| refused(e.to_string()))?;
    let layouts = expand_layouts(&axes);
    let keys: Vec<String> = axes.iter().map(|a| a.key.clone()).collect();
    note_sets(&args.set, &keys, console)?;
    let sweep = Sweep::new(args)?;
    if args.backend == SweepBackend::Slurm {
        sweep.write_slurm(&layouts, console)?;
        return Ok(None);
    }
    // A signal is forwarded to the run in progress; the sweep stops after it.
    let _signals = match args.signals {
        true => Some(
            crate::signals::install(false)
                .map_err(failed("installing the signal handlers".into()))?,
        ),
        false => None,
    };
    let rows = sweep.run_all(&layouts, &keys, console)?;
    sweep.report(&rows, &keys, console)?;
    let received = crate::signals::received().filter(|_| args.signals);
    Ok(received.map(|r| Interrupted {
        cause: ferrotron_train::stop::StopCause::Signal(r.first),
        message: format!(
            "sweep stopped by {} after {} of {} layouts; the interrupted run saved its checkpoint",
            ferrotron_train::stop::signal_name(r.first),
            rows.len(),
            layouts.len()
        ),
    }))
}

/// Refuses a `--set` that is not `section.key=value`, and says which ones the grid or the
/// sweep replaces.
fn note_sets(sets: &[String], keys: &[String], console: &dyn Console) -> Result<()> {
    for item in sets {
        let Some((key, _)) = item.split_once('=') else {
            return Err(refused(format!(
                "--set `{item}`: expected section.key=value, e.g. --set train.steps=20"
            )));
        };
        if keys.iter().any(|k| k == key.trim()) {
            say!(
                console,
                "note: --set {item} is replaced by the --grid values of {key}"
            );
        } else if key.trim() == "run.dir" {
            say!(
                console,
                "note: --set {item} is ignored: each layout runs in <out>/<layout>"
            );
        }
    }
    Ok(())
}

impl<'a> Sweep<'a> {
    /// Checks the arguments (the base configuration readable, the output directory created,
    /// a positive timeout, a launcher for MPI) before anything runs.
    fn new(args: &'a SweepOptions) -> Result<Sweep<'a>> {
        let config = match &args.config {
            Some(path) => {
                let named = || format!("--config {}", path.display());
                std::fs::metadata(path).map_err(|e| {
                    refused(format!(
                        "{}: cannot read the base configuration: {e}",
                        named()
                    ))
                })?;
                let abs = std::path::absolute(path).map_err(failed(named()))?;
                Some(utf8(&abs, "--config")?)
            }
            None => None,
        };
        let out_named = || format!("--out {}", args.out.display());
        std::fs::create_dir_all(&args.out).map_err(|e| {
            refused(format!(
                "{}: cannot create the output directory: {e}",
                out_named()
            ))
        })?;
        let out = std::path::absolute(&args.out).map_err(failed(out_named()))?;
        utf8(&out, "--out")?;
        let timeout = match args.timeout_s {
            Some(s) => Some(
                Duration::try_from_secs_f64(s)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        refused(format!(
                            "--timeout-s {s}: give a positive number of seconds"
                        ))
                    })?,
            ),
            None => None,
        };
        if args.backend == SweepBackend::Mpi && args.mpirun.split_whitespace().next().is_none() {
            return Err(refused(format!(
                "--mpirun is empty: give a launcher such as \"{DEFAULT_MPIRUN}\""
            )));
        }
        Ok(Sweep {
            args,
            exe: utf8(&args.exe, "executable")?,
            config,
            out,
            timeout,
        })
    }

    /// Runs every layout in turn, rewriting `sweep.csv` after each.
    fn run_all(
        &self,
        layouts: &[Layout],
        keys: &[String],
        console: &dyn Console,
    ) -> Result<Vec<SweepRow>> {
        let csv_path = self.out.join("sweep.csv");
        let mut rows: Vec<SweepRow> = Vec::with_capacity(layouts.len());
        for (i, layout) in layouts.iter().enumerate() {
            console.task(i, layouts.len(), &layout.name);
            let mut row = self.run_layout(layout);
            let signalled = self.args.signals && crate::signals::received().is_some();
            if signalled && row.status != Status::Ok {
                row.status = Status::Interrupted;
            }
            say!(console, "[{}/{}] {}", i + 1, layouts.len(), row.describe());
            rows.push(row);
            write_atomic(&csv_path, sweep_csv(keys, &rows).as_bytes())
                .map_err(failed(format!("writing {}", csv_path.display())))?;
            if signalled {
                break;
            }
        }
        console.end();
        Ok(rows)
    }

    /// Writes `sweep.svg` and says how many layouts ran, the best, and where the results are.
    fn report(&self, rows: &[SweepRow], keys: &[String], console: &dyn Console) -> Result<()> {
        let bars: Vec<SweepBar> = rows.iter().map(SweepRow::bar).collect();
        let ok = rows.iter().filter(|r| r.status == Status::Ok).count();
        let over = if keys.is_empty() {
            "the base configuration".to_string()
        } else {
            keys.join(" × ")
        };
        let title = format!("Sweep over {over}: {ok} of {} layouts ran", rows.len());
        let svg_path = self.out.join("sweep.svg");
        write_atomic(&svg_path, sweep_svg(&title, &bars).as_bytes())
            .map_err(failed(format!("writing {}", svg_path.display())))?;
        let best = bars
            .iter()
            .filter_map(|b| Some((b.tokens_per_s_per_rank?, &b.name)))
            .max_by(|a, b| a.0.total_cmp(&b.0));
        say!(console, "sweep: {ok} of {} layouts ran", rows.len());
        if let Some((tps, name)) = best {
            say!(console, "best: {name} at {tps:.0} tokens/s per rank");
        }
        say!(
            console,
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
    fn world(&self, overrides: &[String]) -> std::result::Result<usize, String> {
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
    fn write_slurm(&self, layouts: &[Layout], console: &dyn Console) -> Result<()> {
        let (template, from) = match &self.args.slurm_template {
            Some(path) => (
                std::fs::read_to_string(path).map_err(|e| {
                    refused(format!(
                        "--slurm-template {}: cannot read it: {e}",
                        path.display()
                    ))
                })?,
                path.display().to_string(),
            ),
            None => (DEFAULT_SLURM_TEMPLATE.to_string(), "(default)".to_string()),
        };
        if let Err(why) = check_template(&template) {
            return Err(refused(format!("--slurm-template {from}: {why}")));
        }
        if self.args.gpus_per_node == 0 {
            return Err(refused(
                "--gpus-per-node 0: give the number of GPUs (ranks) per node, e.g. 8".into(),
            ));
        }
        let mut submit = String::from("#!/bin/sh\n# Submits every layout of this sweep (written by `ferrotron sweep --backend slurm`).\nset -e\n");
        let mut written = 0;
        for layout in layouts {
            let dir = self.out.join(&layout.name);
            let overrides = self.overrides(layout, &dir);
            let world = match self.world(&overrides) {
                Ok(w) => w,
                Err(e) => {
                    say!(console, "{}: invalid_layout, no script — {e}", layout.name);
                    submit.push_str(&format!(
                        "# skipped {} (invalid_layout): {e}\n",
                        layout.name
                    ));
                    continue;
                }
            };
            std::fs::create_dir_all(&dir)
                .map_err(failed(format!("cannot create {}", dir.display())))?;
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
            write_atomic(&path, slurm_script(&template, &job).as_bytes())
                .map_err(failed(format!("writing {}", path.display())))?;
            make_executable(&path)?;
            submit.push_str(&format!(
                "sbatch {}\n",
                shell_quote(&path.to_string_lossy())
            ));
            written += 1;
        }
        let path = self.out.join("submit_all.sh");
        write_atomic(&path, submit.as_bytes())
            .map_err(failed(format!("writing {}", path.display())))?;
        make_executable(&path)?;
        say!(
            console,
            "wrote {written} of {} batch scripts; submit them with `sh {}` (nothing was run)",
            layouts.len(),
            path.display()
        );
        Ok(())
    }
}
