//! Causal grouped-query attention computed in tiles with an online softmax (flash-attention
//! style). Forward keeps only the output and the log-sum-exp of every query row; backward
//! recomputes the probabilities tile by tile, so no `s × s` matrix is ever stored: memory is
//! O(s) per head besides one tile of workspace per task.
//!
//! Layouts: `q, out: [b·s, heads·d]`, `k, v: [b·s, kv_heads·d]`, `lse: [b, heads, s]`.
//! Query head `i` reads key/value head `i / (heads / kv_heads)` (Hugging Face `repeat_kv`).

use crate::ring_attention::{attention_delta, block_backward, block_forward, BlockShape, KvBlock};

/// Shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl AttnShape {
    /// The same call as one ring block: every query against every key of its sequence.
    pub fn block(&self) -> BlockShape {
        BlockShape {
            batch: self.batch,
            q_len: self.seq,
            kv_len: self.seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

/// Forward: writes `out` and `lse`. Whole sequences are one block of the ring kernels with
/// positions `0..seq` on both sides, so the causal mask is the usual one and fully masked
/// tiles above the diagonal are skipped.
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sh: AttnShape,
) {
    let pos: Vec<usize> = (0..sh.seq).collect();
    block_forward(out, lse, q, k, v, KvBlock::causal(&pos, &pos, sh.block()));
}

/// Inputs of [`attention_backward`] saved by the forward: host slices for the kernel,
/// [`DeviceSlice`](crate::DeviceSlice)s through [`Backend`](crate::Backend).
pub struct AttnSaved<'a, S: ?Sized = [f32]> {
    /// Queries after RoPE.
    pub q: &'a S,
    /// Keys after RoPE.
    pub k: &'a S,
    /// Values.
    pub v: &'a S,
    /// Forward output.
    pub out: &'a S,
    /// Log-sum-exp per query row.
    pub lse: &'a S,
}

impl<'a> AttnSaved<'a, crate::DeviceSlice<f32>> {
    /// The same tensors as the host memory they are on the CPU backend.
    pub(crate) fn host(&self) -> AttnSaved<'a> {
        AttnSaved {
            q: self.q.host(),
            k: self.k.host(),
            v: self.v.host(),
            out: self.out.host(),
            lse: self.lse.host(),
        }
    }
}

/// Backward: overwrites `dq`, `dk`, `dv` from `dout`. `delta` is the caller's scratch for the
/// `[b, heads, s]` row terms `Δ = rowsum(dO ⊙ O)`, as many floats as `lse` (overwritten).
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    delta: &mut [f32],
    dout: &[f32],
    saved: AttnSaved<'_>,
    sh: AttnShape,
) {
    let pos: Vec<usize> = (0..sh.seq).collect();
    let bs = sh.block();
    attention_delta(delta, dout, saved.out, bs);
    dq.fill(0.0);
    let block = KvBlock::causal(&pos, &pos, bs);
    block_backward(
        dq, dk, dv, dout, saved.q, saved.k, saved.v, saved.lse, delta, block,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain softmax attention with an explicit score matrix.
    fn reference(q: &[f32], k: &[f32], v: &[f32], sh: AttnShape) -> Vec<f32> {
        let (s, d, a, akv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
        let mut out = vec![0.0; sh.batch * s * a * d];
        for b in 0..sh.batch {
            for h in 0..a {
                let hk = h / (a / akv);
                for i in 0..s {
                    let qi = &q[(b * s + i) * a * d + h * d..][..d];
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            let kj = &k[(b * s + j) * akv * d + hk * d..][..d];
                            qi.iter()
                                .zip(kj)
                                .map(|(x, y)| (*x * *y) as f64)
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                    for (j, x) in sc.iter().enumerate() {
                        let p = (x - mx).exp() / z;
                        let vj = &v[(b * s + j) * akv * d + hk * d..][..d];
                        for c in 0..d {
                            out[(b * s + i) * a * d + h * d + c] += (p * vj[c] as f64) as f32;
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn tiled_forward_matches_reference_across_tile_edges() {
        let sh = AttnShape {
            batch: 2,
            seq: 150,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let n = |c: usize, f: f32| {
            (0..sh.batch * sh.seq * c * 8)
                .map(|i| ((i as f32) * f).sin())
                .collect::<Vec<_>>()
        };
        let (q, k, v) = (n(4, 0.37), n(2, 0.71), n(2, 0.13));
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; sh.batch * sh.heads * sh.seq];
        attention_forward(&mut out, &mut lse, &q, &k, &v, sh);
        let want = reference(&q, &k, &v, sh);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
