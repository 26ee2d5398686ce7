//! Causal grouped-query attention computed in tiles with an online softmax (flash-attention
//! style). Forward keeps only the output and the log-sum-exp of every query row; backward
//! recomputes the probabilities tile by tile, so no `s × s` matrix is ever stored: memory is
//! O(s) per head besides one tile of workspace per task.
//!
//! Layouts: `q, out: [b·s, heads·d]`, `k, v: [b·s, kv_heads·d]`, `lse: [b, heads, s]`.
//! Query head `i` reads key/value head `i / (heads / kv_heads)` (Hugging Face `repeat_kv`).

use rayon::prelude::*;

use crate::linear::{matmul, Mat, Threads};
use crate::shared::Shared;

/// Query rows per tile.
const BR: usize = 64;
/// Key columns per tile.
const BC: usize = 64;

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
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// Forward: writes `out` and `lse`.
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sh: AttnShape,
) {
    let (s, d, a, akv) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads);
    let (qld, kld) = (a * d, akv * d);
    let out_len = out.len();
    let lse_len = lse.len();
    let out_ptr = Shared(out.as_mut_ptr());
    let lse_ptr = Shared(lse.as_mut_ptr());
    let scale = sh.scale();
    (0..sh.batch * a).into_par_iter().for_each(|task| {
        let (bi, hq) = (task / a, task % a);
        let hk = hq / sh.group();
        // SAFETY: this task writes only rows of batch `bi`, columns of head `hq`.
        let out = unsafe { out_ptr.slice(out_len) };
        let lse = unsafe { lse_ptr.slice(lse_len) };
        let qb = &q[bi * s * qld + hq * d..];
        let kb = &k[bi * s * kld + hk * d..];
        let vb = &v[bi * s * kld + hk * d..];
        let mut scores = vec![0.0f32; BR * BC];
        let mut acc = vec![0.0f32; BR * d];
        let mut row_max = [0.0f32; BR];
        let mut row_sum = [0.0f32; BR];
        for r0 in (0..s).step_by(BR) {
            let br = BR.min(s - r0);
            acc[..br * d].fill(0.0);
            row_max[..br].fill(f32::NEG_INFINITY);
            row_sum[..br].fill(0.0);
            for c0 in (0..r0 + br).step_by(BC) {
                let bc = BC.min(s - c0);
                matmul(
                    br,
                    bc,
                    d,
                    &mut scores,
                    Mat::rows(BC),
                    false,
                    &qb[r0 * qld..],
                    Mat::rows(qld),
                    &kb[c0 * kld..],
                    Mat::transposed(kld),
                    Threads::Single,
                );
                for i in 0..br {
                    let row = &mut scores[i * BC..i * BC + bc];
                    let limit = (r0 + i + 1).saturating_sub(c0).min(bc); // keys ≤ query
                    let mut mx = row_max[i];
                    for z in row[..limit].iter_mut() {
                        *z *= scale;
                        mx = mx.max(*z);
                    }
                    let alpha = (row_max[i] - mx).exp();
                    let mut sum = 0.0;
                    for z in row[..limit].iter_mut() {
                        *z = (*z - mx).exp();
                        sum += *z;
                    }
                    row[limit..].fill(0.0);
                    row_sum[i] = row_sum[i] * alpha + sum;
                    row_max[i] = mx;
                    acc[i * d..(i + 1) * d].iter_mut().for_each(|o| *o *= alpha);
                }
                matmul(
                    br,
                    d,
                    bc,
                    &mut acc,
                    Mat::rows(d),
                    true,
                    &scores,
                    Mat::rows(BC),
                    &vb[c0 * kld..],
                    Mat::rows(kld),
                    Threads::Single,
                );
            }
            for i in 0..br {
                let row = bi * s * qld + (r0 + i) * qld + hq * d;
                let inv = 1.0 / row_sum[i];
                for (o, a) in out[row..row + d].iter_mut().zip(&acc[i * d..(i + 1) * d]) {
                    *o = a * inv;
                }
                lse[(bi * a + hq) * s + r0 + i] = row_max[i] + row_sum[i].ln();
            }
        }
    });
}

/// Inputs of [`attention_backward`] saved by the forward.
pub struct AttnSaved<'a> {
    /// Queries after RoPE.
    pub q: &'a [f32],
    /// Keys after RoPE.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Forward output.
    pub out: &'a [f32],
    /// Log-sum-exp per query row.
    pub lse: &'a [f32],
}

/// Backward: overwrites `dq`, `dk`, `dv` from `dout`.
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    saved: AttnSaved<'_>,
    sh: AttnShape,
) {
    let (s, d, a, akv, g) = (sh.seq, sh.head_dim, sh.heads, sh.kv_heads, sh.group());
    let (qld, kld) = (a * d, akv * d);
    let scale = sh.scale();
    let (dq_len, dk_len) = (dq.len(), dk.len());
    let (dq_ptr, dk_ptr, dv_ptr) = (
        Shared(dq.as_mut_ptr()),
        Shared(dk.as_mut_ptr()),
        Shared(dv.as_mut_ptr()),
    );
    // One task per (batch, kv head): it owns dK, dV of that head and dQ of its query heads.
    (0..sh.batch * akv).into_par_iter().for_each(|task| {
        let (bi, hk) = (task / akv, task % akv);
        // SAFETY: this task writes only batch `bi`'s rows of kv head `hk` and its query heads.
        let dq = unsafe { dq_ptr.slice(dq_len) };
        let dk = unsafe { dk_ptr.slice(dk_len) };
        let dv = unsafe { dv_ptr.slice(dk_len) };
        let kv_off = bi * s * kld + hk * d;
        for r in 0..s {
            dk[kv_off + r * kld..kv_off + r * kld + d].fill(0.0);
            dv[kv_off + r * kld..kv_off + r * kld + d].fill(0.0);
        }
        let mut p = vec![0.0f32; BR * BC];
        let mut dp = vec![0.0f32; BR * BC];
        let mut delta = [0.0f32; BR];
        for hq in hk * g..(hk + 1) * g {
            let q_off = bi * s * qld + hq * d;
            for r in 0..s {
                dq[q_off + r * qld..q_off + r * qld + d].fill(0.0);
            }
            let lse = &saved.lse[(bi * a + hq) * s..(bi * a + hq + 1) * s];
            for r0 in (0..s).step_by(BR) {
                let br = BR.min(s - r0);
                for i in 0..br {
                    let row = q_off + (r0 + i) * qld;
                    delta[i] = dout[row..row + d]
                        .iter()
                        .zip(&saved.out[row..row + d])
                        .map(|(x, y)| x * y)
                        .sum();
                }
                for c0 in (0..r0 + br).step_by(BC) {
                    let bc = BC.min(s - c0);
                    matmul(
                        br,
                        bc,
                        d,
                        &mut p,
                        Mat::rows(BC),
                        false,
                        &saved.q[q_off + r0 * qld..],
                        Mat::rows(qld),
                        &saved.k[kv_off + c0 * kld..],
                        Mat::transposed(kld),
                        Threads::Single,
                    );
                    for i in 0..br {
                        let limit = (r0 + i + 1).saturating_sub(c0).min(bc);
                        let row = &mut p[i * BC..i * BC + bc];
                        for z in row[..limit].iter_mut() {
                            *z = (*z * scale - lse[r0 + i]).exp();
                        }
                        row[limit..].fill(0.0);
                    }
                    // dV += Pᵀ · dO
                    matmul(
                        bc,
                        d,
                        br,
                        &mut dv[kv_off + c0 * kld..],
                        Mat::rows(kld),
                        true,
                        &p,
                        Mat::transposed(BC),
                        &dout[q_off + r0 * qld..],
                        Mat::rows(qld),
                        Threads::Single,
                    );
                    // dP = dO · Vᵀ
                    matmul(
                        br,
                        bc,
                        d,
                        &mut dp,
                        Mat::rows(BC),
                        false,
                        &dout[q_off + r0 * qld..],
                        Mat::rows(qld),
                        &saved.v[kv_off + c0 * kld..],
                        Mat::transposed(kld),
                        Threads::Single,
                    );
                    // dS = scale · P ⊙ (dP − Δ), stored over P.
                    for i in 0..br {
                        for j in 0..bc {
                            let idx = i * BC + j;
                            p[idx] = scale * p[idx] * (dp[idx] - delta[i]);
                        }
                    }
                    // dQ += dS · K ; dK += dSᵀ · Q
                    matmul(
                        br,
                        d,
                        bc,
                        &mut dq[q_off + r0 * qld..],
                        Mat::rows(qld),
                        true,
                        &p,
                        Mat::rows(BC),
                        &saved.k[kv_off + c0 * kld..],
                        Mat::rows(kld),
                        Threads::Single,
                    );
                    matmul(
                        bc,
                        d,
                        br,
                        &mut dk[kv_off + c0 * kld..],
                        Mat::rows(kld),
                        true,
                        &p,
                        Mat::transposed(BC),
                        &saved.q[q_off + r0 * qld..],
                        Mat::rows(qld),
                        Threads::Single,
                    );
                }
            }
        }
    });
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
