//! The planner's search: the request checked, every point of the grid (tensor, pipeline,
//! context, data and expert degrees, ZeRO stage), its schedules, recomputations and
//! micro-batch sizes, each estimated and costed, and sorted by outcome.

use std::collections::HashMap;

use ferrotron_config::{CpKind, ParallelConfig};

use super::{divisors, PlanOptions, PlanRequest};
use crate::cost::step_cost;
use crate::job::Job;
use crate::layout::{balanced_pp_layers, balanced_v_layers, Layout, Recompute, Schedule};
use crate::memory::{assemble, stage_states, ActivationModel, ByteRegime, StageState};
use crate::model::ModelSpec;
use crate::rank::{Candidate, Verdict};
use crate::{invalid, PlanError};

/// The layouts whose stages hold the same memory: `(tp, pp, cp, dp, ep, zero, v, ulysses)`.
type ShapeKey = (usize, usize, usize, usize, usize, u8, usize, bool);

/// A point of the grid: the parallel degrees and the ZeRO stage.
#[derive(Debug, Clone, Copy)]
struct Grid {
    tp: usize,
    pp: usize,
    cp: usize,
    dp: usize,
    ep: usize,
    zero: u8,
}

/// The layouts evaluated, by outcome, in the order the search met them.
#[derive(Default)]
pub(super) struct Found {
    /// Fit the device and make the global batch exactly.
    pub fitting: Vec<Candidate>,
    /// Do not fit the device.
    pub oom: Vec<Candidate>,
    /// Fit, but `dp · b` does not divide the sequences of a step.
    pub unreachable: Vec<Candidate>,
    /// Layouts evaluated.
    pub considered: usize,
    /// Layouts the engine's validation refused.
    pub refused: usize,
}

/// What the search runs over: the request with its model at the request's sequence length,
/// and what follows from the options.
pub(super) struct Space<'a> {
    pub req: &'a PlanRequest,
    pub opts: &'a PlanOptions,
    /// The model, `seq_len` set to the request's.
    pub model: ModelSpec,
    /// Sequences per optimizer step.
    pub sequences: usize,
    /// Bytes of a device a step may use.
    pub usable: u64,
    fp32_grad_accum: bool,
    bytes: ByteRegime,
}

/// Whether a dimension fixed to `want` (or not fixed) admits `x`.
fn keep<T: PartialEq>(want: Option<T>, x: T) -> bool {
    want.is_none_or(|w| w == x)
}

impl<'a> Space<'a> {
    /// The search of `req` under `opts`, refusing a request it cannot plan.
    pub fn new(req: &'a PlanRequest, opts: &'a PlanOptions) -> Result<Space<'a>, PlanError> {
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
        let hw = &req.hardware;
        hw.validate()?;
        let mut model = req.model.clone();
        model.config.seq_len = req.seq;
        model.validate()?;
        let fp32_grad_accum = opts.fp32_grad_accum && hw.dtype == ferrotron_config::DType::Bf16;
        let bytes = opts
            .assumptions
            .bytes
            .unwrap_or_else(|| ByteRegime::engine(hw.dtype, fp32_grad_accum));
        Ok(Space {
            req,
            opts,
            model,
            sequences: req.global_batch_tokens / req.seq,
            usable: (hw.memory_bytes() as f64 * opts.usable_memory) as u64,
            fp32_grad_accum,
            bytes,
        })
    }

    /// Every layout of the space, evaluated.
    pub fn search(&self) -> Result<Found, PlanError> {
        let mut states: HashMap<ShapeKey, Vec<StageState>> = HashMap::new();
        let mut found = Found::default();
        for g in self.grid() {
            for (schedule, v) in self.schedules(g.pp) {
                for kind in self.cp_kinds(g) {
                    let mut base = self.base(g, schedule, v);
                    base.parallel.cp_kind = kind;
                    let ulysses = kind == CpKind::Ulysses;
                    let key = (g.tp, g.pp, g.cp, g.dp, g.ep, g.zero, v, ulysses);
                    let st = states
                        .entry(key)
                        .or_insert_with(|| stage_states(&self.model, &base, self.bytes));
                    for &recompute in self.recomputes() {
                        self.micro_batches(&base, st, recompute, &mut found)?;
                    }
                }
            }
        }
        Ok(found)
    }

    /// How context parallelism may run at grid point `g`: the ring, and Ulysses where each
    /// tensor-parallel rank's heads divide over `cp` and its key/value heads divide over it
    /// or are shared.
    fn cp_kinds(&self, g: Grid) -> Vec<CpKind> {
        let c = &self.model.config;
        let kv = c.kv_heads / g.tp;
        let kv_ok = kv.is_multiple_of(g.cp) || g.cp.is_multiple_of(kv);
        if g.cp > 1 && (c.heads / g.tp).is_multiple_of(g.cp) && kv_ok {
            vec![CpKind::Ring, CpKind::Ulysses]
        } else {
            vec![CpKind::Ring]
        }
    }

    /// The recomputation policies the activation model knows.
    fn recomputes(&self) -> &'static [Recompute] {
        match self.opts.assumptions.activations {
            ActivationModel::Engine => &[Recompute::None, Recompute::Full],
            ActivationModel::Korthikanti => {
                &[Recompute::None, Recompute::Selective, Recompute::Full]
            }
        }
    }

    /// Every point of the grid the filters and the model admit, tensor degree outermost.
    fn grid(&self) -> Vec<Grid> {
        let (gpus, f, c) = (self.req.gpus, &self.opts.only, &self.model.config);
        // The engine keeps tied embeddings on one rank: a pipeline only under DualPipeV.
        let max_pp = if self.opts.engine_only && c.tie_embeddings && !self.opts.advanced_schedules {
            1
        } else {
            c.layers
        };
        let mut out = Vec::new();
        for tp in self.tensor_degrees() {
            for pp in divisors(gpus / tp).filter(|&p| p <= max_pp && keep(f.pp, p)) {
                for cp in self.context_degrees(gpus / (tp * pp)) {
                    let dp = gpus / (tp * pp * cp);
                    if !keep(f.dp, dp) {
                        continue;
                    }
                    for ep in self.expert_degrees(dp) {
                        let top = self.max_zero(dp * cp, pp).min(self.opts.max_zero);
                        for zero in (0..=top).filter(|&z| keep(f.zero, z)) {
                            out.push(Grid {
                                tp,
                                pp,
                                cp,
                                dp,
                                ep,
                                zero,
                            });
                        }
                    }
                }
            }
        }
        out
    }

    /// Tensor degrees: within a node, dividing the head counts and the MLP width (the
    /// vocabulary is padded).
    fn tensor_degrees(&self) -> Vec<usize> {
        let (c, hw) = (&self.model.config, &self.req.hardware);
        divisors(self.req.gpus)
            .filter(|&t| {
                t <= hw.gpus_per_node
                    && c.heads.is_multiple_of(t)
                    && c.kv_heads.is_multiple_of(t)
                    && c.ffn.is_multiple_of(t)
                    && keep(self.opts.only.tp, t)
            })
            .collect()
    }

    /// Context degrees dividing `n`: zig-zag chunks of at least 64 tokens.
    fn context_degrees(&self, n: usize) -> Vec<usize> {
        let seq = self.req.seq;
        // Token dropping counts a micro-batch's tokens where they are routed: no CP with it.
        let capped = self.model.config.moe_capacity_factor.is_some();
        divisors(n)
            .filter(|&x| x == 1 || !capped)
            .filter(|&x| x == 1 || (seq.is_multiple_of(2 * x) && seq / (2 * x) >= 64))
            .filter(|&x| keep(self.opts.only.cp, x))
            .collect()
    }

    /// Expert degrees dividing `dp` and the expert count (1 for a dense model).
    fn expert_degrees(&self, dp: usize) -> Vec<usize> {
        let eps: Vec<usize> = match self.model.moe {
            Some(m) => divisors(dp).filter(|e| m.experts % e == 0).collect(),
            None => vec![1],
        };
        eps.into_iter()
            .filter(|&e| keep(self.opts.only.ep, e))
            .collect()
    }

    /// The highest ZeRO stage for `shards` data-parallel ranks and `pp` stages: none without
    /// data parallelism, ZeRO-3 only without a pipeline (this engine: ZeRO-1 with one).
    fn max_zero(&self, shards: usize, pp: usize) -> u8 {
        if shards == 1 {
            0
        } else if pp > 1 {
            if self.opts.engine_only {
                1
            } else {
                2
            }
        } else {
            3
        }
    }

    /// The schedules (and virtual stages) tried for `pp` stages.
    fn schedules(&self, pp: usize) -> Vec<(Schedule, usize)> {
        let c = &self.model.config;
        let mut schedules = vec![(Schedule::OneFOneB, 1)];
        if pp > 1 {
            schedules.insert(0, (Schedule::Afab, 1));
        }
        if pp > 1 && self.opts.advanced_schedules {
            schedules.push((Schedule::ZeroBubble, 1));
            if c.layers.is_multiple_of(2 * pp) {
                schedules.push((Schedule::DualPipeV, 1));
            }
            for v in [2, 4, 8] {
                if c.layers.is_multiple_of(pp * v) {
                    schedules.push((Schedule::Interleaved, v));
                }
            }
        }
        schedules.retain(|s| pp == 1 || keep(self.opts.only.schedule, s.0));
        if pp > 1 && c.tie_embeddings && self.opts.engine_only {
            schedules.retain(|s| s.0 == Schedule::DualPipeV);
        }
        schedules
    }

    /// The layout of grid point `g` with `schedule` over `v` virtual stages, before its
    /// recomputation and micro-batches are chosen.
    fn base(&self, g: Grid, schedule: Schedule, v: usize) -> Layout {
        let hw = &self.req.hardware;
        Layout {
            parallel: ParallelConfig {
                dp: g.dp,
                tp: g.tp,
                pp: g.pp,
                cp: g.cp,
                ep: g.ep,
                zero: g.zero,
                sequence_parallel: g.tp > 1,
                pp_schedule: schedule,
                virtual_stages: v,
                pp_layers: match schedule {
                    _ if g.pp < 2 => None,
                    Schedule::DualPipeV => balanced_v_layers(&self.model, g.pp),
                    _ if v == 1 => Some(balanced_pp_layers(&self.model, g.pp)),
                    _ => None,
                },
                ..ParallelConfig::default()
            },
            dtype: hw.dtype,
            fp32_grad_accum: self.fp32_grad_accum,
            host_matmul: hw.kernels.is_some(),
            // The threads per rank the measured kernel times assume: `train` runs what the
            // plan predicted (its overrides carry `train.threads`).
            threads: hw.kernels.as_ref().map_or(0, |k| k.threads),
            ..Layout::default()
        }
    }

    /// `base` under `recompute` with micro-batches of 1, 2, 4, … sequences: each estimated
    /// (`st`, its stages' memory) and costed, and filed by outcome, until one does not fit.
    fn micro_batches(
        &self,
        base: &Layout,
        st: &[StageState],
        recompute: Recompute,
        found: &mut Found,
    ) -> Result<(), PlanError> {
        let (opts, sequences, dp) = (self.opts, self.sequences, base.dp);
        let mut b = 1;
        while b <= opts.max_micro_batch.max(1) && b <= sequences {
            let reachable = sequences.is_multiple_of(dp * b);
            let m = (sequences as f64 / (dp * b) as f64).round().max(1.0) as usize;
            let refused = match base.pp_schedule {
                Schedule::Interleaved => !m.is_multiple_of(base.pp),
                Schedule::DualPipeV => m < 2 * base.pp,
                _ => false,
            };
            if refused {
                b *= 2;
                continue;
            }
            let layout = base.clone().with(|l| {
                l.recompute = recompute;
                l.micro_batch = b;
                l.grad_accum = m;
            });
            let job = Job {
                model: self.model.clone(),
                layout,
            };
            found.considered += 1;
            if opts.engine_only && job.engine_accepts().is_err() {
                found.refused += 1;
                b *= 2;
                continue;
            }
            let est = assemble(&job, &opts.assumptions, st);
            let cost = step_cost(&job, &self.req.hardware, &opts.cost)?;
            let cand = Candidate {
                layout: job.layout,
                memory: est.memory,
                peak_stage: est.peak_stage,
                cost,
                verdict: Verdict::Best,
            };
            // Step 1, fit; step 2, reach the batch.
            if est.memory.total() > self.usable {
                found.oom.push(cand);
                break; // larger micro-batches need more still
            } else if reachable {
                found.fitting.push(cand);
            } else {
                found.unreachable.push(cand);
            }
            b *= 2;
        }
        Ok(())
    }

    /// The error when no layout passed the filters, naming them.
    pub fn nothing_considered(&self) -> PlanError {
        let (c, hw) = (&self.model.config, &self.req.hardware);
        let engine = if self.opts.engine_only {
            " (this engine's layouts only: tied embeddings pipelined only under DualPipeV, ZeRO ≤ 1 with a pipeline; --as-measured plans the playbook's system)"
                .to_string()
        } else {
            String::new()
        };
        PlanError::NoLayout(format!(
            "no layout of {} GPUs passes the filters: tp ≤ {} dividing heads={}, kv_heads={} and ffn={}, pp ≤ {} layers{engine}",
            self.req.gpus, hw.gpus_per_node, c.heads, c.kv_heads, c.ffn, c.layers
        ))
    }
}
