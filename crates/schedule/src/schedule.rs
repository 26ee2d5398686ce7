//! A built schedule: one ordered action list per pipeline rank.

use serde::Serialize;

use crate::{Action, Placement, ScheduleError, ScheduleKind};

/// Per rank, the ordered actions of one training step's pipeline.
///
/// Model layout: the kind's [`crate::Placement`] — Megatron's global virtual stage
/// `vs = chunk·p + rank` (rank `r` holds chunks `r, r+p, r+2p, …` of the `v·p` model
/// chunks), or DualPipeV's V (stages `r` and `2p−1−r`). Virtual stage 0 holds the
/// embedding, virtual stage `v·p − 1` the head. Receives sit immediately before the
/// computation that consumes them and sends immediately after the computation that produced
/// them. Where the neighbouring stage is on the rank itself (every neighbour with `p = 1`,
/// the turn of the V on rank `p−1`), no send or receive is emitted: the executor hands the
/// chunk's output to the other chunk locally.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule {
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
    ranks: Vec<Vec<Action>>,
}

impl Schedule {
    /// Wraps hand-written action lists (one per rank), checking that every action fits the
    /// layout: `mb < m`, `chunk < v`, and each send or receive names the rank of the
    /// neighbouring virtual stage. Ordering is not checked here; [`crate::simulate`] finds deadlocks.
    pub fn from_actions(
        kind: ScheduleKind,
        p: usize,
        m: usize,
        v: usize,
        ranks: Vec<Vec<Action>>,
    ) -> Result<Schedule, ScheduleError> {
        crate::shape::check_shape(kind, p, m, v)?;
        if ranks.len() != p {
            return Err(ScheduleError::RankCount {
                p,
                got: ranks.len(),
            });
        }
        for (rank, actions) in ranks.iter().enumerate() {
            for (index, &action) in actions.iter().enumerate() {
                check_action((kind.placement(), p, m, v), rank, action).map_err(|reason| {
                    ScheduleError::InvalidAction {
                        rank,
                        index,
                        action,
                        reason,
                    }
                })?;
            }
        }
        Ok(Schedule {
            kind,
            p,
            m,
            v,
            ranks,
        })
    }

    pub(crate) fn new_unchecked(
        kind: ScheduleKind,
        p: usize,
        m: usize,
        v: usize,
        ranks: Vec<Vec<Action>>,
    ) -> Schedule {
        Schedule {
            kind,
            p,
            m,
            v,
            ranks,
        }
    }

    /// The schedule kind.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Pipeline stages (ranks) `p`.
    pub fn stages(&self) -> usize {
        self.p
    }

    /// Micro-batches per step `m`.
    pub fn micro_batches(&self) -> usize {
        self.m
    }

    /// Model chunks per rank `v` (1 unless interleaved).
    pub fn virtual_stages(&self) -> usize {
        self.v
    }

    /// Every rank's action list, indexed by rank.
    pub fn ranks(&self) -> &[Vec<Action>] {
        &self.ranks
    }

    /// The action list of one rank.
    pub fn actions(&self, rank: usize) -> Result<&[Action], ScheduleError> {
        self.ranks
            .get(rank)
            .map(Vec::as_slice)
            .ok_or(ScheduleError::RankOutOfRange { rank, p: self.p })
    }

    /// Global virtual stage of `chunk` on `rank` ([`crate::Placement::stage`]).
    pub fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        self.kind.placement().stage(self.p, rank, chunk)
    }

    /// Whether `(rank, chunk)` is virtual stage 0, which holds the embedding.
    pub fn holds_embedding(&self, rank: usize, chunk: usize) -> bool {
        self.virtual_stage(rank, chunk) == 0
    }

    /// Whether `(rank, chunk)` is the last virtual stage `v·p − 1`, which holds the head.
    pub fn holds_head(&self, rank: usize, chunk: usize) -> bool {
        self.virtual_stage(rank, chunk).saturating_add(1) == self.v * self.p
    }

    /// Peak number of `(micro-batch, chunk)` activation sets alive on `rank`, from the list
    /// alone (no timings). A set lives from its `Forward` until its `Backward`, or for zero
    /// bubble its `BackwardWeight` (W still reads the saved inputs). Without interleaving
    /// this is micro-batches; interleaved, each unit is one chunk, `1/v` of the rank's blocks.
    pub fn peak_in_flight(&self, rank: usize) -> Result<usize, ScheduleError> {
        Ok(peak_of(self.actions(rank)?))
    }
}

/// Peak activation sets alive over one action list.
pub(crate) fn peak_of(actions: &[Action]) -> usize {
    let (mut alive, mut peak) = (0usize, 0usize);
    for action in actions {
        match action {
            Action::Forward { .. } => {
                alive += 1;
                peak = peak.max(alive);
            }
            Action::Backward { .. } | Action::BackwardWeight { .. } => {
                alive = alive.saturating_sub(1);
            }
            _ => {}
        }
    }
    peak
}

/// The ranks of the stages before and after virtual stage `vs` when they are other ranks
/// than `rank` (a neighbour on the rank itself is handed over locally, without a message).
fn neighbours(
    placement: Placement,
    (p, v): (usize, usize),
    rank: usize,
    vs: usize,
) -> (Option<usize>, Option<usize>) {
    let last = v * p - 1;
    let other = |r: usize| (r != rank).then_some(r);
    let prev = (vs > 0)
        .then(|| placement.owner(p, vs - 1).0)
        .and_then(other);
    let next = (vs < last)
        .then(|| placement.owner(p, vs + 1).0)
        .and_then(other);
    (prev, next)
}

/// Wraps a rank's computation order with the sends and receives it implies.
pub(crate) fn with_comms(
    placement: Placement,
    (p, v): (usize, usize),
    rank: usize,
    compute: &[Action],
) -> Vec<Action> {
    let mut out = Vec::with_capacity(compute.len() * 3);
    for &action in compute {
        let (mb, chunk) = (action.mb(), action.chunk());
        let vs = placement.stage(p, rank, chunk);
        let (prev, next) = neighbours(placement, (p, v), rank, vs);
        match action {
            Action::Forward { .. } => {
                if let Some(from_stage) = prev {
                    out.push(Action::RecvActivation {
                        mb,
                        chunk,
                        from_stage,
                    });
                }
                out.push(action);
                if let Some(to_stage) = next {
                    out.push(Action::SendActivation {
                        mb,
                        chunk,
                        to_stage,
                    });
                }
            }
            Action::Backward { .. } | Action::BackwardInput { .. } => {
                if let Some(from_stage) = next {
                    out.push(Action::RecvGrad {
                        mb,
                        chunk,
                        from_stage,
                    });
                }
                out.push(action);
                if let Some(to_stage) = prev {
                    out.push(Action::SendGrad {
                        mb,
                        chunk,
                        to_stage,
                    });
                }
            }
            _ => out.push(action),
        }
    }
    out
}

fn check_action(
    (placement, p, m, v): (Placement, usize, usize, usize),
    rank: usize,
    action: Action,
) -> Result<(), String> {
    if action.mb() >= m {
        return Err(format!(
            "micro-batch {} is out of range 0..{m}",
            action.mb()
        ));
    }
    if action.chunk() >= v {
        return Err(format!("chunk {} is out of range 0..{v}", action.chunk()));
    }
    let Some(peer) = action.peer() else {
        return Ok(());
    };
    if p == 1 {
        return Err("a one-stage pipeline has no peer to talk to; remove the send/receive".into());
    }
    let vs = placement.stage(p, rank, action.chunk());
    let (prev, next) = neighbours(placement, (p, v), rank, vs);
    let want = match action {
        Action::SendActivation { .. } | Action::RecvGrad { .. } => next,
        _ => prev,
    };
    let Some(want) = want else {
        return Err(format!(
            "virtual stage {vs} has no neighbour on another rank in this direction (the end \
             of the model, or a stage on this rank); remove it"
        ));
    };
    if peer != want {
        return Err(format!(
            "the neighbouring virtual stage is on rank {want}, not {peer}"
        ));
    }
    Ok(())
}
