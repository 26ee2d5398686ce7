//! A training run as a library call: `Run::new(config).start()?` trains in the background
//! on ranks as threads; the handle yields each step's metrics as the leader rank finishes
//! it, and [`RunHandle::wait`] returns the run's summary.
//!
//! ```no_run
//! use ferrotron_train::Run;
//!
//! let mut config = ferrotron_config::Config::default();
//! config.train.steps = 20;
//! let mut run = Run::new(config).start()?;
//! for step in run.by_ref() {
//!     println!("step {} loss {:.3}", step.step, step.loss);
//! }
//! let summary = run.wait()?;
//! println!("final loss {:.3}", summary.final_loss);
//! # Ok::<(), ferrotron_train::TrainError>(())
//! ```
//!
//! This first library run computes and reports; it writes nothing to disk. The settings it
//! cannot honour yet are refused before any work, naming the command that does:
//! checkpoints (`checkpoint.every`), MPI (`parallel.backend`) and GPUs (`train.device`) are
//! `ferrotron train`'s. An evaluation file (`data.eval_path`) is evaluated after the last step.
//! MFU is reported against a peak the caller gives ([`Run::peak_flops`]); none by default.

use std::sync::mpsc::{self, Receiver};
use std::thread::JoinHandle;

use ferrotron_config::{CommBackend, Config, ConfigError, Device};
use ferrotron_data::{open_tokens, TokenStore};

use crate::launch::on_thread_ranks;
use crate::stop::{StopCause, StopFlag};
use crate::{EvalHook, Init, Observe, RunSummary, StepHook, StepStats, TrainError};

/// A training run to start: its configuration and where its weights come from.
pub struct Run {
    config: Config,
    weights: Option<Vec<f32>>,
    peak_flops: Option<f64>,
}

/// A started run: an iterator over the leader's step metrics as they come, then
/// [`RunHandle::wait`] for the summary (or the error that stopped the run).
pub struct RunHandle {
    steps: Receiver<StepStats>,
    stop: StopFlag,
    thread: JoinHandle<Result<RunSummary, TrainError>>,
}

impl Run {
    /// A run of `config` from the layout-independent initialisation.
    pub fn new(config: Config) -> Run {
        Run {
            config,
            weights: None,
            peak_flops: None,
        }
    }

    /// Starts from these full fp32 weights (full-layout order, e.g. a Hugging Face model's
    /// from [`crate::hf::load_model`]) instead.
    pub fn from_weights(self, weights: Vec<f32>) -> Run {
        Run {
            weights: Some(weights),
            ..self
        }
    }

    /// Reports MFU against `flops` FLOP/s, the peak of the hardware the run occupies (see
    /// [`crate::mfu`]).
    pub fn peak_flops(self, flops: f64) -> Run {
        Run {
            peak_flops: Some(flops),
            ..self
        }
    }

    /// Checks the configuration, then trains in the background.
    pub fn start(self) -> Result<RunHandle, TrainError> {
        self.config.validate()?;
        refuse_unsupported(&self.config)?;
        let eval = match &self.config.data.eval_path {
            Some(path) => {
                let file = open_tokens(path)?;
                file.check_vocab(self.config.model.vocab)?;
                Some(path.clone())
            }
            None => None,
        };
        if let Some(w) = &self.weights {
            let want = self.config.model.num_params();
            if w.len() != want {
                return Err(TrainError::Layout(format!(
                    "Run::from_weights: {} weights for a model of {want} parameters",
                    w.len()
                )));
            }
        }
        let (tx, steps) = mpsc::channel();
        let stop = StopFlag::new();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ferrotron-run".into())
            .spawn(move || self.train(eval, tx, flag))
            .map_err(|e| TrainError::Threads(e.to_string()))?;
        Ok(RunHandle {
            steps,
            stop,
            thread,
        })
    }

    /// Every rank's steps; the leader sends each step's metrics and builds the summary.
    fn train(
        self,
        eval: Option<std::path::PathBuf>,
        tx: mpsc::Sender<StepStats>,
        stop: StopFlag,
    ) -> Result<RunSummary, TrainError> {
        let init = match &self.weights {
            Some(w) => Init::Weights(w),
            None => Init::Fresh,
        };
        let summaries = on_thread_ranks(&self.config, init, |mut trainer| {
            let leader = trainer.rank() == 0;
            trainer.metrics.peak_flops = self.peak_flops;
            trainer.metrics.peak_threads = occupied_threads(&trainer);
            trainer.stop_flag = Some(stop.clone());
            let mut send = Observe(|s: &StepStats| {
                if leader {
                    // A caller that stopped listening does not stop the run.
                    let _ = tx.send(s.clone());
                }
            });
            let mut evaluate = match &eval {
                Some(path) => Some(EvalHook::new(open_tokens(path)?)),
                None => None,
            };
            let steps = {
                let mut hooks: Vec<&mut dyn StepHook> = vec![&mut send];
                if let Some(e) = evaluate.as_mut() {
                    hooks.push(e);
                }
                trainer.run_with(&mut hooks)?
            };
            let eval_loss = evaluate.and_then(|e| e.report).map(|r| r.loss);
            Ok(leader.then(|| trainer.summary(&steps, eval_loss)))
        })?;
        Ok(summaries
            .into_iter()
            .flatten()
            .next()
            .expect("rank 0 builds the summary"))
    }
}

/// The threads the run's ranks occupy on this machine's cores ([`crate::mfu::Occupancy`]):
/// the caller's peak is raised to the products' best rate per thread times these where
/// that is higher.
fn occupied_threads(trainer: &crate::Trainer) -> usize {
    let (threads, copies) = crate::mfu::Occupancy {
        ranks: trainer.config.parallel.world_size(),
        threads_per_rank: trainer.threads(),
        shared_host: true,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
    .peak_shape();
    threads * copies
}

/// The settings this library run does not honour yet, refused before any work.
fn refuse_unsupported(config: &Config) -> Result<(), ConfigError> {
    let refuse = |field: &str, message: &str| {
        Err(ConfigError::Invalid {
            field: field.into(),
            message: message.into(),
        })
    };
    if config.checkpoint.every > 0 {
        return refuse(
            "checkpoint.every",
            "Run (the library call) writes no checkpoints yet: set it to 0, or train with \
             `ferrotron train`",
        );
    }
    if config.parallel.backend != CommBackend::Threads {
        return refuse(
            "parallel.backend",
            "Run (the library call) runs ranks as threads only: set it to \"threads\", or \
             launch with `ferrotron train` under mpirun",
        );
    }
    if config.train.device != Device::Cpu {
        return refuse(
            "train.device",
            "Run (the library call) runs on the CPU only yet: set it to \"cpu\", or train on \
             GPUs with `ferrotron train`",
        );
    }
    Ok(())
}

impl Iterator for RunHandle {
    type Item = StepStats;

    /// The next step's metrics, waiting for it; `None` once the run has ended.
    fn next(&mut self) -> Option<StepStats> {
        self.steps.recv().ok()
    }
}

impl RunHandle {
    /// Asks the run to stop after the step in progress (every rank stops after the same
    /// step); its summary then says `interrupted`, `stopped_by: "requested"` and the step.
    /// Evaluation after the last step is skipped.
    pub fn stop(&self) {
        self.stop.request(StopCause::Requested);
    }

    /// Waits for the run to end: its summary, or the error that stopped it.
    pub fn wait(self) -> Result<RunSummary, TrainError> {
        drop(self.steps);
        match self.thread.join() {
            Ok(result) => result,
            Err(_) => Err(TrainError::Hook("the run's thread panicked".into())),
        }
    }
}
