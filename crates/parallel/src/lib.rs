//! The playbook's parallelism, applied to the single-device model of `ferrotron-model`
//! through its strategy traits (`ferrotron_model::strategy`). One file per technique, its
//! communication beside it, so a reader of the playbook finds each in one hop:
//!
//! - [`tensor_parallel`]: tensor + sequence parallelism (§4): the collectives of Megatron's
//!   conjugate operators and the vocabulary-parallel cross-entropy.
//! - [`context_parallel`]: context parallelism (§4): ring attention over the zig-zag split.
//! - [`expert_parallel`]: expert parallelism (§4): the all-to-all of token rows.
//! - [`mesh`]: every group of a rank (the 5D grid of §5), built once from the topology.

#![warn(missing_docs)]

pub mod context_parallel;
pub mod expert_parallel;
pub mod mesh;
pub mod tensor_parallel;

pub use context_parallel::CpComm;
pub use expert_parallel::EpComm;
pub use mesh::{GroupComm, RankMesh};
pub use tensor_parallel::{CommVolume, TpComm};
