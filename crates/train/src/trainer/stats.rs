//! What one optimizer step measured.

use serde::Serialize;

use super::MoeStats;

/// What one optimizer step measured.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    /// 1-based step number.
    pub step: usize,
    /// Mean token loss over the global batch (nats).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the global batch.
    pub tokens: usize,
    /// Wall time of the step (seconds).
    pub step_time_s: f64,
    /// Tokens per second of this step.
    pub tokens_per_s: f64,
    /// Model FLOP utilisation against the measured matmul peak (None when no peak is known).
    pub mfu: Option<f64>,
    /// Time the step's gradient reductions executed, seconds.
    pub reduce_busy_s: f64,
    /// Part of it that ran while backward was still computing (hidden), seconds.
    pub reduce_hidden_s: f64,
    /// Time blocked on gradient reductions after backward (exposed communication), seconds.
    pub reduce_exposed_s: f64,
    /// Pipeline: time this rank waited for a neighbour's activations or gradients (its
    /// bubble), seconds.
    pub pipeline_wait_s: f64,
    /// Mixture-of-experts models: the load-balancing loss and the routing of the step
    /// (`loss` is the cross-entropy alone; the training loss is `loss +
    /// router_aux_loss_coef × moe.aux_loss`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeStats>,
    /// The step was not applied: its loss or gradient norm was not finite and
    /// `train.on_nonfinite = "skip"`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// fp16 runs: the loss scale this step ran at (`[train.loss_scale]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// This rank's ledger peak per category so far (bytes), by category name.
    pub memory_peak_bytes: std::collections::BTreeMap<&'static str, usize>,
}
