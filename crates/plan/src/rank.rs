//! Ranking of candidates and the explanations of why one lost to another.

use crate::category::Memory;
use crate::cost::{CommKind, StepCost};
use crate::layout::{Layout, Recompute, Schedule};
use crate::GIB;
use serde::{Deserialize, Serialize};

/// Why a layout is where it is in the ranking.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// The fastest layout that fits and makes the batch.
    Best,
    /// Fits and makes the batch, but slower than the best.
    Slower {
        /// Percent more time per step.
        percent: f64,
        /// Where the time goes, compared with the best.
        why: String,
    },
    /// Would be faster than the best but needs more memory than the device has.
    OutOfMemory {
        /// Bytes of the peak rank.
        needed: u64,
        /// Usable bytes of the device.
        available: u64,
        /// How much faster than the best it would be, percent (`None` when nothing fits).
        faster_percent: Option<f64>,
    },
    /// Would be faster than the best, but `dp · b · m` cannot equal the global batch.
    BatchNotReachable {
        /// The arithmetic that fails.
        why: String,
        /// How much faster than the best it would be, percent, at the nearest batch
        /// (`None` when nothing fits).
        faster_percent: Option<f64>,
    },
}

/// One evaluated layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The layout.
    pub layout: Layout,
    /// Peak bytes per category of its largest rank.
    pub memory: Memory,
    /// Pipeline stage of that rank.
    pub peak_stage: usize,
    /// Predicted step time and throughput.
    pub cost: StepCost,
    /// Its place in the ranking.
    pub verdict: Verdict,
}

/// The parallel shape of a layout: (dp, tp, pp, cp, ep, zero).
pub(crate) fn shape(l: &Layout) -> (usize, usize, usize, usize, usize, u8) {
    (l.dp, l.tp, l.pp, l.cp, l.ep, l.zero)
}

/// Sort key: step time in steps of 0.1%, then the simpler layout (fewer parallel dimensions,
/// lower ZeRO stage, no recomputation, plain schedule), then less memory. Predictions closer
/// than 0.1% are ties the model cannot break honestly; simplicity is the playbook's default.
pub(crate) fn rank_key(c: &Candidate) -> (i64, u32, u64) {
    let l = &c.layout;
    let steps = (c.cost.step_s.ln() / 1e-3_f64.ln_1p()).floor() as i64;
    let dims = [l.tp, l.pp, l.cp, l.ep].iter().filter(|&&d| d > 1).count() as u32;
    let complexity = 4 * dims
        + u32::from(l.zero)
        + 2 * u32::from(l.recompute != Recompute::None)
        + u32::from(matches!(
            l.pp_schedule,
            Schedule::Interleaved | Schedule::ZeroBubble | Schedule::DualPipeV
        ));
    (steps, complexity, c.memory.total())
}

/// Where `other` loses time against `best`: the two components that grew most.
pub(crate) fn slower(best: &StepCost, other: &StepCost, layout: &Layout) -> Verdict {
    let exposed = |c: &StepCost, k: CommKind| {
        c.comm
            .iter()
            .filter(|x| x.kind == k)
            .map(|x| x.exposed_s)
            .sum::<f64>()
    };
    let bubble_name = format!("pipeline bubble ({:.3} of ideal)", other.bubble_fraction);
    let mut parts = vec![
        (other.compute_s - best.compute_s, "compute".to_string()),
        (other.bubble_s - best.bubble_s, bubble_name),
    ];
    for (kind, name) in [
        (CommKind::DataParallel, "exposed DP communication"),
        (CommKind::Zero, "exposed ZeRO gathers/reduce-scatters"),
        (CommKind::TensorParallel, "TP communication"),
        (CommKind::Pipeline, "PP sends"),
        (CommKind::Context, "exposed CP ring"),
        (CommKind::Expert, "EP all-to-all"),
    ] {
        parts.push((exposed(other, kind) - exposed(best, kind), name.to_string()));
    }
    if layout.recompute == Recompute::Full {
        parts[0].1 = "compute (incl. full recomputation)".into();
    }
    parts.sort_by(|a, b| b.0.total_cmp(&a.0));
    let why: Vec<String> = parts
        .iter()
        .filter(|p| p.0 > 1e-4 * best.step_s)
        .take(2)
        .map(|(s, name)| format!("+{} {name}", crate::units::seconds(*s)))
        .collect();
    Verdict::Slower {
        percent: (other.step_s / best.step_s - 1.0) * 100.0,
        why: if why.is_empty() {
            "equal time, more memory".into()
        } else {
            why.join(", ")
        },
    }
}

impl Candidate {
    /// One line: layout, memory, throughput and verdict.
    pub fn summary(&self) -> String {
        let verdict = match &self.verdict {
            Verdict::Best => "best".to_string(),
            Verdict::Slower { percent, why } => format!("slower by {percent:.1}%: {why}"),
            Verdict::OutOfMemory {
                needed,
                available,
                faster_percent,
            } => format!(
                "out of memory: needs {:.1} GiB of {:.1} GiB usable ({} dominates){}",
                *needed as f64 / GIB,
                *available as f64 / GIB,
                self.memory.dominant().name(),
                would_be(*faster_percent)
            ),
            Verdict::BatchNotReachable {
                why,
                faster_percent,
            } => format!("batch not reachable: {why}{}", would_be(*faster_percent)),
        };
        format!(
            "{:<44} {:>7.1} GiB  {:>9.0} tok/s/GPU  MFU {:>5.1}%  {verdict}",
            self.layout.describe(),
            self.memory.total() as f64 / GIB,
            self.cost.tokens_per_s_per_gpu,
            100.0 * self.cost.mfu
        )
    }
}

fn would_be(faster_percent: Option<f64>) -> String {
    faster_percent.map_or(String::new(), |f| format!("; would be {f:.1}% faster"))
}
