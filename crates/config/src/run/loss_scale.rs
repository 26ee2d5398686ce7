//! `train.dtype = "fp16"`: IEEE-half storage, and the dynamic loss scaling it needs
//! (`[train.loss_scale]`).

use serde::{Deserialize, Serialize};

use crate::{invalid, Config, ConfigError, DType, Device};

/// Dynamic loss scaling (`[train.loss_scale]`), read with `train.dtype = "fp16"` (PyTorch's
/// `GradScaler` defaults). The loss gradient is multiplied by the scale before backward, so
/// that small gradients stay above fp16's smallest subnormal (2⁻²⁴); the gradients are
/// divided by it before clipping. A step whose gradients overflow (are not finite) is
/// skipped and the scale multiplied by `backoff_factor`; after `growth_interval` clean
/// steps in a row it is multiplied by `growth_factor`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaleConfig {
    /// The scale of the first step.
    pub init: f64,
    /// Multiplier after `growth_interval` clean steps.
    pub growth_factor: f64,
    /// Multiplier after an overflow.
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows.
    pub growth_interval: u64,
    /// The smallest scale: an overflow at it is a non-finite gradient, handled as
    /// `train.on_nonfinite` says.
    pub min_scale: f64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            init: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
        }
    }
}

/// The largest scale accepted: 2¹⁰⁰ keeps every scaled f32 loss gradient finite.
const MAX_SCALE: f64 = 1.2676506002282294e30;

impl LossScaleConfig {
    /// Ranges of every field, each refused by name.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let in_range = |x: f64| x.is_finite() && x > 0.0 && x <= MAX_SCALE;
        if !in_range(self.min_scale) {
            return Err(invalid(
                "train.loss_scale.min_scale",
                format!("{}: must be above 0 and at most 2^100", self.min_scale),
            ));
        }
        if !in_range(self.init) || self.init < self.min_scale {
            return Err(invalid(
                "train.loss_scale.init",
                format!(
                    "{}: must be between min_scale ({}) and 2^100 (65536 by default)",
                    self.init, self.min_scale
                ),
            ));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return Err(invalid(
                "train.loss_scale.growth_factor",
                format!(
                    "{}: must be a finite number above 1 (2 by default)",
                    self.growth_factor
                ),
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return Err(invalid(
                "train.loss_scale.backoff_factor",
                format!(
                    "{}: must be in (0, 1) (0.5 by default)",
                    self.backoff_factor
                ),
            ));
        }
        if self.growth_interval == 0 {
            return Err(invalid(
                "train.loss_scale.growth_interval",
                "must be at least 1 (2000 by default)",
            ));
        }
        Ok(())
    }
}

impl Config {
    /// `train.dtype = "fp16"`: where it runs, what it combines with, its loss scaling.
    pub(crate) fn validate_fp16(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        if t.dtype != DType::F16 {
            if t.loss_scale != LossScaleConfig::default() {
                return Err(invalid(
                    "train.loss_scale",
                    "is read only with train.dtype = \"fp16\": set that, or remove the \
                     [train.loss_scale] settings (bf16 and f32 need no loss scaling)",
                ));
            }
            return Ok(());
        }
        if t.device == Device::Cuda {
            return Err(invalid(
                "train.dtype",
                "\"fp16\" runs on the CPU for now (the CUDA kernels read f32 and bf16): use \
                 train.dtype = \"bf16\" on a GPU",
            ));
        }
        if t.fp8 != crate::Fp8::Off {
            return Err(invalid(
                "train.fp8",
                "emulates FP8 with f32 or bf16 storage, not yet with train.dtype = \"fp16\"; \
                 set train.fp8 = \"off\" or train.dtype = \"bf16\"",
            ));
        }
        t.loss_scale.validate()
    }
}
