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
//! compute time stretches by the ratio. They also drift apart: at every blocking collective
//! the segment of compute since the last one takes the slowest rank's time, its measured
//! excess over the mean ([`KernelRates::skew`], applied by the step model: per stage in
//! `cost/stage.rs`, to the step's gradient reduction in `cost.rs`).

use serde::{Deserialize, Serialize};

use crate::layout::Layout;

mod alloc;
mod mean;
mod shapes;

use crate::model::{ModelSpec, Unit};
use crate::PlanError;
use alloc::unit_alloc;
pub use alloc::{reduction_alloc_elems, unit_alloc_bytes};
pub use shapes::{AttnShape, BlockElementwise, GemmForm, GemmShape, HeadShape, Needs};

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
    /// The ranks' arrival skew at a blocking collective: `(segment seconds, fraction)`,
    /// ascending, where the fraction is how much longer than the ranks' mean a segment of
    /// that length takes until the last rank finishes it (measured with the ranks running
    /// the same GEMMs from a common start). Empty for one rank, or not measured.
    #[serde(default)]
    pub skew: Vec<(f64, f64)>,
    /// The GEMM peak (FLOP/s) of this thread count: shapes not measured are timed at it
    /// (attention at a quarter of it); 0 makes a missing shape an error.
    #[serde(default)]
    pub peak_flops: f64,
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

/// One rank's sizes of a unit's kernels under a layout.
struct UnitDims {
    /// Tokens of a micro-batch on the rank (`b·s/cp`).
    t: usize,
    /// The sequence-parallel split of the norms' rows (`tp` with SP, else 1).
    sp: usize,
    tp: usize,
    cp: usize,
    hidden: usize,
    head_dim: usize,
    /// Query, key/value and MLP widths on the rank (split by `tp`).
    q: usize,
    kv: usize,
    ffn: usize,
}

impl UnitDims {
    fn of(model: &ModelSpec, l: &Layout) -> UnitDims {
        let c = &model.config;
        let (tp, cp) = (l.tp.max(1), l.cp.max(1));
        let d = c.head_dim();
        UnitDims {
            t: l.micro_batch * c.seq_len / cp,
            sp: if l.sequence_parallel { tp } else { 1 },
            tp,
            cp,
            hidden: c.hidden,
            head_dim: d,
            q: c.heads * d / tp,
            kv: c.kv_heads * d / tp,
            ffn: c.ffn / tp,
        }
    }
    /// Bytes one norm reads and writes: its rows of the residual stream, in and out.
    fn norm_bytes(&self) -> f64 {
        4.0 * 2.0 * (self.t / self.sp * self.hidden) as f64
    }
}

fn unit_kernels(model: &ModelSpec, l: &Layout, unit: Unit) -> UnitKernels {
    let dims = UnitDims::of(model, l);
    let mut k = match unit {
        Unit::Embed => UnitKernels {
            bytes: dims.norm_bytes(),
            calls: 1.0,
            ..UnitKernels::default()
        },
        Unit::Head => head_kernels(model, l, &dims),
        Unit::Block(b) => block_kernels(model, l, &dims, b),
    };
    k.alloc = unit_alloc(model, l, unit, &k.gemm);
    k
}

/// The final norm and the LM head with its cross-entropy.
fn head_kernels(model: &ModelSpec, l: &Layout, dims: &UnitDims) -> UnitKernels {
    let mut k = UnitKernels::default();
    let (t, h) = (dims.t, dims.hidden);
    let chunk = l.loss_chunk.min(t).max(1);
    let chunks = t.div_ceil(chunk);
    let vocab = model.config.vocab_valid_rows(dims.tp, 0);
    if dims.tp == 1 {
        // One kernel on one rank: the GEMMs and the softmax, timed together.
        k.head = Some(HeadShape {
            t,
            hidden: h,
            vocab,
            chunk,
        });
        k.bytes = dims.norm_bytes();
        k.calls = 2.0;
    } else {
        for _ in 0..chunks {
            linears(&mut k.gemm, chunk, &[(h, vocab)]);
        }
        // Row max, Σexp, exp and scale: about four passes over the logits.
        k.bytes = dims.norm_bytes() + 4.0 * 4.0 * (t * vocab) as f64;
        k.calls = 2.0 + 4.0 * chunks as f64;
    }
    k
}

/// A transformer block `b`: its projections, attention, MLP (or experts) and element-wise
/// kernels.
fn block_kernels(model: &ModelSpec, l: &Layout, dims: &UnitDims, b: usize) -> UnitKernels {
    let c = &model.config;
    let mut k = UnitKernels::default();
    let (t, h, tp) = (dims.t, dims.hidden, dims.tp);
    let (q, kv) = (dims.q, dims.kv);
    linears(&mut k.gemm, t, &[(h, q), (h, kv), (h, kv), (q, h)]);
    k.attention.push(AttnShape {
        batch: l.micro_batch,
        seq: c.seq_len,
        heads: c.heads / tp,
        kv_heads: c.kv_heads / tp,
        head_dim: dims.head_dim,
        cp: dims.cp,
    });
    let moe = model.moe.filter(|_| model.is_moe_layer(b));
    let (mlp_tokens, mlp_f, experts) = match moe {
        None => (t, dims.ffn, 1),
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
    // The element-wise kernels, timed as the engine's block runs them. Under MoE, SwiGLU
    // runs over the routed rows of every local expert (`top_k` rows per token, rounded up per
    // expert): the same elements as one SwiGLU `t` rows long and `ffn · rows / t` wide.
    let ffn = (mlp_tokens * mlp_f * experts).div_ceil(t.max(1));
    k.elementwise = Some(BlockElementwise {
        t_norm: t / dims.sp,
        t,
        hidden: h,
        heads: c.heads / tp,
        kv_heads: c.kv_heads / tp,
        head_dim: dims.head_dim,
        ffn,
    });
    // Calls beyond the 7 timed with the element-wise kernels: 6 of the block's, and per
    // extra expert its SwiGLU's three (forward, recompute, backward).
    k.calls += 6.0 + 3.0 * experts.saturating_sub(1) as f64;
    k
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

    /// The arrival skew's fraction for segments of `seg_s` seconds between blocking
    /// collectives: interpolated in the logarithm of the length between the measured
    /// lengths, the nearest one's beyond them; 0 when not measured.
    /// A table that is not strictly ascending in positive lengths with finite fractions, or
    /// a length that is not a positive number, gives 0.
    pub fn skew_fraction(&self, seg_s: f64) -> f64 {
        let s = &self.skew;
        let usable =
            s.iter().all(|p| p.0 > 0.0 && p.1.is_finite()) && s.windows(2).all(|w| w[0].0 < w[1].0);
        if !(usable && seg_s > 0.0 && seg_s.is_finite()) {
            return 0.0;
        }
        let (Some(first), Some(last)) = (s.first(), s.last()) else {
            return 0.0;
        };
        if seg_s <= first.0 {
            return first.1;
        }
        if seg_s >= last.0 {
            return last.1;
        }
        let i = s.partition_point(|p| p.0 <= seg_s).clamp(1, s.len() - 1);
        let ((x0, y0), (x1, y1)) = (s[i - 1], s[i]);
        let w = (seg_s.ln() - x0.ln()) / (x1.ln() - x0.ln());
        y0 + w * (y1 - y0)
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
mod tests;
