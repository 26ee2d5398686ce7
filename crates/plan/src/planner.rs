//! The planner: the playbook's recipe (§6) as a search. Every layout of `gpus` devices —
//! TP within a node dividing the head counts, PP up to the layer count, CP with zig-zag
//! chunks, EP dividing the experts, ZeRO 0–3 (ZeRO-3 without PP), full recomputation or none,
//! the pipeline schedules (contiguous stages split by [`crate::balanced_pp_layers`]), micro-batch
//! sizes — is (1) estimated and kept if it fits the
//! device, (2) kept if `dp · b · m` sequences make the global batch exactly, (3) ranked by
//! predicted throughput. Close alternatives that lost are reported with the reason.

use std::collections::HashMap;

use ferrotron_config::ParallelConfig;
use serde::{Deserialize, Serialize};

use crate::cost::{step_cost, CostModel};
use crate::hardware::Hardware;
use crate::job::Job;
use crate::layout::{balanced_pp_layers, Layout, Recompute, Schedule};
use crate::memory::{assemble, stage_states, ActivationModel, Assumptions, ByteRegime, StageState};
use crate::model::ModelSpec;
use crate::rank::{rank_key, shape, slower};
pub use crate::rank::{Candidate, Verdict};
use crate::{invalid, PlanError};

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
    /// Also try the interleaved and zero-bubble schedules (AFAB and 1F1B always).
    pub advanced_schedules: bool,
    /// Highest ZeRO stage tried.
    pub max_zero: u8,
    /// Only layouts this engine runs ([`Job::engine_accepts`]): no tied embeddings or ZeRO-2
    /// with pipeline parallelism, `tp` dividing the vocabulary. `true` by default; `false`
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

type ShapeKey = (usize, usize, usize, usize, usize, u8, usize);

/// Searches every layout (see the module docs) and ranks them.
pub fn plan_with(req: &PlanRequest, opts: &PlanOptions) -> Result<Plan, PlanError> {
    if req.gpus == 0 || req.gpus > 1 << 20 {
        return Err(invalid("gpus", "must be in 1..=1048576"));
    }
    if req.seq == 0
        || req.global_batch_tokens == 0
        || !req.global_batch_tokens.is_multiple_of(req.seq)
    {
        return Err(invalid(
            "global_batch_tokens",
            format!(
                "{} is not a positive multiple of seq={}",
                req.global_batch_tokens, req.seq
            ),
        ));
    }
    if !(opts.usable_memory > 0.0 && opts.usable_memory <= 1.0) {
        return Err(invalid("usable_memory", "must be in (0, 1]"));
    }
    req.hardware.validate()?;
    let mut model = req.model.clone();
    model.config.seq_len = req.seq;
    model.validate()?;
    let c = &model.config;
    let hw = &req.hardware;
    let sequences = req.global_batch_tokens / req.seq;
    let fp32_grad_accum = opts.fp32_grad_accum && hw.dtype == ferrotron_config::DType::Bf16;
    let usable = (hw.memory_bytes() as f64 * opts.usable_memory) as u64;
    let bytes = opts
        .assumptions
        .bytes
        .unwrap_or_else(|| ByteRegime::engine(hw.dtype, fp32_grad_accum));
    let recomputes: &[Recompute] = match opts.assumptions.activations {
        ActivationModel::Engine => &[Recompute::None, Recompute::Full],
        ActivationModel::Korthikanti => &[Recompute::None, Recompute::Selective, Recompute::Full],
    };
    let f = &opts.only;
    let keep = |want: Option<usize>, x: usize| want.is_none_or(|w| w == x);
    let mut states: HashMap<ShapeKey, Vec<StageState>> = HashMap::new();
    let (mut fitting, mut oom, mut unreachable) = (Vec::new(), Vec::new(), Vec::new());
    let (mut considered, mut refused) = (0, 0);
    for tp in divisors(req.gpus).filter(|&t| {
        t <= hw.gpus_per_node
            && c.heads.is_multiple_of(t)
            && c.kv_heads.is_multiple_of(t)
            && c.ffn.is_multiple_of(t)
            && (!opts.engine_only || c.vocab.is_multiple_of(t))
            && keep(f.tp, t)
    }) {
        // The engine keeps tied embeddings on one stage: no pipeline for them.
        let max_pp = if opts.engine_only && c.tie_embeddings {
            1
        } else {
            c.layers
        };
        for pp in divisors(req.gpus / tp).filter(|&p| p <= max_pp && keep(f.pp, p)) {
            let cps = divisors(req.gpus / (tp * pp))
                .filter(|&x| x == 1 || (req.seq.is_multiple_of(2 * x) && req.seq / (2 * x) >= 64));
            for cp in cps.filter(|&x| keep(f.cp, x)) {
                let dp = req.gpus / (tp * pp * cp);
                if !keep(f.dp, dp) {
                    continue;
                }
                let eps: Vec<usize> = match model.moe {
                    Some(m) => divisors(dp).filter(|e| m.experts % e == 0).collect(),
                    None => vec![1],
                };
                let max_zero = if dp * cp == 1 {
                    0
                } else if pp > 1 {
                    if opts.engine_only {
                        1
                    } else {
                        2
                    }
                } else {
                    3
                };
                for ep in eps.into_iter().filter(|&e| keep(f.ep, e)) {
                    for zero in
                        (0..=max_zero.min(opts.max_zero)).filter(|z| f.zero.is_none_or(|w| w == *z))
                    {
                        let mut schedules = vec![(Schedule::OneFOneB, 1)];
                        if pp > 1 {
                            schedules.insert(0, (Schedule::Afab, 1));
                        }
                        if pp > 1 && opts.advanced_schedules {
                            schedules.push((Schedule::ZeroBubble, 1));
                            for v in [2, 4, 8] {
                                if c.layers.is_multiple_of(pp * v) {
                                    schedules.push((Schedule::Interleaved, v));
                                }
                            }
                        }
                        schedules.retain(|s| pp == 1 || f.schedule.is_none_or(|w| w == s.0));
                        for (schedule, v) in schedules {
                            let base = Layout {
                                parallel: ParallelConfig {
                                    dp,
                                    tp,
                                    pp,
                                    cp,
                                    ep,
                                    zero,
                                    sequence_parallel: tp > 1,
                                    pp_schedule: schedule,
                                    virtual_stages: v,
                                    pp_layers: (pp > 1 && v == 1)
                                        .then(|| balanced_pp_layers(&model, pp)),
                                    ..ParallelConfig::default()
                                },
                                dtype: hw.dtype,
                                fp32_grad_accum,
                                host_matmul: hw.kernels.is_some(),
                                ..Layout::default()
                            };
                            let key = (tp, pp, cp, dp, ep, zero, v);
                            let st = states
                                .entry(key)
                                .or_insert_with(|| stage_states(&model, &base, bytes));
                            for &recompute in recomputes {
                                let mut b = 1;
                                while b <= opts.max_micro_batch.max(1) && b <= sequences {
                                    let reachable = sequences.is_multiple_of(dp * b);
                                    let m = (sequences as f64 / (dp * b) as f64).round().max(1.0)
                                        as usize;
                                    if schedule == Schedule::Interleaved && !m.is_multiple_of(pp) {
                                        b *= 2;
                                        continue;
                                    }
                                    let layout = base.clone().with(|l| {
                                        l.recompute = recompute;
                                        l.micro_batch = b;
                                        l.grad_accum = m;
                                    });
                                    let job = Job {
                                        model: model.clone(),
                                        layout,
                                    };
                                    considered += 1;
                                    if opts.engine_only && job.engine_accepts().is_err() {
                                        refused += 1;
                                        b *= 2;
                                        continue;
                                    }
                                    let est = assemble(&job, &opts.assumptions, st);
                                    let cost = step_cost(&job, hw, &opts.cost)?;
                                    let cand = Candidate {
                                        layout: job.layout,
                                        memory: est.memory,
                                        peak_stage: est.peak_stage,
                                        cost,
                                        verdict: Verdict::Best,
                                    };
                                    // Step 1, fit; step 2, reach the batch.
                                    if est.memory.total() > usable {
                                        oom.push(cand);
                                        break; // larger micro-batches need more still
                                    } else if reachable {
                                        fitting.push(cand);
                                    } else {
                                        unreachable.push(cand);
                                    }
                                    b *= 2;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    if considered == 0 {
        let engine = if opts.engine_only {
            format!(
                " (this engine's layouts only: no pipeline{}, ZeRO ≤ 1 with a pipeline, tp dividing vocab={}; --as-measured plans the playbook's system)",
                if c.tie_embeddings { ", as the embeddings are tied" } else { " with tied embeddings" },
                c.vocab
            )
        } else {
            String::new()
        };
        return Err(PlanError::NoLayout(format!(
            "no layout of {} GPUs passes the filters: tp ≤ {} dividing heads={}, kv_heads={} and ffn={}, pp ≤ {} layers{engine}",
            req.gpus, hw.gpus_per_node, c.heads, c.kv_heads, c.ffn, c.layers
        )));
    }
    let order = |a: &Candidate, b: &Candidate| rank_key(a).cmp(&rank_key(b));
    fitting.sort_by(order);
    let n_fit = fitting.len();
    // One candidate per shape: its best micro-batch, schedule and recomputation.
    let mut shapes = std::collections::HashSet::new();
    let mut out: Vec<Candidate> = fitting
        .into_iter()
        .filter(|c| shapes.insert(shape(&c.layout)))
        .take(opts.top.max(1))
        .collect();
    let best = out.first().map(|b| b.cost.clone());
    if let Some(best) = &best {
        for cand in out.iter_mut().skip(1) {
            cand.verdict = slower(best, &cand.cost, &cand.layout);
        }
    }
    let best_s = best.as_ref().map_or(f64::INFINITY, |b| b.step_s);
    for (mut list, is_oom) in [(oom, true), (unreachable, false)] {
        // Alternatives must beat the best by more than the model's resolution; when nothing
        // fits, the layouts closest to fitting are the alternatives.
        list.retain(|c| c.cost.step_s < best_s / 1.001);
        if best.is_some() {
            list.sort_by(order);
        } else {
            list.sort_by_key(|c| c.memory.total());
        }
        let mut seen = std::collections::HashSet::new();
        for mut cand in list {
            if seen.len() >= opts.alternatives {
                break;
            }
            let l = &cand.layout;
            if !seen.insert(shape(l)) {
                continue;
            }
            let faster_percent = best
                .as_ref()
                .map(|b| (b.step_s / cand.cost.step_s - 1.0) * 100.0);
            cand.verdict = if is_oom {
                Verdict::OutOfMemory {
                    needed: cand.memory.total(),
                    available: usable,
                    faster_percent,
                }
            } else {
                Verdict::BatchNotReachable {
                    why: format!(
                        "{sequences} sequences per step is not a multiple of dp·b = {}·{}",
                        l.dp, l.micro_batch
                    ),
                    faster_percent,
                }
            };
            out.push(cand);
        }
    }
    Ok(Plan {
        model: model.name.clone(),
        params: model.num_params(),
        gpus: req.gpus,
        hardware: hw.name.clone(),
        seq: req.seq,
        global_batch_tokens: req.global_batch_tokens,
        usable_bytes: usable,
        considered,
        fitting: n_fit,
        refused,
        candidates: out,
    })
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
