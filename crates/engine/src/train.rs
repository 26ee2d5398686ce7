//! [`train`]: the configuration (resumed or initialised from a saved model), checks before
//! any work, the ranks' runs (as threads, on GPUs or as this MPI process's rank), then the
//! process's memory and the trace.

use std::sync::Arc;
use std::time::Instant;

use ferrotron_bench::presets::rss_bytes;
use ferrotron_config::{CommBackend, Config};
use ferrotron_train::checkpoint::Checkpoint;
use ferrotron_train::launch::{on_thread_ranks, on_thread_ranks_on, topology};
use ferrotron_train::stop::{StopFlag, Stopped};
use ferrotron_train::trace_files::TraceSink;
use ferrotron_train::{Init, RunSummary, Trainer};

use crate::drive::drive;
use crate::resume::{check_output_dir, init_from, open_resume};
use crate::shared::Shared;
use crate::signals::Interrupted;
use crate::{overwrite, say, Console, EngineError, Result, TrainOptions};

/// How a run ended, when it did not fail.
#[derive(Debug)]
pub enum Outcome {
    /// Every step trained; `summary.json` is written. The summary is the leader's (`None`
    /// in the processes of an MPI job that do not hold rank 0).
    Finished(Option<Box<RunSummary>>),
    /// `dry_run`: the grid of ranks and each rank's groups (and notes on the layout), as
    /// text; nothing trained.
    DryRun(String),
    /// A signal (or [`crate::TrainHandle::stop`]) stopped the run after a step every rank
    /// agreed on; its checkpoint is saved and `summary.json` says `"interrupted"`.
    Interrupted {
        /// Where and why it stopped.
        stop: Interrupted,
        /// The leader's summary of the steps trained (`None` in the processes of an MPI job
        /// that do not hold rank 0).
        summary: Option<Box<RunSummary>>,
    },
}

/// Runs `options` to the end: checks before any work, every rank of this process, the
/// summary, the saved model and the trace. `console` receives the run's lines and the
/// leader's progress.
///
/// # Errors
///
/// A refused option or path, configuration, data or checkpoint ([`EngineError`]), or the
/// failure of a rank.
pub fn train(options: &TrainOptions, console: Arc<dyn Console>) -> Result<Outcome> {
    Prepared::new(options, console)?.run(StopFlag::new())
}

/// A run checked and ready to start: its configuration, where its weights come from, the
/// traced steps.
pub(crate) struct Prepared {
    config: Config,
    resume: Option<Checkpoint>,
    weights: Option<Vec<f32>>,
    /// The dry run's text, when that is all the run does.
    dry_run: Option<String>,
    trace: Option<(usize, usize)>,
    rss_baseline: Option<u64>,
    options: TrainOptions,
    console: Arc<dyn Console>,
}

impl Prepared {
    /// The configuration (resumed or initialised from a saved model) and every check that
    /// comes before any work.
    pub(crate) fn new(options: &TrainOptions, console: Arc<dyn Console>) -> Result<Prepared> {
        let rss_baseline = rss_bytes();
        if let Some(dir) = &options.save_model {
            check_output_dir(dir, "--save-model")?;
            overwrite::check_model_dir(dir, "--save-model", options.overwrite)?;
        }
        let mut config = options.load_config()?;
        let resume = match &options.resume {
            Some(spec) => {
                let (c, checkpoint) = open_resume(options, config, spec, &*console)?;
                config = c;
                Some(checkpoint)
            }
            None => None,
        };
        let weights = match &options.init_from {
            Some(dir) => Some(init_from(dir, &mut config, &*console)?),
            None => None,
        };
        if options.overwrite && resume.is_none() {
            let root = config.checkpoint.dir_for(&config.run.dir);
            overwrite::check_checkpoint_root(&config.run.dir, &root)?;
        }
        let (dry_run, trace) = match options.dry_run {
            true => (Some(dry_run(&config)?), None),
            false => {
                check_before_work(&config, options)?;
                // The steps this run trains: after a resumed checkpoint's, up to train.steps.
                let first = resume.as_ref().map_or(0, |c| c.manifest.step) + 1;
                (None, options.traced_steps(first, config.train.steps)?)
            }
        };
        Ok(Prepared {
            config,
            resume,
            weights,
            dry_run,
            trace,
            rss_baseline,
            options: options.clone(),
            console,
        })
    }

    /// Every rank of this process, then the process's memory and the trace; `stop` stops
    /// the run after the step every rank agrees on (as do the stop signals, with
    /// `options.signals`).
    pub(crate) fn run(self, stop: StopFlag) -> Result<Outcome> {
        if let Some(text) = self.dry_run {
            return Ok(Outcome::DryRun(text));
        }
        // The handlers stay until the run's end (this guard's drop).
        let _signals = match self.options.signals {
            true => {
                let grace = std::time::Duration::from_secs_f64(self.config.run.signal_grace_s);
                let console = Arc::downgrade(&self.console);
                let guard = crate::signals::watch(stop.clone(), grace, console).map_err(|e| {
                    EngineError::Failed(format!("installing the signal handlers: {e}"))
                })?;
                Some(guard)
            }
            false => None,
        };
        let shared = Shared {
            stop: Some(stop),
            sink: TraceSink::new(Instant::now(), self.trace),
            console: self.console,
            options: self.options,
            summary: Default::default(),
        };
        let init = match (&self.resume, &self.weights) {
            (Some(c), _) => Init::Checkpoint(c),
            (None, Some(w)) => Init::Weights(w),
            (None, None) => Init::Fresh,
        };
        let stopped = launch(&self.config, init, &shared)?;
        let summary = shared.summary.lock().ok().and_then(|mut s| s.take());
        report_process(&self.config, self.rss_baseline, shared)?;
        Ok(match stopped {
            Some(stopped) => Outcome::Interrupted {
                stop: Interrupted {
                    cause: stopped.cause,
                    message: format!(
                        "the run stopped after step {} ({}); summary.json says \"interrupted\"",
                        stopped.step,
                        stopped.cause.name()
                    ),
                },
                summary: summary.map(Box::new),
            },
            None => Outcome::Finished(summary.map(Box::new)),
        })
    }
}

/// The grid of ranks and each rank's groups, with the notes on the pipeline split and the
/// context-parallel balance.
fn dry_run(config: &Config) -> Result<String> {
    let mut out = topology(config)?.to_string();
    if let Some(note) = crate::pp_split::hint(config) {
        out.push('\n');
        out.push_str(&note);
    }
    if config.parallel.cp > 1 {
        out.push('\n');
        out.push_str(
            ferrotron_train::launch::cp_balance_report(&config.model, config.parallel.cp)
                .map_err(|e| EngineError::Refused(e.to_string()))?
                .trim_end(),
        );
    }
    Ok(out)
}

/// The run directory is writable, the data's vocabulary fits the model (from the sidecars;
/// each rank opens and checks the files again) and the run fits the memory it will run in.
fn check_before_work(config: &Config, options: &TrainOptions) -> Result<()> {
    check_output_dir(&config.run.dir, "run.dir")?;
    for path in config
        .data
        .training_paths()
        .into_iter()
        .chain(config.data.eval_path.as_deref())
    {
        ferrotron_data::check_vocab_of(path, config.model.vocab)
            .map_err(ferrotron_train::TrainError::from)?;
    }
    if !options.no_memory_check {
        ferrotron_devices::memory_check::check(config)?;
    }
    Ok(())
}

/// Runs every rank of this process: the ranks as threads (on the devices' backends where
/// the run has them), the one rank, or this MPI process's rank.
/// Returns where the run stopped if a signal stopped it early.
fn launch(config: &Config, init: Init<'_>, shared: &Shared) -> Result<Option<Stopped>> {
    let world = topology(config)?.world_size();
    let options = &shared.options;
    let backends = match config.parallel.backend {
        CommBackend::Threads => {
            ferrotron_devices::thread_backends(config, world, !options.no_memory_check)?
        }
        CommBackend::Mpi => None,
    };
    let fault = options.fault()?;
    let fail_at = |rank: usize| fault.and_then(|(r, s)| (r == rank).then_some(s));
    let run = |mut trainer: Trainer| {
        trainer.faults.fail_at_step = fail_at(trainer.rank());
        drive(trainer, shared)
    };
    let stopped = match config.parallel.backend {
        CommBackend::Threads if backends.is_some() => {
            let backends = backends.unwrap_or_default();
            on_thread_ranks_on(config, init, &|rank| backends[rank].clone(), run)?
        }
        CommBackend::Threads if world == 1 => {
            let trainer = match init {
                Init::Checkpoint(c) => Trainer::resume(config.clone(), c)?,
                Init::Weights(w) => Trainer::with_weights(config.clone(), w)?,
                Init::Fresh => Trainer::new(config.clone())?,
            };
            vec![run(trainer)?]
        }
        CommBackend::Threads => on_thread_ranks(config, init, run)?,
        CommBackend::Mpi => vec![crate::mpi::run(config, init, fault, |t| drive(t, shared))?],
    };
    // Every rank agreed on the step: any rank's answer is the run's.
    Ok(stopped.into_iter().flatten().next())
}

/// After the ranks: the process's memory against the ledgers (ranks as threads on the host)
/// into the summary, and the trace of the traced steps.
fn report_process(config: &Config, rss_baseline: Option<u64>, shared: Shared) -> Result<()> {
    let console = &*shared.console;
    let peaks = shared.sink.take_peaks();
    // One process holds every rank as threads; under MPI each holds its own, and on a GPU
    // the ledger counts device memory (neither reported).
    let host = config.train.device == ferrotron_config::Device::Cpu;
    if config.parallel.backend == CommBackend::Threads && host {
        let dir = &config.run.dir;
        if let Err(e) = crate::process_memory::report(dir, rss_baseline, &peaks, console) {
            say!(
                console,
                "warning: the process's memory was not added to summary.json: {e}"
            );
        }
    }
    let per_process = config.parallel.backend == CommBackend::Mpi;
    if let Some(report) = shared.sink.write(config, per_process)? {
        console.say(&report.to_string());
    }
    Ok(())
}
