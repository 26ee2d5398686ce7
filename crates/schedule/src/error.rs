//! Typed errors: every message names the offending field and how to fix it.

use std::fmt;

use std::str::FromStr;

use crate::kind::MAX_UNITS;
use crate::{Action, ScheduleKind};

/// A rank that cannot make progress when the simulator detects a deadlock.
#[derive(Debug, Clone, PartialEq)]
pub struct Stuck {
    /// The pipeline rank.
    pub rank: usize,
    /// Position of the blocked action in the rank's list.
    pub index: usize,
    /// The receive it is blocked on.
    pub action: Action,
}

impl fmt::Display for Stuck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} at action #{} {}",
            self.rank, self.index, self.action
        )
    }
}

fn list<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Why a schedule could not be built, checked or simulated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// `p = 0`.
    #[error("pipeline stages p must be at least 1 (got p=0); set parallel.pp >= 1")]
    ZeroStages,
    /// `m = 0`.
    #[error("micro-batches per step m must be at least 1 (got m=0); set train.grad_accum >= 1")]
    ZeroMicroBatches,
    /// `v = 0`.
    #[error("virtual stages v must be at least 1 (got v=0); set parallel.virtual_stages >= 1")]
    ZeroVirtualStages,
    /// `v > 1` with a schedule that runs one chunk per rank.
    #[error(
        "virtual stages (v={v}) > 1 need the interleaved schedule, not `{kind}`; set \
         parallel.pp_schedule = \"interleaved\" or parallel.virtual_stages = 1"
    )]
    ChunksNeedInterleaved {
        /// The requested schedule.
        kind: ScheduleKind,
        /// The requested virtual stages.
        v: usize,
    },
    /// Interleaved with `v = 1` (refused rather than silently run as 1F1B).
    #[error(
        "the interleaved schedule needs virtual stages v >= 2 (got v=1); set \
         parallel.virtual_stages >= 2, or parallel.pp_schedule = \"1f1b\" for one chunk per rank"
    )]
    InterleavedNeedsChunks,
    /// Interleaved with `m % p != 0`.
    #[error(
        "interleaved schedules need micro-batches (m={m}) divisible by stages (p={p}); set \
         train.grad_accum to a multiple of parallel.pp"
    )]
    MicroBatchesNotDivisible {
        /// Micro-batches per step.
        m: usize,
        /// Pipeline stages.
        p: usize,
    },
    /// DualPipeV with other than two chunks per rank.
    #[error(
        "DualPipeV holds exactly 2 model chunks per rank (stages r and 2p−1−r), got v={v}; \
         leave parallel.virtual_stages at 1 (the schedule sets 2 itself)"
    )]
    DualPipeVChunks {
        /// The requested chunks per rank.
        v: usize,
    },
    /// DualPipeV with fewer than `2p` micro-batches.
    #[error(
        "DualPipeV needs at least 2·p micro-batches (p={p}, so {}), got m={m}; raise \
         train.grad_accum or lower parallel.pp",
        2 * *p
    )]
    DualPipeVMicroBatches {
        /// Micro-batches per step.
        m: usize,
        /// Pipeline stages.
        p: usize,
    },
    /// `p·m·v` beyond [`crate::MAX_UNITS`]: the action lists would not fit in memory.
    #[error(
        "pipeline too large: p={p} x m={m} x v={v} exceeds {} (micro-batch, stage) units; \
         lower parallel.pp, train.grad_accum or parallel.virtual_stages",
        MAX_UNITS
    )]
    TooLarge {
        /// Pipeline stages.
        p: usize,
        /// Micro-batches per step.
        m: usize,
        /// Virtual stages (chunks) per rank.
        v: usize,
    },
    /// `layers % (p·v) != 0`.
    #[error(
        "layers ({layers}) must be divisible by stages x virtual stages (p={p} x v={v} = {}); \
         change model.layers, parallel.pp or parallel.virtual_stages, or give parallel.pp_layers",
        p.saturating_mul(*v)
    )]
    LayersNotDivisible {
        /// Transformer blocks in the model.
        layers: usize,
        /// Pipeline stages.
        p: usize,
        /// Virtual stages (chunks) per rank.
        v: usize,
    },
    /// `parallel.pp_layers` does not describe every block once over every virtual stage.
    #[error(
        "needs {stages} entries (pp × chunks per rank: virtual_stages, or 2 under DualPipeV), \
         each ≥ 1, summing to model.layers={layers}; got {got:?}"
    )]
    BadStageList {
        /// Virtual stages `p·v`.
        stages: usize,
        /// Transformer blocks in the model.
        layers: usize,
        /// The list given.
        got: Vec<usize>,
    },
    /// A schedule name that is none of the five.
    #[error(
        "unknown pipeline schedule `{got}` in parallel.pp_schedule; expected one of afab, 1f1b, \
         interleaved, zero_bubble, dualpipev"
    )]
    UnknownKind {
        /// The string that failed to parse.
        got: String,
    },
    /// A cost that is negative, NaN or infinite.
    #[error("cost `{field}` must be finite and >= 0 (got {value}); fix Costs::{field}")]
    InvalidCost {
        /// The `Costs` field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// Costs under which no rank does any work, so the bubble fraction is undefined.
    #[error(
        "the busiest rank's compute time is 0, so the bubble fraction is undefined; give \
         Costs::forward (and the backward costs the schedule uses) a positive value"
    )]
    ZeroIdealTime,
    /// A rank index at or beyond `p`.
    #[error("rank {rank} is out of range for a {p}-stage schedule; use a rank in 0..{p}")]
    RankOutOfRange {
        /// The requested rank.
        rank: usize,
        /// Pipeline stages.
        p: usize,
    },
    /// A hand-built schedule whose rank count differs from `p`.
    #[error("schedule has {got} action lists but p={p} stages; give one list per rank")]
    RankCount {
        /// Pipeline stages.
        p: usize,
        /// Action lists given.
        got: usize,
    },
    /// A hand-built action that does not fit the layout.
    #[error("rank {rank}, action #{index} ({action}): {reason}")]
    InvalidAction {
        /// The rank holding it.
        rank: usize,
        /// Its position in the rank's list.
        index: usize,
        /// The action.
        action: Action,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// Every unfinished rank waits on a receive nobody will send.
    #[error(
        "pipeline deadlock: every unfinished rank is blocked on a receive whose send never \
         comes ({}); reorder the action lists so each receive's send is posted first",
        list(.stuck)
    )]
    Deadlock {
        /// The blocked ranks and their next actions.
        stuck: Vec<Stuck>,
    },
    /// Sends left unreceived when every rank has finished.
    #[error(
        "{count} send(s) were never received, first: rank {rank} {action}; add the matching \
         receive on rank {to}"
    )]
    UnmatchedSend {
        /// How many messages were left.
        count: usize,
        /// Sending rank of the first one.
        rank: usize,
        /// The first unmatched send.
        action: Action,
        /// The rank that should receive it.
        to: usize,
    },
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    /// Parses the configuration spelling exactly (lower case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| ScheduleError::UnknownKind { got: s.to_string() })
    }
}
