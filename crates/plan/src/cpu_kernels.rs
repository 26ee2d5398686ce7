//! This engine's kernels on a host CPU, unit by unit: the cost model's compute term when the
//! hardware profile carries measured kernel times ([`KernelRates`], measured by `ferrotron
//! validate-cost` and `ferrotron plan --hardware cpu-local`) instead of a peak × efficiency.
//!
//! A block's forward on one rank and micro-batch is the kernels the engine calls (the
//! `ferrotron-model` block): two RMSNorms, the q/k/v, output and MLP projections (each a
//! timed GEMM of its exact shape, split by `tp`), causal attention (timed at its shape; under
//! context parallelism the rank's ring of blocks as the engine runs it), RoPE, SwiGLU and two residual
//! adds (bytes over the measured memory bandwidth), plus a fixed cost per kernel call. Its
//! backward is each projection's input and weight GEMMs, attention's backward and the
//! element-wise kernels' backward (twice their forward bytes). The head is the final norm and
//! the LM head over `loss_chunk`-token chunks (three GEMMs each, and the cross-entropy's
//! passes over the logits). Experts: `top_k` of them per token, whole on every tensor-parallel
//! rank. The optimizer (AdamW, the gradient norm, zeroing) moves 36 bytes per local parameter.
//! Between the kernels, the engine allocates each kernel's output zero-filled (one serial
//! pass, at the measured `calloc` rate): the forward's buffers, and a gradient for each in
//! the backward ([`unit_alloc_bytes`], checked against the memory ledger's count).
//! Ranks as threads share the machine's cores: when their threads outnumber the cores, every
//! compute time stretches by the ratio.

use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::model::{ModelSpec, Unit};
use crate::PlanError;

/// Which product of a linear layer `y[t×out] = x[t×in]·Wᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemmForm {
    /// `y = x·Wᵀ`.
    Forward,
    /// `dx = dy·W`.
    BackwardInput,
    /// `dW += dyᵀ·x`.
    BackwardWeight,
}

/// One GEMM of a linear layer of `t` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GemmShape {
    /// Which product.
    pub form: GemmForm,
    /// Tokens.
    pub t: usize,
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
}

impl GemmShape {
    /// `2·t·in·out`.
    pub fn flops(&self) -> f64 {
        2.0 * (self.t * self.d_in * self.d_out) as f64
    }
}

/// One causal attention call over whole sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AttnShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads (this rank's).
    pub heads: usize,
    /// Key/value heads (this rank's).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Context-parallel ranks: above 1, one rank's ring attention (its `seq/cp` queries
    /// against each of the `cp` key/value blocks of the zig-zag split, merged), whose
    /// partly masked tiles cost more than its share of the visible pairs.
    #[serde(default = "one")]
    pub cp: usize,
}

fn one() -> usize {
    1
}

/// The element-wise kernels of one dense block: two RMSNorms over `t_norm` tokens of
/// `hidden`, RoPE on `t` tokens of `heads` and `kv_heads` heads, SwiGLU over `t × ffn`, two
/// residual adds; timed together, forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockElementwise {
    /// Tokens of the norm/residual region (`t/tp` under sequence parallelism).
    pub t_norm: usize,
    /// Tokens of the attention/MLP region.
    pub t: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads (this rank's).
    pub heads: usize,
    /// Key/value heads (this rank's).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// MLP inner size (this rank's).
    pub ffn: usize,
}

/// The LM head with its cross-entropy, forward and backward, over `t` tokens in chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HeadShape {
    /// Tokens.
    pub t: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Vocabulary rows (this rank's).
    pub vocab: usize,
    /// Tokens per chunk.
    pub chunk: usize,
}

/// Measured kernel times on this machine with `threads` threads per rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelRates {
    /// Threads per rank the times were measured with.
    pub threads: usize,
    /// Cores of the machine (ranks as threads share them).
    pub cores: usize,
    /// Seconds per call of each GEMM shape.
    pub gemm: Vec<(GemmShape, f64)>,
    /// Seconds per forward and per backward call of each attention shape.
    pub attention: Vec<(AttnShape, f64, f64)>,
    /// Seconds of each dense block's element-wise kernels, forward and backward.
    #[serde(default)]
    pub elementwise: Vec<(BlockElementwise, f64, f64)>,
    /// Seconds of the LM head with its cross-entropy, forward and backward together.
    #[serde(default)]
    pub head: Vec<(HeadShape, f64)>,
    /// Memory bandwidth of element-wise kernels, bytes per second.
    pub bandwidth: f64,
    /// Fixed seconds per kernel call (dispatch to the thread pool and back).
    pub call_s: f64,
    /// Seconds a kernel call spends waking the pool's threads when they have gone to sleep
    /// (as they do between kernels separated by an allocation); 0 when not measured.
    #[serde(default)]
    pub wake_s: f64,
    /// Bytes per second of allocating a zero-filled buffer (the C allocator's `calloc` of a
    /// reused block: one serial pass); 0 when not measured (then the bandwidth).
    #[serde(default)]
    pub zero_fill: f64,
    /// The GEMM peak (FLOP/s) of this thread count: shapes not measured are timed at it
    /// (attention at a quarter of it); 0 makes a missing shape an error.
    #[serde(default)]
    pub peak_flops: f64,
}

/// What a unit's kernels need measured: its GEMM shapes and attention shapes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Needs {
    /// GEMM shapes.
    pub gemm: Vec<GemmShape>,
    /// Attention shapes.
    pub attention: Vec<AttnShape>,
    /// Dense blocks' element-wise kernels.
    pub elementwise: Vec<BlockElementwise>,
    /// LM heads.
    pub head: Vec<HeadShape>,
}

/// A unit's kernels for one micro-batch on one rank: GEMMs, attention calls, element-wise
/// bytes and the number of kernel calls, for the forward and the backward.
#[derive(Debug, Clone, Default)]
struct UnitKernels {
    gemm: Vec<GemmShape>,
    attention: Vec<AttnShape>,
    /// Element-wise bytes (forward; the backward moves twice as many).
    bytes: f64,
    /// Kernel calls (forward; the backward makes twice as many).
    calls: f64,
    /// The block's element-wise kernels, timed together (dense blocks).
    elementwise: Option<BlockElementwise>,
    /// The LM head and cross-entropy, timed together (the head).
    head: Option<HeadShape>,
    /// Elements of the buffers the forward allocates (each zero-filled; the backward
    /// allocates as many: a gradient for each).
    alloc: f64,
}

fn linears(gemms: &mut Vec<GemmShape>, t: usize, dims: &[(usize, usize)]) {
    for &(d_in, d_out) in dims {
        gemms.push(GemmShape {
            form: GemmForm::Forward,
            t,
            d_in,
            d_out,
        });
    }
}

/// The backward GEMMs of forward GEMMs: input and weight gradient of each.
fn backward(fwd: &[GemmShape]) -> Vec<GemmShape> {
    fwd.iter()
        .flat_map(|g| {
            [GemmForm::BackwardInput, GemmForm::BackwardWeight].map(|form| GemmShape { form, ..*g })
        })
        .collect()
}

fn unit_kernels(model: &ModelSpec, l: &Layout, unit: Unit) -> UnitKernels {
    let c = &model.config;
    let (tp, cp) = (l.tp.max(1), l.cp.max(1));
    let t = l.micro_batch * c.seq_len / cp;
    let sp = if l.sequence_parallel { tp } else { 1 };
    let (h, d) = (c.hidden, c.head_dim());
    let (q, kv, f) = (c.heads * d / tp, c.kv_heads * d / tp, c.ffn / tp);
    let mut k = UnitKernels::default();
    let norm_bytes = 4.0 * 2.0 * (t / sp * h) as f64;
    match unit {
        Unit::Embed => {
            k.bytes = 4.0 * 2.0 * (t / sp * h) as f64;
            k.calls = 1.0;
        }
        Unit::Head => {
            let chunk = l.loss_chunk.min(t).max(1);
            let chunks = t.div_ceil(chunk);
            let vocab = c.vocab.div_ceil(tp);
            if tp == 1 {
                // One kernel on one rank: the GEMMs and the softmax, timed together.
                k.head = Some(HeadShape {
                    t,
                    hidden: h,
                    vocab,
                    chunk,
                });
                k.bytes = norm_bytes;
                k.calls = 2.0;
            } else {
                for _ in 0..chunks {
                    linears(&mut k.gemm, chunk, &[(h, vocab)]);
                }
                // Row max, Σexp, exp and scale: about four passes over the logits.
                k.bytes = norm_bytes + 4.0 * 4.0 * (t * vocab) as f64;
                k.calls = 2.0 + 4.0 * chunks as f64;
            }
        }
        Unit::Block(b) => {
            linears(&mut k.gemm, t, &[(h, q), (h, kv), (h, kv), (q, h)]);
            k.attention.push(AttnShape {
                batch: l.micro_batch,
                seq: c.seq_len,
                heads: c.heads / tp,
                kv_heads: c.kv_heads / tp,
                head_dim: d,
                cp,
            });
            let moe = model.moe.filter(|_| model.is_moe_layer(b));
            let (mlp_tokens, mlp_f, experts) = match moe {
                None => (t, f, 1),
                Some(m) => {
                    linears(&mut k.gemm, t, &[(h, m.experts)]);
                    // Dispatch and combine: each routed token copied out and back.
                    k.bytes += 4.0 * 4.0 * (t * m.top_k * h) as f64;
                    k.calls += 4.0;
                    let local = m.experts / l.ep.max(1);
                    let per_expert = (t * m.top_k * l.ep.max(1)).div_ceil(m.experts).max(1);
                    (per_expert, c.ffn, local)
                }
            };
            for _ in 0..experts {
                linears(
                    &mut k.gemm,
                    mlp_tokens,
                    &[(h, mlp_f), (h, mlp_f), (mlp_f, h)],
                );
            }
            if moe.is_none() {
                k.elementwise = Some(BlockElementwise {
                    t_norm: t / sp,
                    t,
                    hidden: h,
                    heads: c.heads / tp,
                    kv_heads: c.kv_heads / tp,
                    head_dim: d,
                    ffn: f,
                });
                k.calls += 13.0 - 7.0;
            } else {
                let swiglu = 4.0 * 3.0 * (mlp_tokens * mlp_f * experts) as f64;
                let rope = 4.0 * 2.0 * (t * (q + kv)) as f64;
                let residual = 4.0 * 3.0 * 2.0 * (t / sp * h) as f64;
                k.bytes += 2.0 * norm_bytes + swiglu + rope + residual;
                k.calls += 13.0 + 3.0 * experts as f64;
            }
        }
    }
    k.alloc = unit_alloc(model, l, unit, &k.gemm);
    k
}

/// Elements of the buffers one micro-batch's forward of `unit` allocates on one rank, given
/// its forward GEMMs: each GEMM's output, each norm's output and statistics, attention's
/// output and log-sum-exp, SwiGLU's product, the residual sums, the sequence-parallel
/// gathers and scatters, and the head's logits chunks. Every one is zero-filled.
fn unit_alloc(model: &ModelSpec, l: &Layout, unit: Unit, gemm: &[GemmShape]) -> f64 {
    let c = &model.config;
    let (tp, cp) = (l.tp.max(1), l.cp.max(1));
    let t = l.micro_batch * c.seq_len / cp;
    let sp = if l.sequence_parallel { tp } else { 1 };
    let (h, tn) = (c.hidden, t / sp);
    let outputs: usize = gemm.iter().map(|g| g.t * g.d_out).sum();
    let norm = tn * h + tn;
    // A tensor-parallel region's collective on `t × h`, whose send copy, reduced share and
    // result the threads backend allocates: an all-reduce (copy, 1/tp share, result), or
    // under sequence parallelism an all-gather and a reduce-scatter (copy and result each).
    let tp_comm = match (tp, sp) {
        (1, _) => 0,
        (_, 1) => 2 * t * h + t * h / tp,
        _ => 2 * (t * h + tn * h),
    };
    let n = match unit {
        Unit::Embed => tn * h + tp_comm,
        Unit::Head => {
            let chunk = l.loss_chunk.min(t).max(1);
            let vocab = c.vocab.div_ceil(tp);
            norm + tp_comm + t.div_ceil(chunk) * chunk * vocab
        }
        Unit::Block(b) => {
            let heads = c.heads / tp;
            let attention = t * heads * c.head_dim() + t * heads;
            // SwiGLU's product; with experts, also the routed rows gathered for each local
            // expert and the combined output.
            let mlp = match model.moe.filter(|_| model.is_moe_layer(b)) {
                None => t * (c.ffn / tp),
                Some(m) => {
                    let local = m.experts / l.ep.max(1);
                    let per_expert = (t * m.top_k * l.ep.max(1)).div_ceil(m.experts).max(1);
                    local * per_expert * (c.ffn + h) + t * h
                }
            };
            outputs + 2 * norm + 2 * tp_comm + attention + mlp + 2 * tn * h
        }
    };
    n as f64
}

/// Bytes one micro-batch of `unit` allocates on one rank, forward and backward (the
/// backward allocates a gradient for each forward buffer: as many bytes; the head's
/// forward and backward are one call, counted in the forward; under full recomputation the
/// backward runs the forward again). f32 buffers.
pub fn unit_alloc_bytes(model: &ModelSpec, l: &Layout, unit: Unit) -> (f64, f64) {
    let k = unit_kernels(model, l, unit);
    let (ring_f, ring_b) = match unit {
        Unit::Block(_) => ring_alloc(model, l),
        _ => (0.0, 0.0),
    };
    let fwd = 4.0 * (k.alloc + ring_f);
    let bwd = match unit {
        Unit::Head => 0.0,
        Unit::Embed => 0.0,
        Unit::Block(_) if l.recompute == crate::Recompute::Full => 2.0 * fwd,
        Unit::Block(_) => fwd,
    };
    (fwd, bwd + 4.0 * ring_b)
}

/// Elements ring attention allocates beyond one device's attention, forward and backward
/// (context parallelism over `cp` ranks): a partial output and log-sum-exp; each of the
/// `cp − 1` key/value blocks passed on is a packed copy and a received buffer; the backward
/// also passes the key/value gradients' accumulator round the ring (a copy at the start,
/// each received one, and the rank's own coming home) and keeps this rank's share of them.
fn ring_alloc(model: &ModelSpec, l: &Layout) -> (f64, f64) {
    let c = &model.config;
    let (tp, cp) = (l.tp.max(1), l.cp.max(1));
    if cp == 1 {
        return (0.0, 0.0);
    }
    let t = l.micro_batch * c.seq_len / cp;
    let heads = c.heads / tp;
    let kv = t * c.kv_heads / tp * c.head_dim();
    let passes = (cp - 1) * 2 * 2 * kv;
    let fwd = t * heads * c.head_dim() + t * heads + passes;
    let bwd = 2 * kv + passes + (cp + 1) * 2 * kv;
    (fwd as f64, bwd as f64)
}

/// Elements the gradient reduction over a data-parallel group of `group` ranks (`dp·cp`)
/// allocates on one rank per step, for `local` parameters on the rank and `micro_batches`
/// micro-batches (the threads backend: each collective allocates a copy of what it sends
/// and its result, and an all-reduce its reduced share too). ZeRO-0 all-reduces the
/// gradients; ZeRO-1/2 reduce-scatter them and all-gather the updated weights; ZeRO-3 also
/// gathers each unit's weights for every micro-batch's forward and backward.
pub fn reduction_alloc_elems(local: f64, group: usize, zero: u8, micro_batches: usize) -> f64 {
    if group <= 1 {
        return 0.0;
    }
    let shard = local / group as f64;
    match zero {
        0 => 2.0 * local + shard,
        1 | 2 => 2.0 * (local + shard),
        _ => local + shard + 2.0 * micro_batches as f64 * (local + shard),
    }
}

/// The shapes a job's kernels need measured (every unit of every stage).
pub fn kernel_needs(model: &ModelSpec, l: &Layout) -> Needs {
    let mut needs = Needs::default();
    for unit in model.units() {
        let k = unit_kernels(model, l, unit);
        needs.gemm.extend(k.gemm.iter().copied());
        needs.gemm.extend(backward(&k.gemm));
        needs.attention.extend(k.attention);
        needs.elementwise.extend(k.elementwise);
        needs.head.extend(k.head);
    }
    needs.dedup();
    needs
}

impl Needs {
    /// Adds `other`'s shapes, each kept once.
    pub fn merge(&mut self, other: Needs) {
        self.gemm.extend(other.gemm);
        self.attention.extend(other.attention);
        self.elementwise.extend(other.elementwise);
        self.head.extend(other.head);
        self.dedup();
    }

    /// Each shape once, in order.
    fn dedup(&mut self) {
        self.gemm.sort();
        self.gemm.dedup();
        self.attention.sort();
        self.attention.dedup();
        self.elementwise.sort();
        self.elementwise.dedup();
        self.head.sort();
        self.head.dedup();
    }
}

/// The error of a shape with neither a measured time nor a peak to time it at.
fn missing(what: &str) -> PlanError {
    crate::invalid(
        "kernels.peak_flops",
        format!(
            "no measured time for {what} and no peak to time it at: run `ferrotron validate-cost` (or set the peak with `ferrotron bench`)"
        ),
    )
}

impl KernelRates {
    fn gemm_s(&self, g: &GemmShape) -> Result<f64, PlanError> {
        match self.gemm.iter().find(|(s, _)| s == g) {
            Some(x) => Ok(x.1),
            None if self.peak_flops > 0.0 => Ok(g.flops() / self.peak_flops),
            None => Err(missing(&format!("GEMM {g:?}"))),
        }
    }

    fn attention_s(&self, a: &AttnShape) -> Result<(f64, f64), PlanError> {
        match self.attention.iter().find(|(s, ..)| s == a) {
            Some(x) => Ok((x.1, x.2)),
            None if self.peak_flops > 0.0 => {
                // Causal: 4·d FLOPs per visible pair forward, 10·d backward; a rank of a
                // context-parallel ring computes its share of the pairs.
                let pairs = (a.batch * a.heads * a.seq * (a.seq + 1) / 2) as f64 / a.cp as f64;
                let fwd = 4.0 * a.head_dim as f64 * pairs / (0.25 * self.peak_flops);
                Ok((fwd, 2.5 * fwd))
            }
            None => Err(missing(&format!("attention {a:?}"))),
        }
    }

    /// A block's element-wise kernels: measured, or their bytes over the bandwidth.
    fn elementwise_s(&self, e: &BlockElementwise) -> (f64, f64) {
        if let Some(x) = self.elementwise.iter().find(|(s, ..)| s == e) {
            return (x.1, x.2);
        }
        let norm = 4.0 * 2.0 * 2.0 * (e.t_norm * e.hidden) as f64;
        let swiglu = 4.0 * 3.0 * (e.t * e.ffn) as f64;
        let rope = 4.0 * 2.0 * (e.t * (e.heads + e.kv_heads) * e.head_dim) as f64;
        let residual = 4.0 * 3.0 * 2.0 * (e.t_norm * e.hidden) as f64;
        let f = (norm + swiglu + rope + residual) / self.bandwidth.max(1.0) + 7.0 * self.call_s;
        (f, 2.0 * f)
    }

    /// The LM head and cross-entropy: measured, or its GEMMs at the peak and four passes
    /// over the logits.
    fn head_s(&self, hd: &HeadShape) -> Result<f64, PlanError> {
        if let Some(x) = self.head.iter().find(|(s, _)| s == hd) {
            return Ok(x.1);
        }
        if self.peak_flops <= 0.0 {
            return Err(missing(&format!("the LM head {hd:?}")));
        }
        let flops = 6.0 * (hd.t * hd.hidden * hd.vocab) as f64;
        let bytes = 16.0 * (hd.t * hd.vocab) as f64;
        Ok(flops / self.peak_flops + bytes / self.bandwidth.max(1.0))
    }

    /// How many of `needs`' shapes have no measured time (they are timed at the peak).
    pub fn missing(&self, needs: &Needs) -> usize {
        let g = needs
            .gemm
            .iter()
            .filter(|g| !self.gemm.iter().any(|(s, _)| s == *g))
            .count();
        let a = needs
            .attention
            .iter()
            .filter(|a| !self.attention.iter().any(|(s, ..)| s == *a))
            .count();
        let e = needs
            .elementwise
            .iter()
            .filter(|e| !self.elementwise.iter().any(|(s, ..)| s == *e))
            .count();
        let h = needs
            .head
            .iter()
            .filter(|h| !self.head.iter().any(|(s, _)| s == *h))
            .count();
        g + a + e + h
    }

    /// How much slower every rank computes when the ranks' threads outnumber the cores.
    pub fn oversubscription(&self, ranks: usize) -> f64 {
        let threads = (ranks * self.threads.max(1)) as f64;
        (threads / self.cores.max(1) as f64).max(1.0)
    }

    /// Seconds of one micro-batch's forward and backward of `unit` on one rank, with the
    /// forward again under full recomputation (blocks).
    pub fn unit_seconds(
        &self,
        model: &ModelSpec,
        l: &Layout,
        unit: Unit,
    ) -> Result<(f64, f64), PlanError> {
        let k = unit_kernels(model, l, unit);
        let mut fwd = k.bytes / self.bandwidth + k.calls * self.call_s;
        let mut bwd = 2.0 * (k.bytes / self.bandwidth + k.calls * self.call_s);
        for g in &k.gemm {
            fwd += self.gemm_s(g)?;
        }
        for g in backward(&k.gemm) {
            bwd += self.gemm_s(&g)?;
        }
        for a in &k.attention {
            let (f, b) = self.attention_s(a)?;
            fwd += f;
            bwd += b;
        }
        if let Some(e) = &k.elementwise {
            let (f, b) = self.elementwise_s(e);
            fwd += f;
            bwd += b;
        }
        if let Some(hd) = &k.head {
            // Forward: the logits' GEMM, a third of the head's FLOPs; backward the rest.
            let s = self.head_s(hd)?;
            fwd += s / 3.0;
            bwd += 2.0 * s / 3.0;
        }
        if l.recompute == crate::Recompute::Full && matches!(unit, Unit::Block(_)) {
            bwd += fwd;
        }
        if l.recompute == crate::Recompute::Selective && matches!(unit, Unit::Block(_)) {
            // The backward recomputes attention's output and the two normed inputs.
            for a in &k.attention {
                bwd += self.attention_s(a)?.0;
            }
            if let Some(e) = &k.elementwise {
                bwd += 2.0 * (8.0 * (e.t_norm * e.hidden) as f64 / self.bandwidth + self.call_s);
            }
        }
        // The buffers the engine allocates, zero-filled between the kernels (a serial pass
        // outside every kernel: 8% of tiny's step, 4% of small's).
        let (af, ab) = unit_alloc_bytes(model, l, unit);
        // Each parallel call wakes the pool (the backward makes twice the forward's calls).
        let calls = (k.gemm.len() + k.attention.len()) as f64
            + k.calls
            + if k.elementwise.is_some() { 7.0 } else { 0.0 }
            + if k.head.is_some() { 1.0 } else { 0.0 };
        let wake = calls * self.wake_s;
        Ok((
            fwd + self.alloc_seconds(af) + wake,
            bwd + self.alloc_seconds(ab) + 2.0 * wake,
        ))
    }

    /// Seconds of zero-filling `bytes` of newly allocated buffers.
    pub fn alloc_seconds(&self, bytes: f64) -> f64 {
        let rate = if self.zero_fill > 0.0 {
            self.zero_fill
        } else {
            self.bandwidth
        };
        bytes / rate.max(1.0)
    }

    /// Seconds of the optimizer step over `params` local parameters: AdamW (reads weight,
    /// gradient and both moments, writes three: 28 bytes), the gradient norm (4) and zeroing
    /// the gradients (4), one call per tensor.
    pub fn optimizer_seconds(&self, params: f64, tensors: f64) -> f64 {
        36.0 * params / self.bandwidth + 3.0 * tensors * self.call_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_config::ModelConfig;

    /// The enumerated GEMMs and attention are the model's forward FLOPs, unit by unit.
    #[test]
    fn the_kernels_do_the_models_flops() {
        let model = ModelSpec::dense("tiny", ModelConfig::default());
        let l = Layout {
            micro_batch: 2,
            ..Layout::default()
        };
        let c = &model.config;
        let tokens = (l.micro_batch * c.seq_len) as f64;
        let k = unit_kernels(&model, &l, Unit::Block(0));
        let gemm: f64 = k.gemm.iter().map(GemmShape::flops).sum();
        let attention = 4.0 * (c.heads * c.head_dim() * c.seq_len) as f64 * tokens;
        let want = model.layer_forward_flops_per_token(0, false) * tokens;
        assert!(
            (gemm + attention - want).abs() <= 1e-9 * want,
            "{gemm} {want}"
        );
        let head = unit_kernels(&model, &l, Unit::Head).head.unwrap();
        let logits = 2.0 * (head.t * head.hidden * head.vocab) as f64;
        let want = model.head_forward_flops_per_token() * tokens;
        assert!((logits - want).abs() <= 1e-9 * want);
        // Backward: input and weight GEMM of every forward GEMM, twice the FLOPs.
        let back: f64 = backward(&k.gemm).iter().map(GemmShape::flops).sum();
        let fwd: f64 = k.gemm.iter().map(GemmShape::flops).sum();
        assert_eq!(back, 2.0 * fwd);
    }

    /// Synthetic times: every GEMM at 1 GFLOP/s exactly, attention 1 ms / 2 ms, the block's
    /// element-wise kernels 0.5 ms / 1 ms, 1 GB/s, 1 µs per call. A block's forward is then
    /// its GEMM FLOPs / 1e9 + 1.5 ms + its bytes / 1e9 + its calls × 1 µs + its allocations at
    /// 2 GB/s (the backward allocates as much again), and full recomputation adds the forward
    /// to the backward.
    #[test]
    fn a_unit_is_the_sum_of_its_kernels() {
        let model = ModelSpec::dense("tiny", ModelConfig::default());
        let l = Layout::default();
        let needs = kernel_needs(&model, &l);
        let rates = KernelRates {
            threads: 1,
            cores: 2,
            gemm: needs.gemm.iter().map(|g| (*g, g.flops() / 1e9)).collect(),
            attention: needs.attention.iter().map(|a| (*a, 1e-3, 2e-3)).collect(),
            elementwise: needs.elementwise.iter().map(|e| (*e, 5e-4, 1e-3)).collect(),
            head: needs.head.iter().map(|h| (*h, 3e-3)).collect(),
            bandwidth: 1e9,
            call_s: 1e-6,
            wake_s: 0.0,
            zero_fill: 2e9,
            peak_flops: 0.0,
        };
        assert_eq!(rates.missing(&needs), 0);
        let k = unit_kernels(&model, &l, Unit::Block(0));
        let gemm: f64 = k.gemm.iter().map(GemmShape::flops).sum();
        let (f, b) = rates.unit_seconds(&model, &l, Unit::Block(0)).unwrap();
        // Allocations at 2 GB/s: the forward's buffers, and as many again in the backward.
        let alloc = 4.0 * k.alloc / 2e9;
        let want_f = gemm / 1e9 + 1e-3 + 5e-4 + k.bytes / 1e9 + k.calls * 1e-6 + alloc;
        let want_b =
            2.0 * gemm / 1e9 + 2e-3 + 1e-3 + 2.0 * (k.bytes / 1e9 + k.calls * 1e-6) + alloc;
        assert!(
            (f - want_f).abs() < 1e-12 && (b - want_b).abs() < 1e-12,
            "{f} {b}"
        );
        let full = Layout {
            parallel: ferrotron_config::ParallelConfig {
                recompute: crate::Recompute::Full,
                ..Default::default()
            },
            ..Layout::default()
        };
        let (f2, b2) = rates.unit_seconds(&model, &full, Unit::Block(0)).unwrap();
        // Full recomputation: the backward runs the forward again, allocations included.
        assert!((f2 - f).abs() < 1e-15 && (b2 - (b + f)).abs() < 1e-12);
        // Selective: attention's forward (1 ms) and the two norms (8 bytes per element of
        // t × hidden each at 1 GB/s, one call each) again.
        let selective = Layout {
            parallel: ferrotron_config::ParallelConfig {
                recompute: crate::Recompute::Selective,
                ..Default::default()
            },
            ..Layout::default()
        };
        let (f3, b3) = rates
            .unit_seconds(&model, &selective, Unit::Block(0))
            .unwrap();
        let e = k.elementwise.unwrap();
        let norms = 2.0 * (8.0 * (e.t_norm * e.hidden) as f64 / 1e9 + 1e-6);
        assert!((f3 - f).abs() < 1e-15 && (b3 - (b + 1e-3 + norms)).abs() < 1e-12);
        // Without a time or a peak, a shape is an error; with a peak, it is timed at it.
        let mut bare = rates.clone();
        bare.gemm.clear();
        assert!(bare.unit_seconds(&model, &l, Unit::Block(0)).is_err());
        bare.peak_flops = 1e9;
        assert!((bare.unit_seconds(&model, &l, Unit::Block(0)).unwrap().0 - f).abs() < 1e-12);
        // Four single-thread ranks on two cores compute at half speed.
        assert_eq!(rates.oversubscription(4), 2.0);
        assert_eq!(rates.oversubscription(2), 1.0);
    }
}
