//! The four pipeline schedules and their configuration spellings.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which pipeline schedule to build (playbook §4), spelled in configurations as `afab`,
/// `1f1b`, `interleaved` or `zero_bubble`.
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
}

impl ScheduleKind {
    /// Every schedule, in the order of the playbook.
    pub const ALL: [ScheduleKind; 4] = [
        ScheduleKind::Afab,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubble,
    ];

    /// The configuration spelling: `afab`, `1f1b`, `interleaved`, `zero_bubble`.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Afab => "afab",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZeroBubble => "zero_bubble",
        }
    }

    /// Whether the backward is split into `BackwardInput` and `BackwardWeight`.
    pub fn splits_backward(self) -> bool {
        self == ScheduleKind::ZeroBubble
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Largest `p·m·v` (forward passes of one step over all ranks) a schedule may have.
pub const MAX_UNITS: usize = 1 << 24;
