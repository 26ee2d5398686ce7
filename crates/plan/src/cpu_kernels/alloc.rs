//! The buffers a step allocates between its kernels (each zero-filled), unit by unit and for
//! the data-parallel reduction: what the cost model times at the measured `calloc` rate,
//! checked against the memory ledger's count (`crates/train/tests/alloc_vs_ledger.rs`).

use super::{unit_kernels, GemmShape};
use crate::layout::Layout;
use crate::model::{ModelSpec, Unit};

/// Elements of the buffers one micro-batch's forward of `unit` allocates on one rank, given
/// its forward GEMMs: each GEMM's output, each norm's output and statistics, attention's
/// output and log-sum-exp, SwiGLU's product, the residual sums, the sequence-parallel
/// gathers and scatters, and the head's logits chunks. Every one is zero-filled.
pub(super) fn unit_alloc(model: &ModelSpec, l: &Layout, unit: Unit, gemm: &[GemmShape]) -> f64 {
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
            let vocab = c.vocab_valid_rows(tp, 0);
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
