//! The tiled kernels behind [`block_forward`] and [`block_backward`]: tiles of [`BR`] query
//! rows against chunks of up to [`BC`] keys, each product on `gemm`, the softmax on
//! [`fastmath`]'s vector paths.
//!
//! Where a chunk's key positions ascend (whole sequences, and both of the split's layouts),
//! the kernels work on prefixes: a tile's score product stops at the last key its latest
//! query sees, and each row's exponentials stop at its own last visible key, the rest of the
//! row set to 0 without an exponential. Chunks in any other order fall back to masking each
//! score by position. Tiles with no visible pair are skipped without a product.

use rayon::prelude::*;

use super::BlockShape;
use crate::fastmath;
use crate::linear::{matmul, Mat, Threads};
use crate::shared::Shared;

/// Query rows per tile.
pub(super) const BR: usize = 32;
/// Keys per chunk: the widest score tile.
pub(super) const BC: usize = 128;

/// Smallest and largest position in each tile of `tile` consecutive tokens.
pub(super) fn tile_ranges(pos: &[usize], tile: usize) -> Vec<(usize, usize)> {
    pos.chunks(tile)
        .map(|c| {
            c.iter()
                .fold((usize::MAX, 0), |(lo, hi), &p| (lo.min(p), hi.max(p)))
        })
        .collect()
}

/// No pair of the tile is visible: even its earliest key comes after its latest query.
pub(super) fn tile_masked(q: (usize, usize), kv: (usize, usize)) -> bool {
    kv.0 > q.1
}

/// Every pair of the tile is visible, so no score needs a mask.
fn tile_full(q: (usize, usize), kv: (usize, usize)) -> bool {
    kv.1 <= q.0
}

/// Up to [`BC`] consecutive keys of a block: where they start and their positions.
struct KvChunk<'a> {
    /// First key of the chunk in the block.
    c0: usize,
    /// The chunk's key positions.
    pos: &'a [usize],
    /// Smallest and largest of them.
    range: (usize, usize),
    /// Whether the positions ascend, so the keys a query sees are a prefix.
    ascending: bool,
}

impl<'a> KvChunk<'a> {
    fn split(kv_pos: &'a [usize]) -> Vec<KvChunk<'a>> {
        let ranges = tile_ranges(kv_pos, BC);
        kv_pos
            .chunks(BC)
            .zip(ranges)
            .enumerate()
            .map(|(i, (pos, range))| KvChunk {
                c0: i * BC,
                pos,
                range,
                ascending: pos.windows(2).all(|w| w[0] <= w[1]),
            })
            .collect()
    }

    /// Columns of the score tile of queries spanning positions `q`: `None` when no key is
    /// visible to any of them; for ascending keys the prefix the latest query sees, else
    /// the whole chunk.
    fn cols(&self, q: (usize, usize)) -> Option<usize> {
        if tile_masked(q, self.range) {
            return None;
        }
        Some(if self.ascending {
            self.pos.partition_point(|&p| p <= q.1)
        } else {
            self.pos.len()
        })
    }

    /// The keys of `row` (a score row of this chunk) visible to the query at `qp`, as a
    /// prefix length: for ascending keys the prefix itself; otherwise every hidden score of
    /// the row is set to −∞ (its exponential is 0) and the whole row is returned.
    fn visible(&self, row: &mut [f32], qp: usize, full: bool) -> usize {
        if full {
            row.len()
        } else if self.ascending {
            self.pos[..row.len()].partition_point(|&p| p <= qp)
        } else {
            for (z, &kp) in row.iter_mut().zip(self.pos) {
                if kp > qp {
                    *z = f32::NEG_INFINITY;
                }
            }
            row.len()
        }
    }
}

/// The operands of one task: a query head's rows of one sequence (`q`, row stride `qld`)
/// and its key/value head's (`k`, `v`, row stride `kld`), each starting at the head's
/// first column.
#[derive(Clone, Copy)]
struct Heads<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    qld: usize,
    kld: usize,
    d: usize,
    scale: f32,
}

impl Heads<'_> {
    /// `scores[br × cols] = Q[r0..r0+br] · K[c0..c0+cols]ᵀ` (row stride [`BC`]), unscaled.
    fn scores(&self, scores: &mut [f32], r0: usize, br: usize, c0: usize, cols: usize) {
        matmul(
            br,
            cols,
            self.d,
            scores,
            Mat::rows(BC),
            false,
            &self.q[r0 * self.qld..],
            Mat::rows(self.qld),
            &self.k[c0 * self.kld..],
            Mat::transposed(self.kld),
            Threads::Single,
        );
    }
}

/// The online-softmax state of one query tile: unnormalised output rows, running maxima
/// and sums.
struct Running {
    acc: Vec<f32>,
    max: [f32; BR],
    sum: [f32; BR],
}

/// Forward of `q` over one key/value block: writes the output normalised over this block
/// alone and its log-sum-exp, ready for [`super::merge_partial`].
///
/// A query row that sees no key of the block gets `out = 0` and `lse = −∞`, which
/// [`super::merge_partial`] treats as "no contribution".
#[allow(clippy::too_many_arguments)]
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
    let (q_tiles, chunks) = (tile_ranges(q_pos, BR), KvChunk::split(kv_pos));
    (0..sh.batch * a).into_par_iter().for_each(|task| {
        let (bi, hq) = (task / a, task % a);
        let hk = hq / sh.group();
        // SAFETY: this task writes only rows of batch `bi`, columns and lse rows of head `hq`.
        let out = unsafe { out_ptr.slice(out_len) };
        let lse = unsafe { lse_ptr.slice(lse_len) };
        let heads = Heads {
            q: &q[bi * sq * qld + hq * d..],
            k: &k[bi * skv * kld + hk * d..],
            v: &v[bi * skv * kld + hk * d..],
            qld,
            kld,
            d,
            scale: sh.scale(),
        };
        let mut scores = vec![0.0f32; BR * BC];
        let mut run = Running {
            acc: vec![0.0f32; BR * d],
            max: [0.0; BR],
            sum: [0.0; BR],
        };
        for (rt, &qr) in q_tiles.iter().enumerate() {
            let (r0, br) = (rt * BR, BR.min(sq - rt * BR));
            run.acc[..br * d].fill(0.0);
            run.max[..br].fill(f32::NEG_INFINITY);
            run.sum[..br].fill(0.0);
            for chunk in &chunks {
                let Some(cols) = chunk.cols(qr) else { continue };
                heads.scores(&mut scores, r0, br, chunk.c0, cols);
                let full = tile_full(qr, chunk.range);
                for i in 0..br {
                    let row = &mut scores[i * BC..i * BC + cols];
                    let vis = chunk.visible(row, q_pos[r0 + i], full);
                    online_softmax_row(row, &mut run, i, d, vis, heads.scale);
                }
                matmul(
                    br,
                    d,
                    cols,
                    &mut run.acc,
                    Mat::rows(d),
                    true,
                    &scores,
                    Mat::rows(BC),
                    &heads.v[chunk.c0 * kld..],
                    Mat::rows(kld),
                    Threads::Single,
                );
            }
            let lse = &mut lse[(bi * a + hq) * sq + r0..][..br];
            let out = &mut out[bi * sq * qld + r0 * qld + hq * d..];
            finish_tile(out, qld, lse, &run, br, d);
        }
    });
}

/// Folds score row `i` of a tile (its first `vis` entries visible, raw) into the running
/// softmax: rescales the row's accumulator by `e^(max − max')` and leaves the row's
/// probabilities `e^(scale·z − max')` in place (0 past `vis`) for the product with V.
fn online_softmax_row(
    row: &mut [f32],
    run: &mut Running,
    i: usize,
    d: usize,
    vis: usize,
    scale: f32,
) {
    let (seen, hidden) = row.split_at_mut(vis);
    hidden.fill(0.0);
    // scale > 0, so scale·max(z) is max(scale·z) after the same rounding.
    let mx = run.max[i].max(scale * fastmath::max(seen));
    if mx == f32::NEG_INFINITY {
        // Nothing visible to this row so far: rescaling by exp(−∞ − (−∞)) would be NaN, and
        // the row adds nothing to the accumulator.
        seen.fill(0.0);
        return;
    }
    // On the row's first visible tile the running max is −∞ and alpha is 0, as wanted.
    let alpha = fastmath::exp(run.max[i] - mx);
    let sum = fastmath::exp_scaled_sum(seen, scale, mx);
    run.sum[i] = run.sum[i] * alpha + sum;
    run.max[i] = mx;
    run.acc[i * d..(i + 1) * d]
        .iter_mut()
        .for_each(|o| *o *= alpha);
}

/// Writes a finished tile: each output row normalised by its sum (row stride `qld`), and
/// its log-sum-exp; a row that saw no key gets 0 and −∞.
fn finish_tile(out: &mut [f32], qld: usize, lse: &mut [f32], run: &Running, br: usize, d: usize) {
    for i in 0..br {
        let row = &mut out[i * qld..i * qld + d];
        if run.sum[i] == 0.0 {
            row.fill(0.0);
            lse[i] = f32::NEG_INFINITY;
            continue;
        }
        let inv = 1.0 / run.sum[i];
        for (o, a) in row.iter_mut().zip(&run.acc[i * d..(i + 1) * d]) {
            *o = a * inv;
        }
        lse[i] = run.max[i] + run.sum[i].ln();
    }
}

/// Gradient outputs of one backward task, each starting at its head's first column.
struct Grads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

/// One (query head, query tile) of the backward: its rows of the forward's inputs.
struct QueryTile<'a> {
    r0: usize,
    br: usize,
    range: (usize, usize),
    pos: &'a [usize],
    dout: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
}

/// This key/value block's share of the backward, from the FINAL `lse` and `delta` of the
/// queries (over all blocks): ADDS the block's contribution to `dq` and OVERWRITES `dk`, `dv`
/// (shaped like `k`, `v`) with the gradient this rank's queries send to the block, so a rank
/// can hand them on to the block's owner.
#[allow(clippy::too_many_arguments)]
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
    let (dq_len, dk_len) = (dq.len(), dk.len());
    let (dq_ptr, dk_ptr, dv_ptr) = (
        Shared(dq.as_mut_ptr()),
        Shared(dk.as_mut_ptr()),
        Shared(dv.as_mut_ptr()),
    );
    let (q_tiles, chunks) = (tile_ranges(q_pos, BR), KvChunk::split(kv_pos));
    // One task per (batch, kv head): it owns dK, dV of that head and dQ of its query heads.
    (0..sh.batch * akv).into_par_iter().for_each(|task| {
        let (bi, hk) = (task / akv, task % akv);
        let kv_off = bi * skv * kld + hk * d;
        // SAFETY: this task writes only batch `bi`'s rows of kv head `hk` and its query heads.
        let (dk, dv) = unsafe {
            (
                &mut dk_ptr.slice(dk_len)[kv_off..],
                &mut dv_ptr.slice(dk_len)[kv_off..],
            )
        };
        for r in 0..skv {
            dk[r * kld..r * kld + d].fill(0.0);
            dv[r * kld..r * kld + d].fill(0.0);
        }
        let mut tiles = [vec![0.0f32; BR * BC], vec![0.0f32; BR * BC]];
        for hq in hk * g..(hk + 1) * g {
            let q_off = bi * sq * qld + hq * d;
            let heads = Heads {
                q: &q[q_off..],
                k: &k[kv_off..],
                v: &v[kv_off..],
                qld,
                kld,
                d,
                scale: sh.scale(),
            };
            // SAFETY: as above; query head `hq` belongs to kv head `hk`.
            let mut grads = Grads {
                dq: unsafe { &mut dq_ptr.slice(dq_len)[q_off..] },
                dk: &mut *dk,
                dv: &mut *dv,
            };
            let rows = (bi * a + hq) * sq..(bi * a + hq + 1) * sq;
            for (rt, &range) in q_tiles.iter().enumerate() {
                let (r0, br) = (rt * BR, BR.min(sq - rt * BR));
                let tile = QueryTile {
                    r0,
                    br,
                    range,
                    pos: &q_pos[r0..r0 + br],
                    dout: &dout[q_off + r0 * qld..],
                    lse: &lse[rows.clone()][r0..r0 + br],
                    delta: &delta[rows.clone()][r0..r0 + br],
                };
                for chunk in &chunks {
                    backward_tile(&mut grads, &mut tiles, heads, &tile, chunk);
                }
            }
        }
    });
}

/// One (query tile, key chunk) of the backward: recomputes P from the saved log-sum-exp,
/// then `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = scale·P ⊙ (dP − Δ)`, `dQ += dS·K`, `dK += dSᵀ·Q`.
fn backward_tile(
    g: &mut Grads<'_>,
    tiles: &mut [Vec<f32>; 2],
    h: Heads<'_>,
    t: &QueryTile<'_>,
    chunk: &KvChunk<'_>,
) {
    let Some(cols) = chunk.cols(t.range) else {
        return;
    };
    let (p, dp) = tiles.split_at_mut(1);
    let (p, dp) = (&mut p[0], &mut dp[0]);
    let (br, c0, qld, kld, d) = (t.br, chunk.c0, h.qld, h.kld, h.d);
    h.scores(p, t.r0, br, c0, cols);
    let full = tile_full(t.range, chunk.range);
    for i in 0..br {
        let row = &mut p[i * BC..i * BC + cols];
        // A row at lse = −∞ saw no key in any block; exp(z + ∞) would not be 0.
        if t.lse[i] == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        let vis = chunk.visible(row, t.pos[i], full);
        let (seen, hidden) = row.split_at_mut(vis);
        fastmath::exp_scaled(seen, h.scale, t.lse[i]);
        hidden.fill(0.0);
    }
    // dV += Pᵀ · dO
    matmul(
        cols,
        d,
        br,
        &mut g.dv[c0 * kld..],
        Mat::rows(kld),
        true,
        p,
        Mat::transposed(BC),
        t.dout,
        Mat::rows(qld),
        Threads::Single,
    );
    // dP = dO · Vᵀ
    matmul(
        br,
        cols,
        d,
        dp,
        Mat::rows(BC),
        false,
        t.dout,
        Mat::rows(qld),
        &h.v[c0 * kld..],
        Mat::transposed(kld),
        Threads::Single,
    );
    for i in 0..br {
        let row = i * BC..i * BC + cols;
        fastmath::softmax_grad(&mut p[row.clone()], &dp[row], t.delta[i], h.scale);
    }
    // dQ += dS · K ; dK += dSᵀ · Q
    matmul(
        br,
        d,
        cols,
        &mut g.dq[t.r0 * qld..],
        Mat::rows(qld),
        true,
        p,
        Mat::rows(BC),
        &h.k[c0 * kld..],
        Mat::rows(kld),
        Threads::Single,
    );
    matmul(
        cols,
        d,
        br,
        &mut g.dk[c0 * kld..],
        Mat::rows(kld),
        true,
        p,
        Mat::transposed(BC),
        &h.q[t.r0 * qld..],
        Mat::rows(qld),
        Threads::Single,
    );
}
