//! One pipeline stage's time per micro-batch: the compute of its units, then each kind of
//! communication the layout makes on it (tensor, pipeline, context and expert parallelism,
//! data parallelism and ZeRO through the `overlap` module), and the waits of ranks that
//! arrive apart at blocking collectives. The formulas are the module's parent's.

use crate::hardware::{Collective, Hardware};
use crate::job::Job;
use crate::layout::Recompute;
use crate::memory::unit_sizes;
use crate::model::Unit;
use crate::overlap::{dp_cost, DpCost, Group, Stage};
use crate::tp_calls::TpStage;
use crate::PlanError;

use super::{nodes_spanned, CostModel};

/// Index of ZeRO-2/3's per-micro-batch communication in a stage's per-kind arrays (0 is the
/// step's data-parallel synchronisation, counted once per step).
pub(super) const ZERO: usize = 1;
/// Index of tensor parallelism's collectives.
const TP: usize = 2;
/// Index of the pipeline's sends.
const PP: usize = 3;
/// Index of context parallelism's ring passes.
const CP: usize = 4;
/// Index of expert parallelism's all-to-alls.
const EP: usize = 5;

/// Per stage and micro-batch: compute seconds, and exposed seconds, busy seconds and bytes
/// per kind of communication (indexed as [`ZERO`] and its neighbours).
pub(super) struct StageTime {
    pub compute: f64,
    pub exposed: [f64; 6],
    pub busy: [f64; 6],
    pub bytes: [f64; 6],
    pub dp: DpCost,
}

/// The same quantities before the stage is complete, with the blocking collectives per
/// kind, where every rank waits for the last to arrive.
#[derive(Default)]
struct Comm {
    exposed: [f64; 6],
    busy: [f64; 6],
    bytes: [f64; 6],
    syncs: [f64; 6],
}

impl Comm {
    /// Kind `k` takes `busy` seconds for `bytes`, of which `exposed` are not hidden.
    fn put(&mut self, k: usize, exposed: f64, busy: f64, bytes: f64) {
        (self.exposed[k], self.busy[k], self.bytes[k]) = (exposed, busy, bytes);
    }
}

/// A stage's units timed: forward and backward seconds per unit, its blocks and MoE blocks.
struct Work {
    fwd: Vec<f64>,
    bwd: Vec<f64>,
    n_blocks: f64,
    n_moe: f64,
}

/// What every stage's time is computed from: the job, the hardware, the cost model and the
/// quantities derived from them once.
pub(super) struct Setting<'a> {
    pub job: &'a Job,
    pub hw: &'a Hardware,
    pub cm: &'a CostModel,
    /// Tokens of a micro-batch, and of its share on one context-parallel rank.
    pub tokens_mb: f64,
    local: f64,
    /// Bytes of an activation element.
    act: f64,
    /// Seconds per forward FLOP per token of a micro-batch on one rank (peak × efficiency).
    per_rank: f64,
    /// The measured kernels' slowdown with every rank's threads on the machine's cores.
    oversubscribed: f64,
    /// How full the cores are with compute threads (ranks × threads ÷ cores; 0 on a device).
    core_load: f64,
    dense: Group,
    expert: Group,
}

/// Bus bandwidth of collective `op` on `hw` over a group of `dims` (`(size, stride)`).
fn bus(hw: &Hardware, op: Collective, dims: &[(usize, usize)]) -> f64 {
    hw.bus_bytes_per_s(op, nodes_spanned(dims, hw.gpus_per_node))
}

/// Latency of one collective on `hw` over a group of `dims`.
fn lat(hw: &Hardware, dims: &[(usize, usize)]) -> f64 {
    hw.latency_s(nodes_spanned(dims, hw.gpus_per_node) > 1)
}

/// The bandwidths and latency of a group of `dims` on `hw`.
fn group(hw: &Hardware, dims: &[(usize, usize)]) -> Group {
    Group {
        n: dims.iter().map(|d| d.0).product::<usize>() as f64,
        all_reduce: bus(hw, Collective::AllReduce, dims),
        all_gather: bus(hw, Collective::AllGather, dims),
        reduce_scatter: bus(hw, Collective::ReduceScatter, dims),
        latency: lat(hw, dims),
    }
}

/// `(n − 1) / n`: the share of a collective's volume a rank of `n` moves.
fn frac(n: usize) -> f64 {
    (n as f64 - 1.0) / n as f64
}

impl<'a> Setting<'a> {
    /// The setting of `job` on `hw` under `cm`.
    pub fn new(job: &'a Job, hw: &'a Hardware, cm: &'a CostModel) -> Setting<'a> {
        let (c, l) = (&job.model.config, &job.layout);
        let (t, cp, p, dp, ep) = (l.tp, l.cp, l.pp, l.dp, l.ep);
        let rate = hw.peak_flops() * cm.kernel_efficiency;
        let tokens_mb = (l.micro_batch * c.seq_len) as f64;
        let kernels = hw.kernels.as_ref();
        Setting {
            job,
            hw,
            cm,
            tokens_mb,
            local: tokens_mb / cp as f64,
            act: l.dtype.size() as f64,
            per_rank: tokens_mb / (t * cp) as f64 / rate,
            oversubscribed: kernels.map_or(1.0, |k| k.oversubscription(l.world_size())),
            core_load: kernels.map_or(0.0, |k| {
                (l.world_size() * k.threads.max(1)) as f64 / k.cores.max(1) as f64
            }),
            dense: group(hw, &[(cp, t), (dp, t * cp * p)]),
            expert: group(hw, &[(cp, t), (dp / ep, t * cp * p * ep)]),
        }
    }

    /// Bus bandwidth of collective `op` over a group of `dims` (`(size, stride)`).
    fn bus(&self, op: Collective, dims: &[(usize, usize)]) -> f64 {
        bus(self.hw, op, dims)
    }

    /// Latency of one collective over a group of `dims`.
    fn lat(&self, dims: &[(usize, usize)]) -> f64 {
        lat(self.hw, dims)
    }

    /// Whether blocks are recomputed whole in backward.
    fn full(&self) -> bool {
        self.job.layout.recompute == Recompute::Full
    }

    /// The time of one micro-batch on the stage of `units`. Adds the step's recomputed FLOPs
    /// of the stage to `recompute_flops` and keeps the slowest optimizer update seen in
    /// `optimizer_s`.
    pub fn stage(
        &self,
        units: &[Unit],
        recompute_flops: &mut f64,
        optimizer_s: &mut f64,
    ) -> Result<StageTime, PlanError> {
        let w = self.work(units, recompute_flops)?;
        let compute: f64 = w.fwd.iter().chain(&w.bwd).sum();
        let mut comm = Comm::default();
        self.tensor_parallel(units, &mut comm);
        self.pipeline(&mut comm);
        self.context_parallel(&w, &mut comm);
        self.expert_parallel(&w, &mut comm);
        let elems = unit_sizes(&self.job.model, &self.job.layout, units);
        let muon = self.muon(units);
        *optimizer_s = optimizer_s.max(self.optimizer(&elems, w.n_blocks) + muon);
        let dp = self.data_parallel(&w, &elems);
        let l = &self.job.layout;
        (comm.exposed[ZERO], comm.busy[ZERO], comm.bytes[ZERO]) =
            (dp.mb_exposed, dp.mb_busy, dp.mb_bytes);
        if l.dp * l.cp > 1 {
            // ZeRO-2 reduce-scatters every micro-batch's gradients; ZeRO-3 also gathers each
            // unit's weights before its forward and its backward.
            comm.syncs[ZERO] = match l.zero {
                2 => 1.0,
                3 => 1.0 + 2.0 * units.len() as f64,
                _ => 0.0,
            };
        }
        self.skew(compute, &mut comm);
        Ok(StageTime {
            compute,
            exposed: comm.exposed,
            busy: comm.busy,
            bytes: comm.bytes,
            dp,
        })
    }

    /// Forward and backward seconds of each unit: measured kernels where the hardware has
    /// them, else FLOPs at the calibrated rate.
    fn work(&self, units: &[Unit], recompute_flops: &mut f64) -> Result<Work, PlanError> {
        let (model, l) = (&self.job.model, &self.job.layout);
        let (t, m, dp) = (l.tp, l.grad_accum, l.dp);
        let mut w = Work {
            fwd: Vec::new(),
            bwd: Vec::new(),
            n_blocks: 0.0,
            n_moe: 0.0,
        };
        for u in units {
            let f = match *u {
                Unit::Embed => 0.0,
                Unit::Head => model.head_forward_flops_per_token(),
                Unit::Block(b) => {
                    w.n_blocks += 1.0;
                    if model.is_moe_layer(b) {
                        w.n_moe += 1.0;
                    }
                    // Experts run whole on every tensor-parallel rank: `per_rank` divides by t.
                    model.layer_forward_flops_per_token(b, self.cm.causal)
                        + (t - 1) as f64 * model.moe_forward_flops_per_token(b)
                }
            };
            let again = if self.full() && matches!(u, Unit::Block(_)) {
                f
            } else {
                0.0
            };
            *recompute_flops += again * self.tokens_mb * (m * dp) as f64;
            match &self.hw.kernels {
                Some(k) => {
                    let (uf, ub) = k.unit_seconds(model, l, *u)?;
                    w.fwd.push(uf * self.oversubscribed);
                    w.bwd.push(ub * self.oversubscribed);
                }
                None => {
                    w.fwd.push(f * self.per_rank);
                    w.bwd.push((2.0 * f + again) * self.per_rank);
                }
            }
        }
        Ok(w)
    }

    /// Tensor parallelism's collectives on the stage of `units` (not hidden).
    fn tensor_parallel(&self, units: &[Unit], comm: &mut Comm) {
        let (c, l) = (&self.job.model.config, &self.job.layout);
        let t = l.tp;
        if t <= 1 {
            return;
        }
        let tp_stage = TpStage::of(l, units, self.local as usize);
        let calls = if self.hw.kernels.is_some() {
            tp_stage.engine_calls()
        } else {
            tp_stage.playbook_calls()
        };
        let v = calls.units * frac(t) * self.local * c.hidden as f64 * self.act;
        let op = if l.sequence_parallel {
            Collective::AllGather
        } else {
            Collective::AllReduce
        };
        comm.syncs[TP] = calls.activation + calls.small;
        let s = v / self.bus(op, &[(t, 1)]) + comm.syncs[TP] * self.lat(&[(t, 1)]);
        comm.put(TP, s, s, v);
    }

    /// The pipeline's sends of activations and their gradients (not hidden).
    fn pipeline(&self, comm: &mut Comm) {
        let (c, l, hw) = (&self.job.model.config, &self.job.layout, self.hw);
        let (t, cp, p, g) = (l.tp, l.cp, l.pp, hw.gpus_per_node);
        if p <= 1 {
            return;
        }
        let v = 2.0 * l.chunks() as f64 * self.local * c.hidden as f64 / t as f64 * self.act;
        let across = t * cp >= g || t * cp * p > g;
        let s = v / hw.p2p_bytes_per_s(across) + 2.0 * l.chunks() as f64 * hw.latency_s(across);
        comm.put(PP, s, s, v);
    }

    /// Context parallelism's ring passes of keys and values, hidden behind attention.
    fn context_parallel(&self, w: &Work, comm: &mut Comm) {
        let (c, l, hw) = (&self.job.model.config, &self.job.layout, self.hw);
        let (t, cp) = (l.tp, l.cp);
        if cp <= 1 {
            return;
        }
        if l.cp_kind == ferrotron_config::CpKind::Ulysses {
            return self.ulysses(w, comm);
        }
        // K and V blocks pass the ring once forward, twice backward; attention hides them.
        // This engine (`crates/parallel/src/context_parallel.rs`): forward `cp − 1` block
        // passes; backward `cp − 1` block passes and `cp` passes of the block's gradient
        // accumulator (the same size), the last one home; full recomputation repeats the
        // forward's.
        let kv = 2.0 * self.local * (c.kv_heads * c.head_dim()) as f64 / t as f64 * self.act;
        let (cf, again) = ((cp - 1) as f64, if self.full() { 1.0 } else { 0.0 });
        let passes = match hw.kernels {
            Some(_) => (2.0 + again) * cf + cp as f64,
            None => (3.0 + again) * cf,
        };
        let v = w.n_blocks * passes * kv;
        comm.syncs[CP] = w.n_blocks * passes;
        let across = nodes_spanned(&[(cp, t)], hw.gpus_per_node) > 1;
        let s = v / hw.p2p_bytes_per_s(across) + w.n_blocks * passes * hw.latency_s(across);
        let attn = 4.0 * (c.heads * c.head_dim() * c.seq_len) as f64;
        let window = w.n_blocks * passes * attn * self.per_rank;
        // Ranks as threads whose compute fills every core: the threads backend's copies
        // run on those same cores, and the gradient accumulator's chain waits on the
        // previous rank's compute, so nothing hides.
        let exposed = if self.core_load >= 1.0 {
            s
        } else {
            (s - window).max(0.0)
        };
        comm.put(CP, exposed, s, v);
    }

    /// Ulysses' all-to-alls around attention (not hidden: attention waits for its heads).
    /// Per block this engine (`crates/parallel/src/context_parallel/ulysses.rs`) sends, in
    /// f32, forward: the queries, keys, values out and the output and log-sum-exp back;
    /// backward: those and the output's gradient out again and the three gradients back; full
    /// and selective recomputation repeat the forward's. Each all-to-all moves `(cp − 1)/cp` of its tensor per rank.
    fn ulysses(&self, w: &Work, comm: &mut Comm) {
        let (c, l) = (&self.job.model.config, &self.job.layout);
        let (t, cp) = (l.tp, l.cp);
        // Key/value heads shared by several ranks go to each of them.
        let share = (cp / (c.kv_heads / t).max(1)).max(1) as f64;
        let (q, kv) = (
            (c.heads * c.head_dim()) as f64 / t as f64,
            share * (c.kv_heads * c.head_dim()) as f64 / t as f64,
        );
        let lse = c.heads as f64 / t as f64;
        let forward = (2.0 * q + 2.0 * kv + lse, 4.0 + 1.0);
        let backward = (4.0 * q + 4.0 * kv + lse, 9.0 + 1.0);
        // Full and selective recomputation both run attention's forward again in backward.
        let again = if self.job.layout.recompute == Recompute::None {
            0.0
        } else {
            1.0
        };
        let width = (1.0 + again) * forward.0 + backward.0;
        let calls = (1.0 + again) * forward.1 + backward.1;
        let v = w.n_blocks * frac(cp) * self.local * width * 4.0;
        let dims = [(cp, t)];
        comm.syncs[CP] = w.n_blocks * calls;
        let s = v / self.bus(Collective::AllToAll, &dims) + comm.syncs[CP] * self.lat(&dims);
        comm.put(CP, s, s, v);
    }

    /// Expert parallelism's all-to-alls, dispatch and combine (not hidden).
    fn expert_parallel(&self, w: &Work, comm: &mut Comm) {
        let (model, l) = (&self.job.model, &self.job.layout);
        let (t, cp, p, ep) = (l.tp, l.cp, l.pp, l.ep);
        let Some(moe) = model.moe.filter(|_| ep > 1) else {
            return;
        };
        let full = self.full();
        let n = w.n_moe * if full { 6.0 } else { 4.0 };
        let v =
            n * frac(ep) * self.local * moe.top_k as f64 * model.config.hidden as f64 * self.act;
        let dims = [(ep, t * cp * p)];
        // This engine also exchanges each expert's row count before every forward's
        // dispatch (`crates/model/src/moe/exchange.rs`): a small all-to-all, its latency.
        let counts = match self.hw.kernels {
            Some(_) => w.n_moe * if full { 2.0 } else { 1.0 },
            None => 0.0,
        };
        comm.syncs[EP] = n + counts;
        let s = v / self.bus(Collective::AllToAll, &dims) + comm.syncs[EP] * self.lat(&dims);
        comm.put(EP, s, s, v);
    }

    /// Seconds of the optimizer's update of this rank's share of the stage (ZeRO ≥ 1 updates
    /// a shard) and of the step's reduction buffers, with measured kernels; 0 without.
    fn optimizer(&self, elems: &[(u64, u64)], n_blocks: f64) -> f64 {
        let l = &self.job.layout;
        let Some(k) = &self.hw.kernels else {
            return 0.0;
        };
        let local: u64 = elems.iter().map(|e| e.0 + e.1).sum();
        let share = if l.zero >= 1 {
            (l.dp * l.cp) as f64
        } else {
            1.0
        };
        let tensors = 9.0 * n_blocks + 3.0;
        let reduction = crate::cpu_kernels::reduction_alloc_elems(
            local as f64,
            l.dp * l.cp,
            l.zero,
            l.grad_accum,
        );
        (k.optimizer_seconds(local as f64 / share, tensors) + k.alloc_seconds(4.0 * reduction))
            * self.oversubscribed
    }

    /// Seconds of Muon's step on the stage of `units` (0 under AdamW): its Newton–Schulz
    /// FLOPs at the compute rate, and its gathers of pieces and slices, not overlapped.
    fn muon(&self, units: &[Unit]) -> f64 {
        let l = &self.job.layout;
        let Some(steps) = l.muon_ns_steps else {
            return 0.0;
        };
        let blocks: Vec<usize> = units
            .iter()
            .filter_map(|u| match u {
                Unit::Block(b) => Some(*b),
                _ => None,
            })
            .collect();
        let model = &self.job.model;
        let compute = crate::muon::flops(model, l, &blocks, steps)
            / (self.hw.peak_flops() * self.cm.kernel_efficiency);
        let (dp, tp) = crate::muon::gathered_bytes(model, l, &blocks);
        let buckets = blocks.len() as f64;
        let dp_s = dp / self.dense.all_gather + buckets * self.dense.latency;
        let tp_group = [(l.tp, 1)];
        let tp_s = if l.tp > 1 {
            let calls = 7.0 * blocks.len() as f64;
            tp / self.bus(Collective::AllGather, &tp_group) + calls * self.lat(&tp_group)
        } else {
            0.0
        };
        let gathers = l.zero >= 1 && l.dp * l.cp > 1;
        compute * self.oversubscribed + if gathers { dp_s } else { 0.0 } + tp_s
    }

    /// Data parallelism's and ZeRO's communication, simulated unit by unit against the
    /// compute it overlaps (the `overlap` module).
    fn data_parallel(&self, w: &Work, elems: &[(u64, u64)]) -> DpCost {
        let l = &self.job.layout;
        let fp16 = l.dtype == ferrotron_config::DType::F16;
        dp_cost(&Stage {
            fwd: &w.fwd,
            bwd: &w.bwd,
            elems,
            dense: self.dense,
            expert: self.expert,
            // fp16 weights travel widened to f32, fp16 gradients are reduced in fp32.
            weight_bytes: if fp16 { 4.0 } else { self.act },
            grad_bytes: if l.fp32_grad_accum || fp16 {
                4.0
            } else {
                self.act
            },
            bucket_elems: ferrotron_config::bucket_elems(l.bucket_mb, l.dtype.size()) as u64,
            zero: l.zero,
            // Ranks as threads whose compute fills every core: the threads backend's
            // collectives are copies and sums on those same cores, so they add to the step
            // instead of hiding behind it.
            overlap: self.cm.overlap_dp && self.core_load < 1.0,
        })
    }

    /// Ranks arrive apart at every blocking collective (TP, CP, EP, ZeRO-2/3): the compute
    /// between two of them, a segment, takes the slowest rank's time, its measured excess
    /// over the mean ([`crate::cpu_kernels::KernelRates::skew_fraction`]). Measured kernels
    /// only.
    fn skew(&self, compute: f64, comm: &mut Comm) {
        let Some(k) = &self.hw.kernels else {
            return;
        };
        let n: f64 = comm.syncs.iter().sum();
        if n > 0.0 {
            let seg = compute / n;
            let wait = k.skew_fraction(seg) * seg;
            for (e, n) in comm.exposed.iter_mut().zip(comm.syncs) {
                *e += n * wait;
            }
        }
    }
}
