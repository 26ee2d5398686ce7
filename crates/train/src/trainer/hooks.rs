//! The one step loop and its hooks: [`Trainer::run_with`] is the only loop over steps — the
//! CLI, the rank launcher and the benchmarks run it, tests too where they do not drive single
//! steps — and what happens around it (the CLI's metrics, progress and trace collection,
//! checkpoints, evaluation) is a [`StepHook`].

use std::path::{Path, PathBuf};

use ferrotron_data::TokenFile;

use super::{StepStats, Trainer};
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
}

/// A hook that calls `f` with each step's statistics.
pub struct Observe<F>(pub F);

impl<F: FnMut(&StepStats)> StepHook for Observe<F> {
    fn after_step(&mut self, _trainer: &Trainer, stats: &StepStats) -> Result<(), TrainError> {
        (self.0)(stats);
        Ok(())
    }
}

/// Saves a checkpoint every `every` steps and after the last one (`every = 0`: never), under
/// `root`, keeping the newest `keep`. Collective.
pub struct CheckpointHook<'a> {
    /// The checkpoint root (`checkpoint.dir`).
    pub root: PathBuf,
    /// Steps between saves.
    pub every: usize,
    /// Checkpoints kept.
    pub keep: usize,
    /// Told where each save went.
    pub on_save: Box<dyn FnMut(&Path) + 'a>,
}

impl StepHook for CheckpointHook<'_> {
    fn after_step(&mut self, trainer: &Trainer, stats: &StepStats) -> Result<(), TrainError> {
        let last = stats.step == trainer.config.train.steps;
        if self.every > 0 && (stats.step.is_multiple_of(self.every) || last) {
            let saved = trainer.save_checkpoint(&self.root, self.keep)?;
            (self.on_save)(&saved);
        }
        Ok(())
    }
}

/// Evaluates the final weights on a token file after the last step. Collective: tensor,
/// expert and ZeRO-3 shards take part.
pub struct EvalHook {
    file: TokenFile,
    /// The evaluation, once run.
    pub report: Option<EvalReport>,
}

impl EvalHook {
    /// An evaluation on `file`.
    pub fn new(file: TokenFile) -> Self {
        EvalHook { file, report: None }
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
    /// order) and after the last.
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
        }
        for hook in hooks.iter_mut() {
            hook.after_run(self, &all)?;
        }
        Ok(all)
    }
}
