//! The groups a rank of a parallel run talks over, as the trainer holds them.

use ferrotron_tensor::trace::Tracer;

use crate::dp::GroupComm;

/// The groups one rank of a parallel run talks over (see [`crate::Trainer::for_rank`]).
pub struct RankLinks {
    /// Gradient reduction and ZeRO sharding: the data- and context-parallel ranks of this
    /// rank's (pipeline stage, tensor-parallel rank), `GroupKind::DpCp`. Context-parallel
    /// ranks hold partial gradients of the same weights (from different tokens), so they
    /// reduce together, as in Megatron's distributed optimizer.
    pub reduce: GroupComm,
    /// Data-parallel degree and this rank's index in it (`GroupKind::Dp`): the samples it
    /// reads and the global batch size.
    pub data: (usize, usize),
    /// Tensor-parallel group.
    pub tp: Option<TpGroup>,
    /// Pipeline group.
    pub pp: Option<GroupComm>,
    /// Context-parallel group (`GroupKind::Cp`): the ring of the attention.
    pub cp: Option<GroupComm>,
    /// Expert-parallel and expert-gradient groups (mixture-of-experts models).
    pub experts: Option<super::ExpertGroups>,
}

/// This rank's tensor-parallel group and what it sent.
pub struct TpGroup {
    /// The communicator and the tensor-parallel group.
    pub link: GroupComm,
    /// Sequence parallelism on.
    pub sequence_parallel: bool,
    /// Bytes and calls of the collectives inside forward and backward.
    pub volume: ferrotron_parallel::CommVolume,
}

impl TpGroup {
    /// The model's view of the group, with or without sequence parallelism.
    pub fn comm_for<'a>(
        &'a self,
        sequence_parallel: bool,
        trace: Option<&'a Tracer>,
    ) -> ferrotron_parallel::TpComm<'a> {
        ferrotron_parallel::TpComm {
            comm: &self.link.comm,
            group: &self.link.group,
            sequence_parallel,
            volume: &self.volume,
            trace,
        }
    }
}
