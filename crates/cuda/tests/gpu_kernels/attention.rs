//! The attention checks of the GPU check: RoPE, whole-sequence attention (the tiled kernels
//! or, with a score scratch, batched products) and ring blocks, against the CPU backend.

use super::twin::{Twin, F32};
use ferrotron_cuda::CudaOptions;
use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::rope::RopeTable;
use ferrotron_tensor::{AttnGrads, DeviceSlice, KvBlock, RingBlock};

pub(super) fn rope_attention_and_ring_blocks(tw: &mut Twin) {
    // Within one tile of 32 rows (the tiled kernels, head_dim ≤ 64), over three tiles with a
    // partial last one at the tiled kernels' widest head, and past it (one warp per row).
    for (seq, d) in [(19, 24), (75, 64), (40, 96)] {
        rope_and_attention(tw, seq, d);
    }
}

pub(super) fn rope_and_attention(tw: &mut Twin, seq: usize, d: usize) {
    let sh = AttnShape {
        batch: 2,
        seq,
        heads: 4,
        kv_heads: 2,
        head_dim: d,
    };
    let at = format!("(seq {seq}, head_dim {d})");
    let (tq, tk, rows) = (
        sh.batch * seq * sh.heads * d,
        sh.batch * seq * sh.kv_heads * d,
        sh.batch * sh.heads * seq,
    );
    let table = RopeTable::new(128, d, 10000.0);
    let positions: Vec<usize> = (0..sh.batch * seq).map(|i| (i * 7) % 128).collect();
    let q = tw.f32s(tq, 1);
    for inverse in [false, true] {
        tw.each(|be, _, s| be.rope(&mut s.f[q], &positions, sh.heads, &table, inverse));
        tw.same(&format!("rope (inverse {inverse}) {at}"), q, F32);
    }
    let (k, v, out, lse) = (tw.f32s(tk, 2), tw.f32s(tk, 3), tw.zeros(tq), tw.zeros(rows));
    tw.each(|be, _, s| {
        take!(s.f; out, lse, q, k, v);
        be.attention_forward(out, lse, q, k, v, sh)
    });
    tw.same(&format!("attention forward {at}"), out, F32);
    tw.same(&format!("attention lse {at}"), lse, F32);
    let (dout, dq, dk, dv, delta) = (
        tw.f32s(tq, 4),
        tw.zeros(tq),
        tw.zeros(tk),
        tw.zeros(tk),
        tw.zeros(rows),
    );
    tw.each(|be, _, s| {
        take!(s.f; dq, dk, dv, delta, dout, q, k, v, out, lse);
        let saved: AttnSaved<'_, DeviceSlice<f32>> = AttnSaved { q, k, v, out, lse };
        be.attention_backward(AttnGrads { dq, dk, dv }, delta, dout, saved, sh)
    });
    for (name, id) in [("dq", dq), ("dk", dk), ("dv", dv), ("delta", delta)] {
        tw.same(&format!("attention backward {name} {at}"), id, F32);
    }
    let ids = Ids {
        q,
        k,
        v,
        out,
        lse,
        dout,
        dk,
        dv,
        delta,
        sizes: (tq, rows),
    };
    ring_blocks(tw, seq, d, ids);
}

/// The buffers [`rope_and_attention`] made, for [`ring_blocks`], and (query elements, rows).
#[derive(Clone, Copy)]
struct Ids {
    q: usize,
    k: usize,
    v: usize,
    out: usize,
    lse: usize,
    dout: usize,
    dk: usize,
    dv: usize,
    delta: usize,
    sizes: (usize, usize),
}

/// Ring blocks over the buffers of [`rope_and_attention`].
fn ring_blocks(tw: &mut Twin, seq: usize, d: usize, ids: Ids) {
    let Ids {
        q,
        k,
        v,
        out,
        lse,
        dout,
        dk,
        dv,
        delta,
        sizes: (tq, rows),
    } = ids;
    let at = format!("(seq {seq}, head_dim {d})");
    let bs = BlockShape {
        batch: 2,
        q_len: seq,
        kv_len: seq,
        heads: 4,
        kv_heads: 2,
        head_dim: d,
    };
    // A ring block: this rank's queries at positions 10.. against keys at 0.., partly masked;
    // merged into a running result, then its backward. The first sequence is packed from
    // documents of 7 tokens (document masking), the second is one document.
    let (qp, kp): (Vec<usize>, Vec<usize>) = ((10..10 + seq).collect(), (0..seq).collect());
    let starts: Vec<usize> = (0..2 * seq)
        .map(|r| if r < seq { qp[r] / 7 * 7 } else { 0 })
        .collect();
    let (pout, plse) = (tw.zeros(tq), tw.zeros(rows));
    tw.each(|be, _, s| {
        take!(s.f; pout, plse, q, k, v);
        be.attention_block_forward(
            pout,
            plse,
            q,
            k,
            v,
            KvBlock {
                q_pos: &qp,
                kv_pos: &kp,
                q_start: Some(&starts),
                shape: bs,
            },
        )
    });
    tw.same(&format!("ring block forward {at}"), pout, F32);
    tw.same(&format!("ring block lse {at}"), plse, F32);
    tw.each(|be, _, s| {
        take!(s.f; out, lse, pout, plse);
        be.attention_merge(out, lse, pout, plse, bs)
    });
    tw.same(&format!("ring merge out {at}"), out, F32);
    tw.same(&format!("ring merge lse {at}"), lse, F32);
    tw.each(|be, _, s| {
        take!(s.f; delta, dout, out);
        be.attention_delta(delta, dout, out, bs)
    });
    tw.same(&format!("ring delta {at}"), delta, F32);
    let dq2 = tw.f32s(tq, 5);
    tw.each(|be, _, s| {
        take!(s.f; dq2, dk, dv, dout, q, k, v, lse, delta);
        let saved = RingBlock {
            q,
            k,
            v,
            lse,
            delta,
        };
        be.attention_block_backward(
            AttnGrads { dq: dq2, dk, dv },
            dout,
            saved,
            KvBlock {
                q_pos: &qp,
                kv_pos: &kp,
                q_start: Some(&starts),
                shape: bs,
            },
        )
    });
    for (name, id) in [("dq (accumulated)", dq2), ("dk", dk), ("dv", dv)] {
        tw.same(&format!("ring block backward {name} {at}"), id, F32);
    }
    late_block(tw, bs, ids, &at);
}

/// A block whose keys come after the first half of its queries: those rows see no key (out 0,
/// lse −∞) and add nothing to any gradient.
fn late_block(tw: &mut Twin, bs: BlockShape, ids: Ids, at: &str) {
    let Ids {
        q,
        k,
        v,
        dout,
        dk,
        dv,
        delta,
        sizes: (tq, rows),
        ..
    } = ids;
    let seq = bs.q_len;
    let (qp, kp): (Vec<usize>, Vec<usize>) =
        ((0..seq).collect(), (seq / 2..seq / 2 + seq).collect());
    let (pout, plse, dq) = (tw.zeros(tq), tw.zeros(rows), tw.f32s(tq, 6));
    tw.each(|be, _, s| {
        take!(s.f; pout, plse, q, k, v);
        be.attention_block_forward(
            pout,
            plse,
            q,
            k,
            v,
            KvBlock {
                q_pos: &qp,
                kv_pos: &kp,
                q_start: None,
                shape: bs,
            },
        )
    });
    tw.same(&format!("late block forward {at}"), pout, F32);
    tw.same(&format!("late block lse {at}"), plse, F32);
    tw.each(|be, _, s| {
        take!(s.f; delta, dout, pout);
        be.attention_delta(delta, dout, pout, bs)
    });
    tw.each(|be, _, s| {
        take!(s.f; dq, dk, dv, dout, q, k, v, plse, delta);
        let saved = RingBlock {
            q,
            k,
            v,
            lse: plse,
            delta,
        };
        be.attention_block_backward(
            AttnGrads { dq, dk, dv },
            dout,
            saved,
            KvBlock {
                q_pos: &qp,
                kv_pos: &kp,
                q_start: None,
                shape: bs,
            },
        )
    });
    for (name, id) in [("dq (accumulated)", dq), ("dk", dk), ("dv", dv)] {
        tw.same(&format!("late block backward {name} {at}"), id, F32);
    }
}

/// Attention as batched products (`train.attention = "products"`) against the CPU's flash
/// kernels: a scratch of 2 × 16 rows of the 75-position shape's scores (2 kv heads), so its
/// sequences run in chunks (32 rows forward, 16 backward), the 40-position ones in two or
/// three, and the 19-position ones in one.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn attention_as_products_on_the_gpu() {
    let options = CudaOptions {
        attention_scores: Some(4 * 2 * 16 * 2 * 75),
        ..CudaOptions::default()
    };
    let mut tw = Twin::gpu(options);
    for (seq, d) in [(19, 24), (75, 64), (40, 96)] {
        rope_and_attention(&mut tw, seq, d);
    }
}
