//! The planner: the playbook's recipe (§6) as a search. Every layout of `gpus` devices —
//! TP within a node dividing the head counts, PP up to the layer count, CP with zig-zag
//! chunks, EP dividing the experts, ZeRO 0–3 (ZeRO-3 without PP), full recomputation or none,
//! the pipeline schedules (contiguous stages split by [`crate::balanced_pp_layers`]), micro-batch
//! sizes — is (1) estimated and kept if it fits the
//! device, (2) kept if `dp · b · m` sequences make the global batch exactly, (3) ranked by
//! predicted throughput. Close alternatives that lost are reported with the reason.

use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, StepCost};
use crate::hardware::Hardware;
use crate::layout::Schedule;
use crate::memory::Assumptions;
use crate::model::ModelSpec;
use crate::rank::{rank_key, shape, slower};
pub use crate::rank::{Candidate, Verdict};
use crate::PlanError;

mod search;

use search::{Found, Space};

/// What to plan for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRequest {
    /// The model (its `seq_len` is replaced by `seq`).
    pub model: ModelSpec,
    /// Devices.
    pub gpus: usize,
    /// Device and interconnect.
    pub hardware: Hardware,
    /// Sequence length.
    pub seq: usize,
    /// Tokens per optimizer step (a multiple of `seq`).
    pub global_batch_tokens: usize,
}

/// Fixes some dimensions of the search (`None` = search it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeFilter {
    /// Data-parallel degree.
    pub dp: Option<usize>,
    /// Tensor-parallel degree.
    pub tp: Option<usize>,
    /// Pipeline stages.
    pub pp: Option<usize>,
    /// Context-parallel degree.
    pub cp: Option<usize>,
    /// Expert-parallel degree.
    pub ep: Option<usize>,
    /// ZeRO stage.
    pub zero: Option<u8>,
    /// Pipeline schedule (with more than one stage).
    pub schedule: Option<Schedule>,
}

/// How to search and what to return.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// Fitting layouts to return, best first.
    pub top: usize,
    /// Layouts that would have been faster but do not fit or miss the batch, to report.
    pub alternatives: usize,
    /// Cost model.
    pub cost: CostModel,
    /// Memory assumptions.
    pub assumptions: Assumptions,
    /// Fraction of device memory a step may use (the rest: CUDA context, fragmentation, what
    /// the rough categories miss).
    pub usable_memory: f64,
    /// Largest micro-batch tried (powers of two up to it).
    pub max_micro_batch: usize,
    /// Fixed dimensions.
    pub only: ShapeFilter,
    /// Accumulate and reduce gradients in fp32 (`train.fp32_grad_accum`; bf16 only), as
    /// nanotron, which ran the playbook's measurements, does.
    pub fp32_grad_accum: bool,
    /// Also try the interleaved, zero-bubble and DualPipeV schedules (AFAB and 1F1B always).
    pub advanced_schedules: bool,
    /// Highest ZeRO stage tried.
    pub max_zero: u8,
    /// Only layouts this engine runs ([`crate::Job::engine_accepts`]): no tied embeddings or ZeRO-2
    /// with pipeline parallelism. `true` by default; `false`
    /// for the system the playbook measured ([`PlanOptions::playbook_measured`]), which ran
    /// such layouts.
    #[serde(default = "yes")]
    pub engine_only: bool,
}

fn yes() -> bool {
    true
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            top: 5,
            alternatives: 3,
            cost: CostModel::default(),
            assumptions: Assumptions::default(),
            usable_memory: 0.9,
            max_micro_batch: 16,
            only: ShapeFilter::default(),
            fp32_grad_accum: false,
            advanced_schedules: true,
            max_zero: 3,
            engine_only: true,
        }
    }
}

impl PlanOptions {
    /// The system the playbook's §6 measurements ran on (nanotron): gradients accumulated in
    /// fp32 and all-reduced (ZeRO-0) or reduce-scattered (ZeRO-1) in fp32 from DDP bucket
    /// hooks during the last micro-batch's backward, ZeRO-0/1 only, AFAB and 1F1B only, no
    /// context parallelism, and its fixed host time per step
    /// ([`crate::MEASURED_STEP_OVERHEAD_S`]). With it the planner predicts what the playbook
    /// measured rather than what this engine would reach.
    pub fn playbook_measured() -> Self {
        let mut opts = PlanOptions {
            fp32_grad_accum: true,
            advanced_schedules: false,
            max_zero: 1,
            engine_only: false,
            ..PlanOptions::default()
        };
        opts.only.cp = Some(1);
        opts.cost.step_overhead_s = crate::cost::MEASURED_STEP_OVERHEAD_S;
        opts
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Model name.
    pub model: String,
    /// Parameters Ψ.
    pub params: u64,
    /// Devices.
    pub gpus: usize,
    /// Hardware profile.
    pub hardware: String,
    /// Sequence length.
    pub seq: usize,
    /// Tokens per step.
    pub global_batch_tokens: usize,
    /// Usable bytes per device.
    pub usable_bytes: u64,
    /// Layouts evaluated.
    pub considered: usize,
    /// Layouts that fit and make the batch.
    pub fitting: usize,
    /// Layouts the engine's validation refuses ([`PlanOptions::engine_only`]), not ranked.
    #[serde(default)]
    pub refused: usize,
    /// The best fitting layouts (first: `Best`), then the alternatives that lost.
    pub candidates: Vec<Candidate>,
}

/// The best layouts of `model` on `gpus` devices of `hardware` at sequence length `seq` and
/// `global_batch_tokens` tokens per step, with default options (see [`plan_with`]).
pub fn plan(
    model: &ModelSpec,
    gpus: usize,
    hardware: &Hardware,
    seq: usize,
    global_batch_tokens: usize,
) -> Result<Vec<Candidate>, PlanError> {
    let req = PlanRequest {
        model: model.clone(),
        gpus,
        hardware: hardware.clone(),
        seq,
        global_batch_tokens,
    };
    Ok(plan_with(&req, &PlanOptions::default())?.candidates)
}

/// The divisors of `n` in increasing order, by trial division up to √n (a million GPUs has
/// 21 power-of-two divisors; scanning 1..=n for them took most of a 98 s plan).
fn divisors(n: usize) -> impl Iterator<Item = usize> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            low.push(d);
            if d * d != n {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.into_iter().chain(high.into_iter().rev())
}

/// Searches every layout (see the module docs) and ranks them.
pub fn plan_with(req: &PlanRequest, opts: &PlanOptions) -> Result<Plan, PlanError> {
    let space = Space::new(req, opts)?;
    let found = space.search()?;
    if found.considered == 0 {
        return Err(space.nothing_considered());
    }
    let (considered, refused, fitting) = (found.considered, found.refused, found.fitting.len());
    Ok(Plan {
        model: space.model.name.clone(),
        params: space.model.num_params(),
        gpus: req.gpus,
        hardware: req.hardware.name.clone(),
        seq: req.seq,
        global_batch_tokens: req.global_batch_tokens,
        usable_bytes: space.usable,
        considered,
        fitting,
        refused,
        candidates: choose(found, &space),
    })
}

/// The best fitting layout of each shape, best first, up to `top`, each after the first
/// with what it loses; then up to `alternatives` layouts of each kind that lost (out of
/// memory, batch not reachable) that would have been faster.
fn choose(found: Found, space: &Space<'_>) -> Vec<Candidate> {
    let Found {
        mut fitting,
        oom,
        unreachable,
        ..
    } = found;
    fitting.sort_by(order);
    // One candidate per shape: its best micro-batch, schedule and recomputation.
    let mut shapes = std::collections::HashSet::new();
    let mut out: Vec<Candidate> = fitting
        .into_iter()
        .filter(|c| shapes.insert(shape(&c.layout)))
        .take(space.opts.top.max(1))
        .collect();
    let best = out.first().map(|b| b.cost.clone());
    if let Some(best) = &best {
        for cand in out.iter_mut().skip(1) {
            cand.verdict = slower(best, &cand.cost, &cand.layout);
        }
    }
    for (list, is_oom) in [(oom, true), (unreachable, false)] {
        out.extend(alternatives(list, is_oom, best.as_ref(), space));
    }
    out
}

/// Candidates in ranking order.
fn order(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    rank_key(a).cmp(&rank_key(b))
}

/// Up to `alternatives` layouts of `list` (one per shape) that lost (out of memory when
/// `is_oom`, else batch not reachable), each with the reason. They must beat the `best`
/// fitting layout by more than the model's resolution; when nothing fits, the layouts
/// closest to fitting are the alternatives.
fn alternatives(
    mut list: Vec<Candidate>,
    is_oom: bool,
    best: Option<&StepCost>,
    space: &Space<'_>,
) -> Vec<Candidate> {
    let best_s = best.map_or(f64::INFINITY, |b| b.step_s);
    list.retain(|c| c.cost.step_s < best_s / 1.001);
    if best.is_some() {
        list.sort_by(order);
    } else {
        list.sort_by_key(|c| c.memory.total());
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for mut cand in list {
        if seen.len() >= space.opts.alternatives {
            break;
        }
        let l = &cand.layout;
        if !seen.insert(shape(l)) {
            continue;
        }
        let faster_percent = best.map(|b| (b.step_s / cand.cost.step_s - 1.0) * 100.0);
        let reachable = space.sequences.is_multiple_of(l.dp * l.micro_batch);
        let batch = format!(
            "{} sequences per step is not a multiple of dp·b = {}·{}",
            space.sequences, l.dp, l.micro_batch
        );
        cand.verdict = match (is_oom, reachable) {
            (true, true) => Verdict::OutOfMemory {
                needed: cand.memory.total(),
                available: space.usable,
                faster_percent,
            },
            // Both: named as the batch's (as the same shape's layouts that fit in memory are),
            // with the memory too.
            (true, false) => Verdict::BatchNotReachable {
                why: format!(
                    "{batch}, and out of memory ({:.1} GiB of {:.1} GiB usable)",
                    cand.memory.total() as f64 / crate::GIB,
                    space.usable as f64 / crate::GIB
                ),
                faster_percent,
            },
            (false, _) => Verdict::BatchNotReachable {
                why: batch,
                faster_percent,
            },
        };
        out.push(cand);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::divisors;

    #[test]
    fn divisors_are_every_divisor_in_order() {
        for n in [1usize, 2, 12, 36, 97, 1000, 1 << 20] {
            let slow: Vec<usize> = (1..=n).filter(|d| n % d == 0).collect();
            assert_eq!(divisors(n).collect::<Vec<_>>(), slow, "{n}");
        }
    }
}
