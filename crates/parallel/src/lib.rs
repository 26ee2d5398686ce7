//! The playbook's parallelism, applied to the single-device model of `ferrotron-model`
//! through its strategy traits (`ferrotron_model::strategy`). One file per technique, its
//! communication beside it, so a reader of the playbook finds each in one hop:
//!
//! - [`data_parallel`]: data parallelism (§4): bucketed gradient reductions overlapping the
//!   last micro-batch's backward, over the layout of [`buckets`].
//! - [`zero`]: ZeRO-1/2/3 (§3, §4): sharded states and the ZeRO-3 weight gathers with prefetch.
//! - [`pipeline`]: pipeline parallelism (§4): the executor of `ferrotron-schedule`'s action
//!   lists (AFAB, 1F1B, interleaved, zero bubble).
//! - [`tensor_parallel`]: tensor + sequence parallelism (§4): the collectives of Megatron's
//!   conjugate operators and the vocabulary-parallel cross-entropy.
//! - [`context_parallel`]: context parallelism (§4): ring attention over the zig-zag split.
//!   [`context_parallel::ulysses`]: its all-to-all kind (DeepSpeed-Ulysses), sequence shards
//!   swapped for head shards around attention.
//! - [`expert_parallel`]: expert parallelism (§4): the all-to-all of token rows.
//! - [`mesh`]: every group of a rank (the 5D grid of §4 and §6), built once from the topology;
//!   [`groups`]: what it hands out to a step (the optimizer's and the reductions' groups, the
//!   model's strategies).

#![warn(missing_docs)]

pub mod buckets;
pub mod context_parallel;
pub mod data_parallel;
pub mod expert_parallel;
pub mod groups;
pub mod mesh;
pub mod pipeline;
pub mod tensor_parallel;
pub mod zero;

pub use context_parallel::CpComm;
pub use expert_parallel::EpComm;
pub use groups::{RankGroups, Strategies};
pub use mesh::{GroupComm, RankMesh};
pub use tensor_parallel::{CommVolume, TpComm};

/// What can stop a parallel technique: a collective failed, a model hook failed, or the
/// layout cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// A collective failed (a peer failed, timed out or disagreed).
    #[error(transparent)]
    Comm(#[from] ferrotron_comm::CommError),
    /// A model hook (weight source, gradient sink, strategy) failed.
    #[error("{0}")]
    Hook(ferrotron_model::HookError),
    /// The layout cannot run (named field and fix in the message).
    #[error("{0}")]
    Layout(String),
}

impl From<ferrotron_model::HookError> for ParallelError {
    fn from(e: ferrotron_model::HookError) -> Self {
        match e.downcast::<ferrotron_comm::CommError>() {
            Ok(c) => ParallelError::Comm(*c),
            Err(other) => ParallelError::Hook(other),
        }
    }
}
