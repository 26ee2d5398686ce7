//! What the rank mesh hands out to a step: the groups its gradients and optimizer states
//! are spread over ([`RankGroups`], and the reductions' [`ReduceGroups`]), and the
//! strategies the model calls for tensor, context and expert parallelism ([`Strategies`]).
//! Each is a view of the one [`RankMesh`], built per step, holding nothing of its own.

use ferrotron_comm::GroupKind;
use ferrotron_config::CpKind;
use ferrotron_tensor::ring_attention::SplitError;
use ferrotron_tensor::trace::Tracer;

use crate::data_parallel::ReduceGroups;
use crate::{CpComm, EpComm, GroupComm, RankMesh, TpComm};

/// The groups a rank's gradients and optimizer states are spread over (each `None` with one
/// member).
#[derive(Clone, Copy, Default)]
pub struct RankGroups<'a> {
    /// Data × context group: dense gradients are reduced and ZeRO shards live across it.
    pub dp: Option<&'a GroupComm>,
    /// Tensor-parallel group (parameter slices).
    pub tp: Option<&'a GroupComm>,
    /// Pipeline group (disjoint stages).
    pub pp: Option<&'a GroupComm>,
    /// Expert-data × context group: the replicas of this rank's experts (their ZeRO shards
    /// live across it).
    pub edp: Option<&'a GroupComm>,
    /// Expert-parallel group (disjoint experts).
    pub ep: Option<&'a GroupComm>,
}

impl<'a> RankGroups<'a> {
    /// The groups gradient buckets are reduced over.
    pub fn reduce(&self) -> ReduceGroups<'a> {
        ReduceGroups {
            dp: self.dp,
            edp: self.edp,
        }
    }
}

/// The strategies one step's model calls: tensor, context and expert parallelism (each
/// `None` without it), and the data-parallel degree.
pub struct Strategies<'a> {
    /// Tensor (and sequence) parallelism.
    pub tp: Option<TpComm<'a>>,
    /// Context parallelism's ring or all-to-all.
    pub cp: Option<CpComm<'a>>,
    /// Expert parallelism's all-to-all.
    pub ep: Option<EpComm<'a>>,
    /// Data-parallel replicas (a mixture of experts' auxiliary loss divides by them).
    pub data_ranks: usize,
}

/// How the step's sequences are laid out for context parallelism: their length and the
/// kind of attention across ranks.
pub type SequenceSplit = (usize, CpKind);

impl RankMesh {
    /// The groups this rank's gradients and optimizer states are spread over.
    pub fn groups(&self) -> RankGroups<'_> {
        RankGroups {
            dp: self.link(GroupKind::DpCp),
            tp: self.link(GroupKind::Tp),
            pp: self.link(GroupKind::Pp),
            edp: self.link(GroupKind::ExpertDataCp),
            ep: self.link(GroupKind::Ep),
        }
    }

    /// The groups this rank's gradient buckets are reduced over.
    pub fn reduce_groups(&self) -> ReduceGroups<'_> {
        self.groups().reduce()
    }

    /// The strategies of one step: sequence parallelism as `sequence_parallel` says,
    /// sequences split as `split` says, collectives traced into `trace`.
    ///
    /// # Errors
    ///
    /// A sequence context parallelism cannot split.
    pub fn strategies<'a>(
        &'a self,
        sequence_parallel: bool,
        split: SequenceSplit,
        trace: Option<&'a Tracer>,
    ) -> Result<Strategies<'a>, SplitError> {
        Ok(Strategies {
            tp: self.tp_comm(sequence_parallel, trace),
            cp: self.cp_ring(split, trace)?,
            ep: self.ep_comm(trace),
            data_ranks: self.coords(GroupKind::Dp).0,
        })
    }
}
