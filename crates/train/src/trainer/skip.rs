//! Steps that are not applied: a loss or gradient norm that is not finite
//! (`train.on_nonfinite`), and fp16's overflowing steps (`[train.loss_scale]`).

use std::time::Instant;

use super::{StepStats, Trainer};
use crate::loss_scale::Verdict;
use crate::TrainError;

impl Trainer {
    /// A step whose `what` (the loss or the gradient norm of `(loss, grad_norm)`, the norm
    /// NaN when the loss stopped the step first) is not finite is not applied: the run stops, or
    /// (`train.on_nonfinite = "skip"`) drops the step's gradients and moves on to the next
    /// batch. Every rank sees the same reduced value, so every rank does the same.
    pub(super) fn non_finite(
        &mut self,
        start: Instant,
        what: &'static str,
        (loss, grad_norm): (f64, f64),
    ) -> Result<StepStats, TrainError> {
        let value = if what == "loss" { loss } else { grad_norm };
        if self.config.train.on_nonfinite == ferrotron_config::OnNonFinite::Stop {
            return Err(self.diverged(what, value));
        }
        eprintln!("warning: {}", self.diverged(what, value));
        Ok(self.skip_step(start, (loss, grad_norm), self.loss_scale()))
    }

    /// The step just computed is not applied: its gradients are dropped, the data and the
    /// learning-rate schedule move on, and its statistics say `skipped`.
    fn skip_step(
        &mut self,
        start: Instant,
        (loss, grad_norm): (f64, f64),
        loss_scale: Option<f64>,
    ) -> StepStats {
        self.state.grads.zero(self.device.dev());
        let step = self.position.step;
        self.position.step += 1;
        self.position.samples_done += self.config.samples_per_step() as u64;
        StepStats {
            step: self.position.step,
            loss,
            lr: self.position.schedule.at(step),
            grad_norm,
            tokens: self.config.tokens_per_step(),
            step_time_s: start.elapsed().as_secs_f64(),
            tokens_per_s: 0.0,
            mfu: None,
            reduce_busy_s: 0.0,
            reduce_hidden_s: 0.0,
            reduce_exposed_s: 0.0,
            pipeline_wait_s: 0.0,
            moe: None,
            skipped: true,
            loss_scale,
            memory_peak_bytes: self.memory_peaks(),
        }
    }

    /// fp16's loss scale of the step about to run (None under f32 and bf16).
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| s.scale())
    }

    /// After the optimizer saw the step's gradient norm: under fp16, a norm that is not
    /// finite is an overflow of the scaled gradients — the step is skipped and the scale
    /// backs off — unless the scale is already at its minimum. `None`: go on as usual.
    pub(super) fn overflowed(
        &mut self,
        start: Instant,
        (loss, grad_norm): (f64, f64),
    ) -> Option<StepStats> {
        let scaler = self.scaler.as_mut()?;
        match scaler.after_step(grad_norm.is_finite()) {
            Verdict::Overflow { from, to } => {
                if self.rank() == 0 {
                    eprintln!(
                        "note: step {}: fp16 gradients overflowed at loss scale {from}; the \
                         step is skipped and the scale is now {to}",
                        self.position.step + 1
                    );
                }
                Some(self.skip_step(start, (loss, grad_norm), Some(from)))
            }
            Verdict::Apply | Verdict::AtMinimum => None,
        }
    }

    /// The error of a step whose `what` became `value` (not finite), with what to change.
    fn diverged(&self, what: &'static str, value: f64) -> TrainError {
        let t = &self.config.train;
        let hint = if t.grad_clip > 0.0 {
            format!(
                "lower train.lr (now {}; train.grad_clip = {} is already on)",
                t.lr, t.grad_clip
            )
        } else {
            format!(
                "lower train.lr (now {}) or set train.grad_clip (e.g. 1.0)",
                t.lr
            )
        };
        TrainError::Diverged {
            step: self.position.step + 1,
            what,
            value,
            hint,
        }
    }
}
