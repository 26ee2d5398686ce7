//! The grid of ranks: `dp · pp · cp · tp` ranks, expert parallelism folded into `dp`.
//!
//! Rank order puts tensor parallelism innermost (neighbouring ranks, fastest links), then
//! context, then pipeline, with data parallelism outermost:
//! `rank = ((dp_i·pp + pp_i)·cp + cp_i)·tp + tp_i`.
//!
//! Within the data-parallel dimension, expert parallelism of degree `ep` splits the `dp`
//! replicas into groups of `ep` consecutive data-parallel indices: a rank's expert index is
//! `dp_i % ep` and its expert-data index is `dp_i / ep`. The dense parts of a
//! mixture-of-experts model stay data-parallel over all `dp` replicas, while experts are
//! sharded over an [`GroupKind::Ep`] group and replicated over an
//! [`GroupKind::ExpertData`] group. With context parallelism, the context-parallel ranks of an
//! expert-data group compute partial gradients of the same experts (from different tokens),
//! so expert gradients are reduced over [`GroupKind::ExpertDataCp`], as dense ones over
//! [`GroupKind::DpCp`].

use std::fmt;

use crate::error::TopologyError;

/// A validated parallel layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    dp: usize,
    pp: usize,
    cp: usize,
    tp: usize,
    ep: usize,
    world: usize,
}

/// A rank's position in the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coords {
    /// Data-parallel index, `0..dp`.
    pub dp: usize,
    /// Pipeline stage, `0..pp`.
    pub pp: usize,
    /// Context-parallel index, `0..cp`.
    pub cp: usize,
    /// Tensor-parallel index, `0..tp`.
    pub tp: usize,
    /// Expert-parallel index, `dp % ep`.
    pub ep: usize,
    /// Expert-data index, `dp / ep`: which replica of the experts this rank holds.
    pub edp: usize,
}

/// The kinds of process group a rank belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKind {
    /// Ranks sharing (dp, pp, cp): they split layers' weights.
    Tp,
    /// Ranks sharing (dp, pp, tp): they split the sequence.
    Cp,
    /// Ranks sharing (dp, cp, tp): the stages of one pipeline.
    Pp,
    /// Ranks sharing (pp, cp, tp): the data-parallel replicas.
    Dp,
    /// Ranks sharing (pp, tp): every dp and cp index; gradients are reduced over it.
    DpCp,
    /// Ranks sharing (pp, cp, tp) and the expert-data index: experts are split over it.
    Ep,
    /// Ranks sharing (pp, cp, tp) and the expert index: the replicas of the same experts.
    ExpertData,
    /// Ranks sharing (pp, tp) and the expert index: every expert-data and context-parallel
    /// index; expert gradients are reduced over it.
    ExpertDataCp,
    /// Every rank.
    World,
}

impl GroupKind {
    /// Every kind, in display order.
    pub const ALL: [GroupKind; 9] = [
        GroupKind::Tp,
        GroupKind::Cp,
        GroupKind::Pp,
        GroupKind::Dp,
        GroupKind::DpCp,
        GroupKind::Ep,
        GroupKind::ExpertData,
        GroupKind::ExpertDataCp,
        GroupKind::World,
    ];

    /// Short lower-case name: `tp`, `cp`, `pp`, `dp`, `dp·cp`, `ep`, `edp`, `edp·cp`, `world`.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tp => "tp",
            GroupKind::Cp => "cp",
            GroupKind::Pp => "pp",
            GroupKind::Dp => "dp",
            GroupKind::DpCp => "dp·cp",
            GroupKind::Ep => "ep",
            GroupKind::ExpertData => "edp",
            GroupKind::ExpertDataCp => "edp·cp",
            GroupKind::World => "world",
        }
    }

    /// Whether two ranks with these coordinates belong to the same group of this kind.
    fn same(self, a: &Coords, b: &Coords) -> bool {
        let (pp, cp, tp) = (a.pp == b.pp, a.cp == b.cp, a.tp == b.tp);
        match self {
            GroupKind::Tp => a.dp == b.dp && pp && cp,
            GroupKind::Cp => a.dp == b.dp && pp && tp,
            GroupKind::Pp => a.dp == b.dp && cp && tp,
            GroupKind::Dp => pp && cp && tp,
            GroupKind::DpCp => pp && tp,
            GroupKind::Ep => pp && cp && tp && a.edp == b.edp,
            GroupKind::ExpertData => pp && cp && tp && a.ep == b.ep,
            GroupKind::ExpertDataCp => pp && tp && a.ep == b.ep,
            GroupKind::World => true,
        }
    }
}

/// A process group as seen from one of its members.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Group {
    /// What kind of group this is.
    pub kind: GroupKind,
    /// Its members as world ranks, in increasing order.
    pub ranks: Vec<usize>,
    /// The position of the rank this group was asked for within `ranks`.
    pub index: usize,
}

impl Group {
    /// Number of members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The members as world ranks.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
}

impl AsRef<[usize]> for Group {
    fn as_ref(&self) -> &[usize] {
        &self.ranks
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} group {:?}", self.kind.name(), self.ranks)
    }
}

impl Topology {
    /// Validates a layout: every degree at least 1 and `ep` dividing `dp`.
    pub fn new(
        dp: usize,
        pp: usize,
        cp: usize,
        tp: usize,
        ep: usize,
    ) -> Result<Topology, TopologyError> {
        for (field, value) in [("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)] {
            if value == 0 {
                return Err(TopologyError::ZeroDegree { field });
            }
        }
        if !dp.is_multiple_of(ep) {
            return Err(TopologyError::EpNotDividing { ep, dp });
        }
        let world = dp
            .checked_mul(pp)
            .and_then(|x| x.checked_mul(cp))
            .and_then(|x| x.checked_mul(tp))
            .ok_or(TopologyError::TooManyRanks { dp, pp, cp, tp })?;
        Ok(Topology {
            dp,
            pp,
            cp,
            tp,
            ep,
            world,
        })
    }

    /// Data-parallel degree.
    pub fn dp(&self) -> usize {
        self.dp
    }
    /// Pipeline-parallel degree.
    pub fn pp(&self) -> usize {
        self.pp
    }
    /// Context-parallel degree.
    pub fn cp(&self) -> usize {
        self.cp
    }
    /// Tensor-parallel degree.
    pub fn tp(&self) -> usize {
        self.tp
    }
    /// Expert-parallel degree (a divisor of `dp`).
    pub fn ep(&self) -> usize {
        self.ep
    }

    /// Number of ranks: `dp · pp · cp · tp`.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Checks that `world` ranks were launched for this layout.
    pub fn check_world(&self, world: usize) -> Result<(), TopologyError> {
        if world == self.world {
            return Ok(());
        }
        Err(TopologyError::WorldMismatch {
            world,
            expected: self.world,
            dp: self.dp,
            pp: self.pp,
            cp: self.cp,
            tp: self.tp,
        })
    }

    /// The grid coordinates of `rank`.
    pub fn coords(&self, rank: usize) -> Result<Coords, TopologyError> {
        if rank >= self.world {
            return Err(TopologyError::RankOutOfRange {
                rank,
                world: self.world,
            });
        }
        let tp = rank % self.tp;
        let rest = rank / self.tp;
        let cp = rest % self.cp;
        let rest = rest / self.cp;
        let pp = rest % self.pp;
        let dp = rest / self.pp;
        Ok(Coords {
            dp,
            pp,
            cp,
            tp,
            ep: dp % self.ep,
            edp: dp / self.ep,
        })
    }

    /// The rank at grid position (dp, pp, cp, tp).
    pub fn rank_of(
        &self,
        dp: usize,
        pp: usize,
        cp: usize,
        tp: usize,
    ) -> Result<usize, TopologyError> {
        for (field, value, degree) in [
            ("dp", dp, self.dp),
            ("pp", pp, self.pp),
            ("cp", cp, self.cp),
            ("tp", tp, self.tp),
        ] {
            if value >= degree {
                return Err(TopologyError::CoordOutOfRange {
                    field,
                    value,
                    degree,
                });
            }
        }
        Ok(((dp * self.pp + pp) * self.cp + cp) * self.tp + tp)
    }

    /// The group of `kind` that `rank` belongs to.
    pub fn group(&self, kind: GroupKind, rank: usize) -> Result<Group, TopologyError> {
        let me = self.coords(rank)?;
        let mut ranks = Vec::new();
        for r in 0..self.world {
            let c = self.coords(r)?;
            if kind.same(&me, &c) {
                ranks.push(r);
            }
        }
        // `rank` satisfies its own predicate, so it is always found.
        let index = ranks.iter().position(|&r| r == rank).unwrap_or(0);
        Ok(Group { kind, ranks, index })
    }

    /// Every distinct group of `kind`, ordered by their lowest rank.
    pub fn groups(&self, kind: GroupKind) -> Vec<Group> {
        let mut out: Vec<Group> = Vec::new();
        for r in 0..self.world {
            if out.iter().any(|g| g.ranks.contains(&r)) {
                continue;
            }
            if let Ok(g) = self.group(kind, r) {
                out.push(g);
            }
        }
        out
    }

    /// One line describing `rank`: its coordinates and the members of each of its groups
    /// (the world group is left out).
    pub fn describe_rank(&self, rank: usize) -> Result<String, TopologyError> {
        let c = self.coords(rank)?;
        let mut line = format!(
            "rank {rank}: dp={} pp={} cp={} tp={} ep={} edp={} |",
            c.dp, c.pp, c.cp, c.tp, c.ep, c.edp
        );
        for kind in GroupKind::ALL {
            if kind != GroupKind::World {
                let g = self.group(kind, rank)?;
                line.push(' ');
                line.push_str(&g.to_string());
            }
        }
        Ok(line)
    }
}

impl fmt::Display for Topology {
    /// A header line, then one line per rank (see [`Topology::describe_rank`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "layout dp={} pp={} cp={} tp={} ep={}: {} ranks (tp innermost, dp outermost)",
            self.dp, self.pp, self.cp, self.tp, self.ep, self.world
        )?;
        for rank in 0..self.world {
            match self.describe_rank(rank) {
                Ok(line) => write!(f, "\n{line}")?,
                Err(e) => write!(f, "\n{e}")?,
            }
        }
        Ok(())
    }
}
