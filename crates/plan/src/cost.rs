//! The time of one optimizer step: compute at a calibrated fraction of the device peak, every
//! collective of the layout over the hardware's bus bandwidths minus what overlaps, and the
//! pipeline bubble.
//!
//! Per pipeline stage `i` and micro-batch: compute `t_i` = the training FLOPs of its units
//! (3 × forward, nanotron's count, plus one forward of its blocks under full recomputation)
//! ÷ (`t·c`) ÷ (peak × [`KERNEL_EFFICIENCY`]); to it are added the exposed per-micro-batch
//! communications: TP (4 all-reduces of `b·s/c·h` activations per block, 6 with full
//! recomputation; reduce-scatter + all-gather with SP, same volume; not hidden), CP ring
//! passes of K and V (once forward, twice backward; hidden behind the attention compute),
//! EP all-to-alls (dispatch and combine, forward and backward; not hidden), PP sends
//! (activation forward, gradient backward, `v` times interleaved; not hidden), and ZeRO-2's
//! reduce-scatters and ZeRO-3's gathers and reduce-scatters, simulated unit by unit against
//! the compute they overlap (the `overlap` module). With the slowest stage's `t'`, the step
//! takes `(m + (p−1)/v)·t'` (zero bubble: `m·t' + (p−1)·t'/3`, DualPipeV `m·t' + (p−1)·t'/6`)
//! plus the exposed step-end
//! synchronisation: the gradient all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1) of the last
//! micro-batch, bucket by bucket behind its backward, and the all-gather of updated weights
//! (ZeRO-1/2), not hidden; plus a fixed host time per step
//! ([`CostModel::step_overhead_s`]).
//!
//! With measured CPU kernels (`Hardware::kernels`, this engine on this machine) the
//! collectives are counted as this engine makes them: TP's per [`crate::tp_calls`] (SP's
//! backward gathers again, the norm weights' gradients, the embedding, the head and the
//! vocabulary-parallel loss's statistics), CP's gradient accumulators travelling the ring
//! behind the blocks, EP's exchange of row counts; and when the ranks' threads fill every
//! core, CP's ring passes are exposed like DP's reductions. Ranks as threads also drift
//! apart: every blocking collective (TP, CP, EP, ZeRO-2/3 per micro-batch) adds the measured
//! arrival skew of the average segment of compute between two of them, and the step's
//! gradient reduction that of the step's compute ([`crate::cpu_kernels::KernelRates::skew`]).
//!
//! A collective's time is its per-rank volume (`2(N−1)/N·K` all-reduce, `(N−1)/N·K` the
//! others) over the bus bandwidth of the number of nodes its group spans, with ranks numbered
//! TP fastest, then CP, PP, DP (node boundaries assumed aligned with the grid).

use serde::{Deserialize, Serialize};

use crate::hardware::Hardware;
use crate::job::Job;
use crate::layout::Schedule;
use crate::memory::stage_units;
use crate::PlanError;

mod stage;

use stage::{Setting, StageTime, ZERO};

/// The fraction of the device's dense peak that the kernels reach on the counted FLOPs.
/// One global constant, calibrated once against the playbook's single-node §6 cells (where
/// communication is negligible), before the host time [`MEASURED_STEP_OVERHEAD_S`] was
/// added (which costs those cells about 5% of their step, still within 2.2 points); not
/// tuned per cell. Fitted on: the 1-node cells of §6 (in-sample there); out-of-sample, a
/// refit without the 1-node cells gives 0.50, the other two folds 0.48
/// (`crates/plan/tests/calibration.rs`).
pub const KERNEL_EFFICIENCY: f64 = 0.48;

/// The fixed time per step of the system the playbook's §6 table measured (nanotron on
/// 8×H100 nodes), in seconds. Calibrated once, as the value that minimises the worst
/// error over the table's nine cells and its five given configurations (worst 4.2 points at
/// 0.11 s against 13.7 without the term); leave-one-out, each cell predicted from a value
/// fitted on the other eight stays within 5 points (`crates/plan/tests/calibration.rs`). It is
/// what separates the 64-node cells — 2048 tokens per GPU per step, so a step of a 1B model
/// is about 0.1 s of kernels — from what bandwidth, latency and bubble alone predict; at one
/// node it is about 5% of the step. Fitted on: all nine §6 cells (in-sample there); the
/// leave-one-node-count-out refits give 0.14–0.18 s (`crates/plan/tests/calibration.rs`).
pub const MEASURED_STEP_OVERHEAD_S: f64 = 0.11;

/// Parameters of the cost model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Fraction of the peak the kernels reach ([`KERNEL_EFFICIENCY`]).
    pub kernel_efficiency: f64,
    /// Time the attention kernels as working over the causal half (`true`) or the full
    /// `s × s` matrix (`false`, as the playbook's measured system did; the default). MFU's
    /// numerator does not depend on it: it always counts the full matrix
    /// ([`crate::ModelSpec::model_flops_per_token`]).
    pub causal: bool,
    /// Whether data-parallel and ZeRO communication overlaps compute (bucket by bucket,
    /// as this engine does; the default). `false` models a framework that synchronises
    /// gradients after the backward, every second exposed.
    pub overlap_dp: bool,
    /// Seconds every step costs whatever the layout: the host's work between one step's
    /// last backward and the next step's first forward (optimizer launch, gradient clipping,
    /// logging synchronisation, the next batch). 0 by default; [`MEASURED_STEP_OVERHEAD_S`]
    /// for the system the playbook measured.
    #[serde(default)]
    pub step_overhead_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            kernel_efficiency: KERNEL_EFFICIENCY,
            causal: false,
            overlap_dp: true,
            step_overhead_s: 0.0,
        }
    }
}

/// Kind of communication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommKind {
    /// Gradient synchronisation and ZeRO-1/2 weight all-gather over DP×CP.
    DataParallel,
    /// ZeRO-2/3 per-micro-batch reduce-scatters and ZeRO-3 weight all-gathers.
    Zero,
    /// Tensor-parallel all-reduces (or SP reduce-scatter/all-gather).
    TensorParallel,
    /// Pipeline sends and receives.
    Pipeline,
    /// Context-parallel ring passes of keys and values.
    Context,
    /// Expert-parallel all-to-alls.
    Expert,
}

/// Communication of one kind on the bottleneck stage's rank, per step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CommCost {
    /// Kind.
    pub kind: CommKind,
    /// Bytes this rank moves (bus volume).
    pub bytes: f64,
    /// Seconds the transfers take.
    pub seconds: f64,
    /// Seconds not hidden behind computation.
    pub exposed_s: f64,
}

/// The predicted time of one step and what it is made of.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    /// Seconds per optimizer step.
    pub step_s: f64,
    /// Compute of the bottleneck stage over the step's micro-batches.
    pub compute_s: f64,
    /// Pipeline bubble.
    pub bubble_s: f64,
    /// Exposed communication.
    pub exposed_comm_s: f64,
    /// Fixed host time per step ([`CostModel::step_overhead_s`]).
    #[serde(default)]
    pub host_s: f64,
    /// Communication per kind.
    pub comm: Vec<CommCost>,
    /// The pipeline stage setting the pace.
    pub bottleneck_stage: usize,
    /// Bubble over ideal time: `(p−1)/(v·m)`, `(p−1)/(3m)` for zero bubble.
    pub bubble_fraction: f64,
    /// Tokens per step `dp·m·b·s`.
    pub tokens_per_step: f64,
    /// Tokens per second per device.
    pub tokens_per_s_per_gpu: f64,
    /// Model FLOPs per step (no recomputation).
    pub model_flops_per_step: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// Hardware FLOPs utilisation (recomputation included).
    pub hfu: f64,
    /// Whether attention counts the causal half.
    pub causal: bool,
}

/// Nodes a process group spans: dimensions `(size, stride)` in a grid of `g` devices per node.
fn nodes_spanned(dims: &[(usize, usize)], g: usize) -> usize {
    let size: usize = dims.iter().map(|d| d.0).product();
    let per_node: usize = dims
        .iter()
        .map(|&(n, stride)| if stride >= g { 1 } else { n.min(g / stride) })
        .product();
    size.div_ceil(per_node.max(1))
}

/// Predicted time of one step of `job` on `hw`.
pub fn step_cost(job: &Job, hw: &Hardware, cm: &CostModel) -> Result<StepCost, PlanError> {
    job.validate()?;
    cm.validate()?;
    let set = Setting::new(job, hw, cm);
    let (mut recompute_flops, mut optimizer_s) = (0.0, 0.0f64);
    let stages = stage_units(&job.model, &job.layout)
        .iter()
        .map(|units| set.stage(units, &mut recompute_flops, &mut optimizer_s))
        .collect::<Result<Vec<_>, _>>()?;
    step_of(&set, &stages, recompute_flops, optimizer_s)
}

impl CostModel {
    /// Refuses an efficiency outside (0, 1] and a host time that is negative or not finite.
    fn validate(&self) -> Result<(), PlanError> {
        if !(self.kernel_efficiency > 0.0 && self.kernel_efficiency <= 1.0) {
            return Err(crate::invalid("kernel_efficiency", "must be in (0, 1]"));
        }
        if !(self.step_overhead_s >= 0.0 && self.step_overhead_s.is_finite()) {
            return Err(crate::invalid(
                "step_overhead_s",
                "must be a finite number of seconds, 0 or more",
            ));
        }
        Ok(())
    }
}

/// The step from its stages' micro-batch times: the slowest stage's `m` micro-batches, the
/// bubble, the step-end data-parallel synchronisation and the host time.
fn step_of(
    set: &Setting<'_>,
    stages: &[StageTime],
    recompute_flops: f64,
    optimizer_s: f64,
) -> Result<StepCost, PlanError> {
    let (job, hw, cm) = (set.job, set.hw, set.cm);
    let (model, l) = (&job.model, &job.layout);
    let (p, dp, cp, m) = (l.pp, l.dp, l.cp, l.grad_accum);
    let mb_time = |s: &StageTime| s.compute + s.exposed.iter().sum::<f64>();
    let (bottleneck, slow) = stages
        .iter()
        .enumerate()
        .max_by(|a, b| mb_time(a.1).total_cmp(&mb_time(b.1)))
        .ok_or_else(|| PlanError::NoLayout("no pipeline stage".into()))?;
    let dp_stage = stages
        .iter()
        .max_by(|a, b| a.dp.step_exposed.total_cmp(&b.dp.step_exposed))
        .ok_or_else(|| PlanError::NoLayout("no pipeline stage".into()))?;
    let (mf, v) = (m as f64, l.chunks() as f64);
    let t_mb = mb_time(slow);
    // ZB-H1 fills all but a forward per stage: (p−1)·F with F = t'/3 (m ≥ p), else
    // (2p−1−m)·F. DualPipeV loses one forward of a chunk (half a stage) per stage:
    // (p−1)·t'/6 (crates/schedule tests, at F = B = W).
    let bubble_s = match l.pp_schedule {
        Schedule::ZeroBubble if m >= p => (p - 1) as f64 * t_mb / 3.0,
        Schedule::ZeroBubble => (2 * p - 1 - m) as f64 * t_mb / 3.0,
        Schedule::DualPipeV => (p - 1) as f64 * t_mb / 6.0,
        _ => (p - 1) as f64 / v * t_mb,
    };
    let host_s = cm.step_overhead_s + optimizer_s;
    let compute_s = mf * slow.compute;
    // The step's gradient reduction over DP×CP waits for the last rank to finish its
    // backward (ZeRO-2/3 wait at every micro-batch's reductions and gathers: counted above).
    let dp_wait = match &hw.kernels {
        Some(k) if dp * cp > 1 && l.zero < 2 => k.skew_fraction(compute_s) * compute_s,
        _ => 0.0,
    };
    let dp_exposed = dp_stage.dp.step_exposed + dp_wait;
    let step_s = mf * t_mb + bubble_s + dp_exposed + host_s;
    let tokens = (dp * m) as f64 * set.tokens_mb;
    let model_flops = tokens * model.model_flops_per_token();
    let gpus = l.world_size() as f64;
    let denominator = gpus * hw.peak_flops() * step_s;
    Ok(StepCost {
        step_s,
        compute_s,
        bubble_s,
        exposed_comm_s: step_s - compute_s - bubble_s - host_s,
        host_s,
        comm: comm_costs(slow, dp_stage, dp_exposed, mf),
        bottleneck_stage: bottleneck,
        bubble_fraction: bubble_s / (mf * t_mb),
        tokens_per_step: tokens,
        tokens_per_s_per_gpu: tokens / step_s / gpus,
        model_flops_per_step: model_flops,
        mfu: ferrotron_config::flops::mfu(
            tokens / step_s,
            model.model_flops_per_token(),
            gpus * hw.peak_flops(),
        ),
        hfu: (model_flops + recompute_flops) / denominator,
        causal: cm.causal,
    })
}

/// Communication per kind over the step: the step-end data-parallel synchronisation of the
/// stage that exposes most of it (`dp_exposed` seconds of it not hidden), and `mf`
/// micro-batches of the slowest stage's other kinds; kinds that move nothing left out.
fn comm_costs(slow: &StageTime, dp_stage: &StageTime, dp_exposed: f64, mf: f64) -> Vec<CommCost> {
    let mut comm = vec![CommCost {
        kind: CommKind::DataParallel,
        bytes: dp_stage.dp.step_bytes,
        seconds: dp_stage.dp.step_busy,
        exposed_s: dp_exposed,
    }];
    let kinds = [
        CommKind::Zero,
        CommKind::TensorParallel,
        CommKind::Pipeline,
        CommKind::Context,
        CommKind::Expert,
    ];
    for (k, kind) in kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| (i + ZERO, kind))
    {
        comm.push(CommCost {
            kind,
            bytes: mf * slow.bytes[k],
            seconds: mf * slow.busy[k],
            exposed_s: mf * slow.exposed[k],
        });
    }
    comm.retain(|x| x.bytes > 0.0);
    comm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_span_nodes_by_stride() {
        assert_eq!(nodes_spanned(&[(8, 1)], 8), 1);
        assert_eq!(nodes_spanned(&[(16, 1)], 8), 2);
        // DP 32 with TP 4 inside: 2 DP ranks per node.
        assert_eq!(nodes_spanned(&[(1, 4), (32, 4)], 8), 16);
        assert_eq!(nodes_spanned(&[(128, 8)], 8), 128);
    }
}
