//! The one step loop and its hooks: [`Trainer::run_with`] is the only loop over steps — the
//! CLI, the rank launcher and the benchmarks run it, tests too where they do not drive single
//! steps — and what happens around it (the CLI's metrics, progress and trace collection,
//! checkpoints, evaluation) is a [`StepHook`].

use std::path::PathBuf;

use ferrotron_data::TokenStore;

use super::background::InFlight;
use super::{StepStats, Trainer};
use crate::stop::Stopped;
use crate::{EvalReport, TrainError};

/// Something that runs around the steps of [`Trainer::run_with`]. Hooks that communicate
/// (checkpoints, evaluation) are collective: every rank runs the same hooks.
pub trait StepHook {
    /// After each step; `trainer` has taken it.
    fn after_step(&mut self, _trainer: &Trainer, _stats: &StepStats) -> Result<(), TrainError> {
        Ok(())
    }
    /// After the last step.
    fn after_run(&mut self, _trainer: &Trainer, _steps: &[StepStats]) -> Result<(), TrainError> {
        Ok(())
    }
    /// When the run stops early (every rank agreed, after `stopped.step`); `after_run` is
    /// not called then.
    fn on_stop(&mut self, _trainer: &Trainer, _stopped: &Stopped) -> Result<(), TrainError> {
        Ok(())
    }
}

/// A hook that calls `f` with each step's statistics.
pub struct Observe<F>(pub F);

impl<F: FnMut(&StepStats)> StepHook for Observe<F> {
    fn after_step(&mut self, _trainer: &Trainer, stats: &StepStats) -> Result<(), TrainError> {
        (self.0)(stats);
        Ok(())
    }
}

/// A checkpoint just completed.
#[derive(Debug, Clone)]
pub struct SaveReport {
    /// The step it saved.
    pub step: usize,
    /// Its folder.
    pub path: PathBuf,
    /// Seconds the step loop waited for it (the whole save when synchronous; the snapshot
    /// and any wait for the write when in the background).
    pub blocked_s: f64,
    /// Seconds its background write took (None: written synchronously).
    pub write_s: Option<f64>,
}

/// Told of each checkpoint as it completes.
pub type OnSave<'a> = Box<dyn FnMut(&SaveReport) + 'a>;

/// Saves a checkpoint every `every` steps and after the last one (`every = 0`: never), and
/// of the step a run stops at early (unless `on_stop` is false or that step is saved
/// already), under `root`, keeping the newest `keep`; in the background when `background`
/// (`checkpoint.async`; see [`Trainer::save_in_background`]). Collective.
pub struct CheckpointHook<'a> {
    /// The checkpoint root (`checkpoint.dir`).
    pub root: PathBuf,
    /// Steps between saves.
    pub every: usize,
    /// Checkpoints kept.
    pub keep: usize,
    /// Whether a run stopped early saves its step (`checkpoint.on_stop`).
    pub on_stop: bool,
    /// Whether periodic saves are written in the background (`checkpoint.async`).
    pub background: bool,
    /// Told of each checkpoint as it completes.
    pub on_save: OnSave<'a>,
    /// The step saved last, and where.
    pub saved: Option<(usize, PathBuf)>,
    /// Seconds the step loop waited for saves, all together.
    pub blocked_s: f64,
    /// Seconds the background writes took, all together (saves written synchronously not
    /// counted).
    pub background_s: f64,
    /// The background save in flight, and whether it was reported already.
    pending: Option<(InFlight, bool)>,
}

impl CheckpointHook<'_> {
    /// The hook for `config`'s checkpoint settings, in run directory `run.dir`.
    pub fn of<'a>(
        config: &ferrotron_config::Config,
        on_save: impl FnMut(&SaveReport) + 'a,
    ) -> CheckpointHook<'a> {
        let c = &config.checkpoint;
        CheckpointHook {
            root: c.dir_for(&config.run.dir),
            every: c.every,
            keep: c.keep,
            on_stop: c.on_stop,
            background: c.background,
            on_save: Box::new(on_save),
            saved: None,
            blocked_s: 0.0,
            background_s: 0.0,
            pending: None,
        }
    }

    fn report(&mut self, report: SaveReport) {
        self.background_s += report.write_s.unwrap_or(0.0);
        (self.on_save)(&report);
        self.saved = Some((report.step, report.path));
    }

    /// Saves now and waits for it.
    fn save(&mut self, trainer: &Trainer) -> Result<(), TrainError> {
        self.complete(trainer)?;
        let start = std::time::Instant::now();
        let path = trainer.save_checkpoint(&self.root, self.keep)?;
        let seconds = start.elapsed().as_secs_f64();
        self.blocked_s += seconds;
        self.report(SaveReport {
            step: trainer.steps_done(),
            path,
            blocked_s: seconds,
            write_s: None,
        });
        Ok(())
    }

    /// Starts a background save, once the one before it is complete.
    fn start(&mut self, trainer: &Trainer) -> Result<(), TrainError> {
        self.complete(trainer)?;
        let save = trainer.save_in_background(&self.root, self.keep)?;
        self.blocked_s += save.blocked_s;
        self.pending = Some((save, false));
        Ok(())
    }

    /// Reports the background save if this rank's writer is done (not collective).
    fn poll(&mut self, trainer: &Trainer) -> Result<(), TrainError> {
        let Some((save, reported)) = self.pending.as_mut() else {
            return Ok(());
        };
        if *reported || !save.finished() || trainer.rank() != 0 {
            return Ok(());
        }
        let written = save.join()?.clone();
        *reported = true;
        let (step, blocked_s) = (save.step, save.blocked_s);
        self.report(SaveReport {
            step,
            path: written.path,
            blocked_s,
            write_s: Some(written.write_s),
        });
        Ok(())
    }

    /// Waits for the background save in flight, if any (collective).
    fn complete(&mut self, trainer: &Trainer) -> Result<(), TrainError> {
        let Some((mut save, reported)) = self.pending.take() else {
            return Ok(());
        };
        let before = save.blocked_s;
        let written = trainer.complete_save(&mut save)?;
        self.blocked_s += save.blocked_s - before;
        if !reported {
            self.report(SaveReport {
                step: save.step,
                path: written.path,
                blocked_s: save.blocked_s,
                write_s: Some(written.write_s),
            });
        }
        Ok(())
    }
}

impl StepHook for CheckpointHook<'_> {
    fn after_step(&mut self, trainer: &Trainer, stats: &StepStats) -> Result<(), TrainError> {
        self.poll(trainer)?;
        let last = stats.step == trainer.config.train.steps;
        if self.every > 0 && (stats.step.is_multiple_of(self.every) || last) {
            if self.background {
                self.start(trainer)?;
            } else {
                self.save(trainer)?;
            }
        }
        Ok(())
    }

    fn after_run(&mut self, trainer: &Trainer, _steps: &[StepStats]) -> Result<(), TrainError> {
        self.complete(trainer)
    }

    fn on_stop(&mut self, trainer: &Trainer, stopped: &Stopped) -> Result<(), TrainError> {
        self.complete(trainer)?;
        let done = self.saved.as_ref().is_some_and(|(s, _)| *s == stopped.step);
        if self.on_stop && !done {
            self.save(trainer)?;
        }
        Ok(())
    }
}

/// Evaluates the final weights on a token file after the last step. Collective: tensor,
/// expert and ZeRO-3 shards take part.
pub struct EvalHook {
    file: Box<dyn TokenStore>,
    /// The evaluation, once run.
    pub report: Option<EvalReport>,
}

impl EvalHook {
    /// An evaluation on `file`.
    pub fn new(file: impl TokenStore + 'static) -> Self {
        EvalHook {
            file: Box::new(file),
            report: None,
        }
    }
}

impl StepHook for EvalHook {
    fn after_run(&mut self, trainer: &Trainer, _steps: &[StepStats]) -> Result<(), TrainError> {
        self.report = Some(trainer.evaluate(&self.file)?);
        Ok(())
    }
}

impl Trainer {
    /// Runs every remaining step, calling `observe` after each.
    pub fn run(&mut self, observe: impl FnMut(&StepStats)) -> Result<Vec<StepStats>, TrainError> {
        self.run_with(&mut [&mut Observe(observe)])
    }

    /// The step loop: runs every remaining step, and each of `hooks` after each step (in
    /// order) and after the last. A raised [`Trainer::stop_flag`] ends it early, after the
    /// step every rank agrees on: the hooks' `on_stop` runs instead of `after_run`, and
    /// [`RunMetrics::stopped`](super::RunMetrics::stopped) says where and why.
    pub fn run_with(
        &mut self,
        hooks: &mut [&mut dyn StepHook],
    ) -> Result<Vec<StepStats>, TrainError> {
        let mut all = Vec::with_capacity(self.config.train.steps);
        while self.steps_done() < self.config.train.steps {
            let stats = self.step()?;
            for hook in hooks.iter_mut() {
                hook.after_step(self, &stats)?;
            }
            all.push(stats);
            if self.steps_done() == self.config.train.steps {
                break;
            }
            if let Some(cause) = self.agree_stop()? {
                let stopped = Stopped {
                    step: self.steps_done(),
                    cause,
                };
                for hook in hooks.iter_mut() {
                    hook.on_stop(self, &stopped)?;
                }
                self.metrics.stopped = Some(stopped);
                return Ok(all);
            }
        }
        for hook in hooks.iter_mut() {
            hook.after_run(self, &all)?;
        }
        Ok(all)
    }
}

impl Trainer {
    /// Whether every rank stops now (see [`crate::stop::agree`]); None without a flag
    /// (every rank of a run has one or none).
    fn agree_stop(&self) -> Result<Option<crate::stop::StopCause>, TrainError> {
        let Some(flag) = &self.stop_flag else {
            return Ok(None);
        };
        let world = self.mesh.link(ferrotron_comm::GroupKind::World);
        Ok(crate::stop::agree(flag, world, self.device().ledger)?)
    }
}
