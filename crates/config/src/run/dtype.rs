//! `train.dtype`: the storage precision.

use serde::{Deserialize, Serialize};

/// Storage precision of weights, activations and gradients (playbook §3 regimes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// Everything in fp32: 4 + 4 + 8 bytes per parameter.
    F32,
    /// bf16 weights, activations and gradients with fp32 master weights and Adam states:
    /// 2 + 2 + 12 bytes per parameter (+4 with `train.fp32_grad_accum`).
    Bf16,
    /// IEEE-half (`"fp16"`) weights, activations and gradients with fp32 master weights,
    /// Adam states and gradient accumulation: 2 + 2 + 4 + 12 bytes per parameter. The loss
    /// is scaled dynamically (`[train.loss_scale]`) so that small gradients survive fp16's
    /// range.
    #[serde(rename = "fp16", alias = "f16")]
    F16,
}

impl DType {
    /// Bytes of one stored element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// The configuration spelling: `f32`, `bf16` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "fp16",
        }
    }
}
