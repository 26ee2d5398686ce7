//! The rank mesh (playbook §4 and §6, "5D parallelism"): every group one rank belongs to, built once
//! from the topology — tensor, context, pipeline, data, data × context (where gradients are
//! reduced and ZeRO shards), expert and expert-data × context — with the rank's one
//! communicator. Each technique takes its group from here; nothing else wraps a
//! communicator and a group.

use std::sync::Arc;

use ferrotron_comm::{Comm, Group, GroupKind, Topology, TopologyError};
use ferrotron_tensor::ring_attention::SplitError;
use ferrotron_tensor::trace::Tracer;

use crate::{CommVolume, CpComm, EpComm, TpComm};

/// This rank's communicator and one of its groups.
#[derive(Clone)]
pub struct GroupComm {
    /// The communicator (one per rank, shared by its groups).
    pub comm: Arc<Comm>,
    /// The group.
    pub group: Group,
}

/// Every group of one rank.
pub struct RankMesh {
    rank: usize,
    /// Each kind's group (size 1 on a single rank), in [`GroupKind::ALL`] order.
    groups: Vec<Group>,
    /// Each kind's link: `None` for a group of one, which needs no communication.
    links: Vec<Option<GroupComm>>,
    comm: Option<Arc<Comm>>,
    /// Bytes and calls of the tensor-parallel collectives inside forward and backward.
    pub tp_volume: CommVolume,
}

fn slot(kind: GroupKind) -> usize {
    GroupKind::ALL
        .iter()
        .position(|k| *k == kind)
        .unwrap_or_else(|| unreachable!("GroupKind::ALL lists every kind"))
}

impl RankMesh {
    /// The mesh of `comm`'s rank in `topology`.
    pub fn new(comm: Arc<Comm>, topology: &Topology) -> Result<Self, TopologyError> {
        let rank = comm.rank();
        let groups = GroupKind::ALL
            .iter()
            .map(|&kind| topology.group(kind, rank))
            .collect::<Result<Vec<_>, _>>()?;
        let links = groups
            .iter()
            .map(|g| {
                (g.size() > 1).then(|| GroupComm {
                    comm: comm.clone(),
                    group: g.clone(),
                })
            })
            .collect();
        Ok(RankMesh {
            rank,
            groups,
            links,
            comm: Some(comm),
            tp_volume: CommVolume::default(),
        })
    }

    /// The mesh of a run on one rank: every group is this rank alone, and there is no
    /// communicator.
    pub fn single() -> Self {
        let topology = Topology::new(1, 1, 1, 1, 1)
            .unwrap_or_else(|_| unreachable!("the 1×1×1×1×1 grid is valid"));
        let groups = GroupKind::ALL
            .iter()
            .map(|&kind| topology.group(kind, 0))
            .collect::<Result<Vec<_>, _>>()
            .unwrap_or_else(|_| unreachable!("rank 0 is in the one-rank grid"));
        RankMesh {
            rank: 0,
            links: vec![None; groups.len()],
            groups,
            comm: None,
            tp_volume: CommVolume::default(),
        }
    }

    /// This rank's world rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The rank's communicator (None on a single rank).
    pub fn comm(&self) -> Option<&Arc<Comm>> {
        self.comm.as_ref()
    }

    /// The group of `kind` (this rank alone on a single rank).
    pub fn group(&self, kind: GroupKind) -> &Group {
        &self.groups[slot(kind)]
    }

    /// (size, this rank's index) of the group of `kind`.
    pub fn coords(&self, kind: GroupKind) -> (usize, usize) {
        let g = self.group(kind);
        (g.size(), g.index)
    }

    /// The communicator and group of `kind`, when the group has two members or more.
    pub fn link(&self, kind: GroupKind) -> Option<&GroupComm> {
        self.links[slot(kind)].as_ref()
    }

    /// The tensor-parallel strategy (None without tensor parallelism).
    pub fn tp_comm<'a>(
        &'a self,
        sequence_parallel: bool,
        trace: Option<&'a Tracer>,
    ) -> Option<TpComm<'a>> {
        self.link(GroupKind::Tp).map(|l| TpComm {
            comm: &l.comm,
            group: &l.group,
            sequence_parallel,
            volume: &self.tp_volume,
            trace,
        })
    }

    /// The context-parallel group for sequences of `seq_len` tokens, attending as `kind`
    /// says (None without context parallelism).
    pub fn cp_ring<'a>(
        &'a self,
        (seq_len, kind): (usize, ferrotron_config::CpKind),
        trace: Option<&'a Tracer>,
    ) -> Result<Option<CpComm<'a>>, SplitError> {
        self.link(GroupKind::Cp)
            .map(|l| CpComm::new(&l.comm, &l.group, (seq_len, kind), trace))
            .transpose()
    }

    /// The expert-parallel strategy (None below two members).
    pub fn ep_comm<'a>(&'a self, trace: Option<&'a Tracer>) -> Option<EpComm<'a>> {
        self.link(GroupKind::Ep).map(|l| EpComm {
            comm: &l.comm,
            group: &l.group,
            trace,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_comm::run_ranks;
    use std::time::Duration;

    #[test]
    fn groups_come_from_the_topology_and_single_groups_have_no_link() {
        let topo = Topology::new(2, 1, 1, 2, 1).unwrap();
        let out = run_ranks(4, Duration::from_secs(10), |ctx| {
            let comm = Arc::new(ctx.comm(ferrotron_tensor::Ledger::new())?);
            let mesh = RankMesh::new(comm, &topo)?;
            let tp = mesh.coords(GroupKind::Tp);
            let dp = mesh.coords(GroupKind::Dp);
            let links = (
                mesh.link(GroupKind::Tp).is_some(),
                mesh.link(GroupKind::Pp).is_some(),
            );
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((mesh.rank(), tp, dp, links))
        })
        .unwrap();
        for (rank, tp, dp, links) in out {
            assert_eq!(tp, (2, rank % 2));
            assert_eq!(dp, (2, rank / 2));
            assert_eq!(links, (true, false));
        }
        let one = RankMesh::single();
        assert_eq!(one.coords(GroupKind::DpCp), (1, 0));
        assert!(one.link(GroupKind::World).is_none() && one.comm().is_none());
    }
}
