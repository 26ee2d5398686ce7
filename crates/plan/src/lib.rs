//! Memory estimator, step cost model and layout planner: arithmetic over configurations, no
//! tensors (playbook §2, §3, §5, §6).
//!
//! - [`estimate`] predicts, per rank, the peak bytes of every memory category the engine's
//!   ledger counts (weights, gradients, optimizer, activations, communication, workspace) for
//!   any layout — data, tensor, pipeline, context and expert parallelism, ZeRO 0–3, sequence
//!   parallelism, recomputation, pipeline schedule — from the model shape alone, so it answers
//!   for a 405B model as readily as for the tiny one.
//! - [`step_cost`] predicts the time of one optimizer step on a [`Hardware`] profile: compute
//!   at a calibrated fraction of the device peak, every collective of the layout over the
//!   measured bus bandwidths, minus what overlaps, plus the pipeline bubble and a fixed host
//!   time per step (0 for this engine; [`MEASURED_STEP_OVERHEAD_S`] for the playbook's runs).
//! - [`plan`] searches the layouts of a model on a cluster following the playbook's recipe
//!   (fit in memory, reach the global batch, maximise throughput) and explains why the close
//!   alternatives lost.
//!
//! Where the engine runs a configuration — data parallelism with ZeRO 0–3, tensor and
//! sequence parallelism, pipeline parallelism (AFAB, 1F1B, interleaved, zero bubble; ZeRO ≤ 1),
//! context parallelism (ZeRO sharding over `dp · cp`, activations ÷c), mixture of experts
//! with expert parallelism, recomputation, f32 or bf16 — the weights, gradients and optimizer
//! figures are **exact** per pipeline stage and the activations within 5% (the engine's TP
//! shards and stage layouts, its ZeRO bucket arithmetic, its per-block saved tensors and each
//! schedule's micro-batches in flight; checked against the engine's ledger on 46 layouts,
//! every rank). Communication buffers and workspace are estimated more roughly, so that the
//! total bounds the measured peak; [`Estimate::notes`] says which is which.

#![warn(missing_docs)]

mod activations;
mod category;
mod cost;
pub mod cpu_kernels;
mod hardware;
mod job;
mod layout;
mod memory;
mod model;
mod muon;
mod overlap;
mod planner;
mod rank;
mod shard;
pub mod tp_calls;
pub mod units;
mod zero_bubble;

pub use category::{Category, Memory};
pub use cost::{
    step_cost, CommCost, CommKind, CostModel, StepCost, KERNEL_EFFICIENCY, MEASURED_STEP_OVERHEAD_S,
};
pub use hardware::{BusBandwidth, Collective, Hardware, P2pBandwidth};
pub use job::Job;
pub use layout::{balanced_pp_layers, balanced_v_layers, head_blocks, Layout, Recompute, Schedule};
pub use memory::{
    estimate, estimate_with, ActivationModel, Assumptions, ByteRegime, Estimate, StageEstimate,
    INIT_SCRATCH_ELEMS,
};
pub use model::{ModelSpec, Moe, Unit};
pub use planner::{
    plan, plan_with, Candidate, Plan, PlanOptions, PlanRequest, ShapeFilter, Verdict,
};
pub use shard::max_shard_elems;

/// Bytes in a GiB (2³⁰): the unit of every human-readable figure of this crate.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Everything that can be wrong with a planning request, each variant naming what to fix.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The run configuration could not be read, parsed or validated.
    #[error(transparent)]
    Config(#[from] ferrotron_config::ConfigError),
    /// A layout or model field is out of range or inconsistent with another one.
    #[error("{field}: {message}")]
    Invalid {
        /// Dotted name of the offending field, e.g. `parallel.tp`.
        field: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// No model preset has this name.
    #[error("unknown model preset `{name}`; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The presets there are, comma-separated.
        known: String,
    },
    /// No hardware profile has this name.
    #[error("unknown hardware `{name}`; known profiles: {known}")]
    UnknownHardware {
        /// The name asked for.
        name: String,
        /// The profiles there are, comma-separated.
        known: String,
    },
    /// A hardware profile could not be parsed or is inconsistent.
    #[error("hardware profile `{name}`: {message}")]
    Hardware {
        /// The profile's name (or file).
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The model is so large that its element counts overflow 64 bits.
    #[error("model too large to count: {0}")]
    TooLarge(String),
    /// The planner found no layout to evaluate at all (e.g. no divisor of the GPU count fits
    /// the model's head counts).
    #[error("no layout to consider: {0}")]
    NoLayout(String),
}

/// Shorthand for a [`PlanError::Invalid`].
pub(crate) fn invalid(field: &str, message: impl Into<String>) -> PlanError {
    PlanError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}
