//! Dynamic loss scaling for fp16 runs (`train.dtype = "fp16"`, `[train.loss_scale]`), as
//! PyTorch's `GradScaler` and Megatron's `DynamicGradScaler` do it.
//!
//! The loss gradient of every token is multiplied by the scale `S` before backward, so the
//! gradients that fp16 stores are `S×` the true ones and small ones stay above fp16's
//! smallest subnormal (2⁻²⁴ ≈ 6e-8). The optimizer divides them by `S` before clipping. When
//! the scaled gradients overflow (their global norm is not finite: some element passed
//! ±65504), the step is skipped — weights and Adam states untouched, the gradients dropped,
//! the data and the learning-rate schedule moving on, Adam's step count not — and `S` is
//! multiplied by `backoff_factor`. After
//! `growth_interval` clean steps in a row, `S` is multiplied by `growth_factor`. Every rank
//! sees the same reduced norm, so every rank takes the same decision.

use ferrotron_config::LossScaleConfig;
use serde::{Deserialize, Serialize};

/// The scaler's state, as checkpoints save it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    /// The scale of the next step.
    pub scale: f64,
    /// Clean steps in a row since the scale last changed.
    pub clean_steps: u64,
    /// Steps skipped on overflow so far: they are not optimizer steps, so Adam's bias
    /// correction does not count them (as PyTorch's `GradScaler` skips `optimizer.step`).
    #[serde(default)]
    pub skipped_steps: u64,
}

/// What the step just computed becomes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Its gradients are finite: apply it.
    Apply,
    /// Its gradients overflowed at scale `from`: skip it; the next step runs at `to`.
    Overflow {
        /// The scale the step ran at.
        from: f64,
        /// The scale of the next step.
        to: f64,
    },
    /// Its gradients are not finite at the smallest scale: no scale can help, so it is a
    /// non-finite gradient for `train.on_nonfinite`.
    AtMinimum,
}

/// The dynamic loss scale of one run (the same on every rank).
#[derive(Debug, Clone)]
pub struct LossScaler {
    state: LossScale,
    cfg: LossScaleConfig,
}

impl LossScaler {
    /// A scaler at `saved` (a checkpoint's state), or at `cfg.init`.
    pub fn new(cfg: &LossScaleConfig, saved: Option<LossScale>) -> LossScaler {
        let state = saved.unwrap_or(LossScale {
            scale: cfg.init,
            clean_steps: 0,
            skipped_steps: 0,
        });
        LossScaler {
            state,
            cfg: cfg.clone(),
        }
    }

    /// The scale of the step about to run.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// Steps skipped on overflow so far.
    pub fn skipped_steps(&self) -> u64 {
        self.state.skipped_steps
    }

    /// The state to save.
    pub fn state(&self) -> LossScale {
        self.state
    }

    /// Records the step just computed, whose scaled gradients are `finite` or not, and says
    /// what becomes of it.
    pub fn after_step(&mut self, finite: bool) -> Verdict {
        let s = &mut self.state;
        if finite {
            s.clean_steps += 1;
            if s.clean_steps >= self.cfg.growth_interval {
                s.scale *= self.cfg.growth_factor;
                s.clean_steps = 0;
            }
            return Verdict::Apply;
        }
        if s.scale <= self.cfg.min_scale {
            return Verdict::AtMinimum;
        }
        let from = s.scale;
        s.scale = (from * self.cfg.backoff_factor).max(self.cfg.min_scale);
        s.clean_steps = 0;
        s.skipped_steps += 1;
        Verdict::Overflow { from, to: s.scale }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(growth_interval: u64) -> LossScaleConfig {
        LossScaleConfig {
            init: 1024.0,
            growth_interval,
            min_scale: 256.0,
            ..LossScaleConfig::default()
        }
    }

    #[test]
    fn grows_after_clean_runs_and_halves_on_overflow() {
        let mut s = LossScaler::new(&config(3), None);
        assert_eq!(s.scale(), 1024.0);
        for _ in 0..2 {
            assert_eq!(s.after_step(true), Verdict::Apply);
        }
        assert_eq!(s.scale(), 1024.0);
        assert_eq!(s.after_step(true), Verdict::Apply);
        assert_eq!(s.scale(), 2048.0, "grows after 3 clean steps");
        assert_eq!(s.after_step(true), Verdict::Apply);
        let v = s.after_step(false);
        assert_eq!(
            v,
            Verdict::Overflow {
                from: 2048.0,
                to: 1024.0
            }
        );
        // The clean run restarts after an overflow.
        s.after_step(true);
        s.after_step(true);
        assert_eq!(s.state().clean_steps, 2);
        assert_eq!(s.scale(), 1024.0);
    }

    #[test]
    fn stops_at_the_minimum() {
        let mut s = LossScaler::new(
            &config(10),
            Some(LossScale {
                scale: 300.0,
                clean_steps: 4,
                skipped_steps: 0,
            }),
        );
        assert_eq!(
            s.after_step(false),
            Verdict::Overflow {
                from: 300.0,
                to: 256.0
            }
        );
        assert_eq!(s.after_step(false), Verdict::AtMinimum);
        assert_eq!(s.scale(), 256.0);
        assert_eq!(
            s.skipped_steps(),
            1,
            "an overflow at the minimum is not a skip here"
        );
    }
}
