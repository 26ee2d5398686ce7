//! The pieces one rank needs for context-parallel ring attention: each rank keeps the queries
//! of its own tokens while the key/value blocks of all ranks pass by in a ring.
//!
//! - [`block_forward`] attends one rank's queries over one key/value block and returns a
//!   normalised partial output with its log-sum-exp;
//! - [`merge_partial`] folds such a partial into the running result (online softmax), so the
//!   blocks may arrive in any order;
//! - [`attention_delta`] and [`block_backward`] give one block's share of the gradients from
//!   the final output and log-sum-exp, with `dk`/`dv` written per block so they can travel
//!   back to the block's owner;
//! - [`zigzag_positions`], [`contiguous_positions`] and [`block_flops`] describe the split.
//!
//! The causal mask is by global position, so a block may hold any set of tokens: key `j` is
//! visible to query `i` iff `kv_pos[j] <= q_pos[i]`. Tiles with no visible pair are skipped
//! without a matmul; that is what turns the zig-zag split's balanced pair count into balanced
//! work.
//!
//! Layouts (positions are shared by every batch row): `q, out: [b·q_len, heads·d]`,
//! `k, v: [b·kv_len, kv_heads·d]`, `lse, delta: [b, heads, q_len]`. Query head `i` reads
//! key/value head `i / (heads / kv_heads)`, as in [`crate::attention`].

use rayon::prelude::*;

use crate::fastmath;
use crate::linear::{matmul, Mat, Threads};
use crate::shared::Shared;

mod split;
#[cfg(test)]
mod tests;

pub use split::{block_flops, contiguous_positions, zigzag_positions, SplitError};

/// Query rows per tile.
const BR: usize = 64;
/// Key columns per tile.
const BC: usize = 64;

/// Shape of one (query block, key/value block) attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockShape {
    /// Sequences; every one has the same positions.
    pub batch: usize,
    /// Query tokens per sequence held by this rank.
    pub q_len: usize,
    /// Key/value tokens per sequence in the block.
    pub kv_len: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; divides `heads`.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl BlockShape {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
    fn q_elems(&self) -> usize {
        self.batch * self.q_len * self.heads * self.head_dim
    }
    fn kv_elems(&self) -> usize {
        self.batch * self.kv_len * self.kv_heads * self.head_dim
    }
    fn row_elems(&self) -> usize {
        self.batch * self.heads * self.q_len
    }
    /// The kernels write through raw pointers and strided matmuls, so a wrong length must stop
    /// here rather than reach them.
    fn check(&self, q_pos: &[usize], kv_pos: &[usize]) {
        assert!(
            self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads),
            "heads {} not a multiple of kv_heads {}",
            self.heads,
            self.kv_heads
        );
        assert_eq!(q_pos.len(), self.q_len, "q_pos length vs q_len");
        assert_eq!(kv_pos.len(), self.kv_len, "kv_pos length vs kv_len");
    }
}

/// Smallest and largest position in each tile of `tile` consecutive tokens.
fn tile_ranges(pos: &[usize], tile: usize) -> Vec<(usize, usize)> {
    pos.chunks(tile)
        .map(|c| {
            c.iter()
                .fold((usize::MAX, 0), |(lo, hi), &p| (lo.min(p), hi.max(p)))
        })
        .collect()
}

/// No pair of the tile is visible: even its earliest key comes after its latest query.
fn tile_masked(q: (usize, usize), kv: (usize, usize)) -> bool {
    kv.0 > q.1
}

/// Every pair of the tile is visible, so the per-element mask test can be skipped.
fn tile_full(q: (usize, usize), kv: (usize, usize)) -> bool {
    kv.1 <= q.0
}

/// Forward of `q` over one key/value block: writes the output normalised over this block
/// alone and its log-sum-exp, ready for [`merge_partial`].
///
/// A query row that sees no key of the block gets `out = 0` and `lse = −∞`, which
/// [`merge_partial`] treats as "no contribution".
pub fn block_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[usize],
    kv_pos: &[usize],
    sh: BlockShape,
) {
    sh.check(q_pos, kv_pos);
    assert!(
        out.len() == sh.q_elems() && q.len() == sh.q_elems(),
        "q/out length"
    );
    assert!(
        k.len() == sh.kv_elems() && v.len() == sh.kv_elems(),
        "k/v length"
    );
    assert_eq!(lse.len(), sh.row_elems(), "lse length");
    let (sq, skv, d, a, akv) = (sh.q_len, sh.kv_len, sh.head_dim, sh.heads, sh.kv_heads);
    let (qld, kld) = (a * d, akv * d);
    let (out_len, lse_len) = (out.len(), lse.len());
    let (out_ptr, lse_ptr) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    let scale = sh.scale();
    let (q_tiles, kv_tiles) = (tile_ranges(q_pos, BR), tile_ranges(kv_pos, BC));
    (0..sh.batch * a).into_par_iter().for_each(|task| {
        let (bi, hq) = (task / a, task % a);
        let hk = hq / sh.group();
        // SAFETY: this task writes only rows of batch `bi`, columns and lse rows of head `hq`.
        let out = unsafe { out_ptr.slice(out_len) };
        let lse = unsafe { lse_ptr.slice(lse_len) };
        let qb = &q[bi * sq * qld + hq * d..];
        let kb = &k[bi * skv * kld + hk * d..];
        let vb = &v[bi * skv * kld + hk * d..];
        let mut scores = vec![0.0f32; BR * BC];
        let mut acc = vec![0.0f32; BR * d];
        let mut row_max = [0.0f32; BR];
        let mut row_sum = [0.0f32; BR];
        for (rt, &qr) in q_tiles.iter().enumerate() {
            let (r0, br) = (rt * BR, BR.min(sq - rt * BR));
            acc[..br * d].fill(0.0);
            row_max[..br].fill(f32::NEG_INFINITY);
            row_sum[..br].fill(0.0);
            for (ct, &kr) in kv_tiles.iter().enumerate() {
                if tile_masked(qr, kr) {
                    continue;
                }
                let (c0, bc) = (ct * BC, BC.min(skv - ct * BC));
                let full = tile_full(qr, kr);
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
                    let qp = q_pos[r0 + i];
                    if full {
                        row.iter_mut().for_each(|z| *z *= scale);
                    } else {
                        for (z, &kp) in row.iter_mut().zip(&kv_pos[c0..c0 + bc]) {
                            *z = if kp <= qp {
                                *z * scale
                            } else {
                                f32::NEG_INFINITY
                            };
                        }
                    }
                    let mx = row_max[i].max(fastmath::max(row));
                    if mx == f32::NEG_INFINITY {
                        // Nothing visible to this row so far: rescaling by exp(−∞ − (−∞))
                        // would be NaN, and the row adds nothing to the accumulator.
                        row.fill(0.0);
                        continue;
                    }
                    // On the row's first visible tile row_max is −∞ and alpha is 0, as wanted.
                    let alpha = fastmath::exp(row_max[i] - mx);
                    let sum = fastmath::exp_shifted_sum(row, mx);
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
                let row = bi * sq * qld + (r0 + i) * qld + hq * d;
                let l = &mut lse[(bi * a + hq) * sq + r0 + i];
                if row_sum[i] == 0.0 {
                    out[row..row + d].fill(0.0);
                    *l = f32::NEG_INFINITY;
                    continue;
                }
                let inv = 1.0 / row_sum[i];
                for (o, a) in out[row..row + d].iter_mut().zip(&acc[i * d..(i + 1) * d]) {
                    *o = a * inv;
                }
                *l = row_max[i] + row_sum[i].ln();
            }
        }
    });
}

/// `log(eᵃ + eᵇ)`, exact when either side is −∞ (no contribution).
fn log_add_exp(a: f32, b: f32) -> f32 {
    if a == f32::NEG_INFINITY {
        return b;
    }
    if b == f32::NEG_INFINITY {
        return a;
    }
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    hi + (lo - hi).exp().ln_1p()
}

/// Merges a partial result (from [`block_forward`]) into the running `(out, lse)` in place:
/// `lse' = log(e^lse + e^part_lse)`, `out' = e^(lse−lse')·out + e^(part_lse−lse')·part_out`.
///
/// A side with `lse = −∞` contributes nothing: a running row at −∞ takes the partial as is,
/// and a partial row at −∞ leaves the running row bit for bit unchanged.
pub fn merge_partial(
    out: &mut [f32],
    lse: &mut [f32],
    part_out: &[f32],
    part_lse: &[f32],
    sh: BlockShape,
) {
    assert!(
        out.len() == sh.q_elems() && part_out.len() == sh.q_elems(),
        "out length"
    );
    assert!(
        lse.len() == sh.row_elems() && part_lse.len() == sh.row_elems(),
        "lse length"
    );
    let (sq, a, d) = (sh.q_len, sh.heads, sh.head_dim);
    let row_len = a * d;
    if row_len == 0 {
        return;
    }
    // The output pass needs the old lse, so lse is updated in a second pass.
    let old_lse: &[f32] = lse;
    out.par_chunks_mut(row_len)
        .zip(part_out.par_chunks(row_len))
        .enumerate()
        .with_min_len((crate::PAR_CHUNK / row_len).max(1))
        .for_each(|(row, (o, po))| {
            let (bi, i) = (row / sq, row % sq);
            for h in 0..a {
                let idx = (bi * a + h) * sq + i;
                let (l, pl) = (old_lse[idx], part_lse[idx]);
                let (o, po) = (&mut o[h * d..(h + 1) * d], &po[h * d..(h + 1) * d]);
                if pl == f32::NEG_INFINITY {
                    continue;
                }
                if l == f32::NEG_INFINITY {
                    o.copy_from_slice(po);
                    continue;
                }
                let m = log_add_exp(l, pl);
                let (wa, wb) = ((l - m).exp(), (pl - m).exp());
                for (x, y) in o.iter_mut().zip(po) {
                    *x = wa * *x + wb * y;
                }
            }
        });
    lse.par_iter_mut()
        .zip(part_lse)
        .with_min_len(crate::PAR_CHUNK)
        .for_each(|(l, &pl)| *l = log_add_exp(*l, pl));
}

/// The flash-attention `D` term of the final output: `delta[b, h, i] = Σ_c dout·out` over
/// head `h`'s `d` elements of row `i`. Computed once per step and shared by every
/// [`block_backward`] of these queries.
pub fn attention_delta(delta: &mut [f32], dout: &[f32], out: &[f32], sh: BlockShape) {
    assert!(
        out.len() == sh.q_elems() && dout.len() == sh.q_elems(),
        "out length"
    );
    assert_eq!(delta.len(), sh.row_elems(), "delta length");
    let (sq, a, d) = (sh.q_len, sh.heads, sh.head_dim);
    if sq == 0 {
        return;
    }
    delta.par_chunks_mut(sq).enumerate().for_each(|(task, dl)| {
        let (bi, h) = (task / a, task % a);
        for (i, x) in dl.iter_mut().enumerate() {
            let row = (bi * sq + i) * a * d + h * d;
            *x = dout[row..row + d]
                .iter()
                .zip(&out[row..row + d])
                .map(|(x, y)| x * y)
                .sum();
        }
    });
}

/// This key/value block's share of the backward, from the FINAL `lse` and `delta` of the
/// queries (over all blocks): ADDS the block's contribution to `dq` and OVERWRITES `dk`, `dv`
/// (shaped like `k`, `v`) with the gradient this rank's queries send to the block, so a rank
/// can hand them on to the block's owner.
pub fn block_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    lse: &[f32],
    delta: &[f32],
    q_pos: &[usize],
    kv_pos: &[usize],
    sh: BlockShape,
) {
    sh.check(q_pos, kv_pos);
    assert!(
        q.len() == sh.q_elems() && dq.len() == sh.q_elems(),
        "q/dq length"
    );
    assert_eq!(dout.len(), sh.q_elems(), "dout length");
    assert!(
        k.len() == sh.kv_elems() && v.len() == sh.kv_elems(),
        "k/v length"
    );
    assert!(
        dk.len() == sh.kv_elems() && dv.len() == sh.kv_elems(),
        "dk/dv length"
    );
    assert!(
        lse.len() == sh.row_elems() && delta.len() == sh.row_elems(),
        "lse/delta length"
    );
    let (sq, skv, d) = (sh.q_len, sh.kv_len, sh.head_dim);
    let (a, akv, g) = (sh.heads, sh.kv_heads, sh.group());
    let (qld, kld) = (a * d, akv * d);
    let scale = sh.scale();
    let (dq_len, dk_len) = (dq.len(), dk.len());
    let (dq_ptr, dk_ptr, dv_ptr) = (
        Shared(dq.as_mut_ptr()),
        Shared(dk.as_mut_ptr()),
        Shared(dv.as_mut_ptr()),
    );
    let (q_tiles, kv_tiles) = (tile_ranges(q_pos, BR), tile_ranges(kv_pos, BC));
    // One task per (batch, kv head): it owns dK, dV of that head and dQ of its query heads.
    (0..sh.batch * akv).into_par_iter().for_each(|task| {
        let (bi, hk) = (task / akv, task % akv);
        // SAFETY: this task writes only batch `bi`'s rows of kv head `hk` and its query heads.
        let dq = unsafe { dq_ptr.slice(dq_len) };
        let dk = unsafe { dk_ptr.slice(dk_len) };
        let dv = unsafe { dv_ptr.slice(dk_len) };
        let kv_off = bi * skv * kld + hk * d;
        for r in 0..skv {
            dk[kv_off + r * kld..kv_off + r * kld + d].fill(0.0);
            dv[kv_off + r * kld..kv_off + r * kld + d].fill(0.0);
        }
        let mut p = vec![0.0f32; BR * BC];
        let mut dp = vec![0.0f32; BR * BC];
        for hq in hk * g..(hk + 1) * g {
            let q_off = bi * sq * qld + hq * d;
            let rows = (bi * a + hq) * sq..(bi * a + hq + 1) * sq;
            let (lse, delta) = (&lse[rows.clone()], &delta[rows]);
            for (rt, &qr) in q_tiles.iter().enumerate() {
                let (r0, br) = (rt * BR, BR.min(sq - rt * BR));
                for (ct, &kr) in kv_tiles.iter().enumerate() {
                    if tile_masked(qr, kr) {
                        continue;
                    }
                    let (c0, bc) = (ct * BC, BC.min(skv - ct * BC));
                    let full = tile_full(qr, kr);
                    matmul(
                        br,
                        bc,
                        d,
                        &mut p,
                        Mat::rows(BC),
                        false,
                        &q[q_off + r0 * qld..],
                        Mat::rows(qld),
                        &k[kv_off + c0 * kld..],
                        Mat::transposed(kld),
                        Threads::Single,
                    );
                    for i in 0..br {
                        let (qp, l) = (q_pos[r0 + i], lse[r0 + i]);
                        let row = &mut p[i * BC..i * BC + bc];
                        // A row at lse = −∞ saw no key in any block; exp(z + ∞) would not be 0.
                        if l == f32::NEG_INFINITY {
                            row.fill(0.0);
                            continue;
                        }
                        for (z, &kp) in row.iter_mut().zip(&kv_pos[c0..c0 + bc]) {
                            *z = if full || kp <= qp {
                                *z * scale
                            } else {
                                f32::NEG_INFINITY
                            };
                        }
                        fastmath::exp_shifted(row, l);
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
                        &v[kv_off + c0 * kld..],
                        Mat::transposed(kld),
                        Threads::Single,
                    );
                    // dS = scale · P ⊙ (dP − Δ), stored over P.
                    for i in 0..br {
                        for j in 0..bc {
                            let idx = i * BC + j;
                            p[idx] = scale * p[idx] * (dp[idx] - delta[r0 + i]);
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
                        &k[kv_off + c0 * kld..],
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
                        &q[q_off + r0 * qld..],
                        Mat::rows(qld),
                        Threads::Single,
                    );
                }
            }
        }
    });
}
