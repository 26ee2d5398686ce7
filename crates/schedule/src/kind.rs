//! The four pipeline schedules and their configuration spellings.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::Placement;

/// Which pipeline schedule to build (playbook §4), spelled in configurations as `afab`,
/// `1f1b`, `interleaved`, `zero_bubble` or `dualpipev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// All forward, all backward (GPipe): bubble `(p−1)/m`, all `m` micro-batches live.
    #[serde(rename = "afab")]
    Afab,
    /// One forward, one backward (PipeDream-flush / Megatron): bubble `(p−1)/m`, rank `r`
    /// holds at most `min(p − r, m)` micro-batches.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B with `v ≥ 2` model chunks per rank: bubble
    /// `(p−1)/(v·m)` at `v`× the point-to-point traffic.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero bubble ZB-H1: backward split into `B` (input gradient) and `W` (weight
    /// gradient), `W` deferred into the bubbles; peak memory of 1F1B's first stage.
    #[serde(rename = "zero_bubble")]
    ZeroBubble,
    /// DualPipeV (DeepSeek's DualPipe folded into a V, as torchtitan and Megatron run it):
    /// rank `r` holds stages `r` and `2p−1−r` ([`Placement::V`]); forwards of one chunk are
    /// paired with backwards of the other, and part of the backwards are split into `B` and
    /// `W` as in zero bubble. Needs `m ≥ 2p`.
    #[serde(rename = "dualpipev")]
    DualPipeV,
}

impl ScheduleKind {
    /// Every schedule, in the order of the playbook.
    pub const ALL: [ScheduleKind; 5] = [
        ScheduleKind::Afab,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubble,
        ScheduleKind::DualPipeV,
    ];

    /// The configuration spelling: `afab`, `1f1b`, `interleaved`, `zero_bubble`, `dualpipev`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Afab => "afab",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubble => "zero_bubble",
            ScheduleKind::DualPipeV => "dualpipev",
        }
    }

    /// Whether some backwards are split into `BackwardInput` and `BackwardWeight`.
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZeroBubble | ScheduleKind::DualPipeV)
    }

    /// How this schedule lays virtual stages on ranks.
    pub fn placement(self) -> Placement {
        match self {
            ScheduleKind::DualPipeV => Placement::V,
            _ => Placement::Looped,
        }
    }

    /// Model chunks per rank when the configuration asks for `virtual_stages`: that number
    /// for the interleaved schedule, always 2 for DualPipeV, else 1.
    pub fn chunks(self, virtual_stages: usize) -> usize {
        match self {
            ScheduleKind::Interleaved => virtual_stages,
            ScheduleKind::DualPipeV => 2,
            _ => 1,
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Largest `p·m·v` (forward passes of one step over all ranks) a schedule may have.
pub const MAX_UNITS: usize = 1 << 24;
