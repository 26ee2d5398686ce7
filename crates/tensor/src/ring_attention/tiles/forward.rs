//! [`block_forward`]: one task per (sequence, query head), its query tiles in turn, each
//! folding the key chunks it sees into an online softmax.

use rayon::prelude::*;

use super::{tile_ranges, KvChunk, QTile, Scores, BC, BR};
use crate::fastmath;
use crate::ring_attention::micro::{product, Head, Kernel, Operand, Out, Rows};
use crate::ring_attention::KvBlock;
use crate::shared::Shared;

/// What one worker reuses from task to task: `Kᵀ` and `V` of a key/value head laid out for
/// the products, where that head starts in `k` and `v`, a score tile and an online-softmax
/// state.
struct Scratch {
    kt: Head,
    v: Head,
    holds: Option<usize>,
    scores: Vec<f32>,
    run: Running,
}

impl Scratch {
    /// For blocks of `skv` keys of head dimension `d`.
    fn new(skv: usize, d: usize) -> Scratch {
        Scratch {
            kt: Head::zeros(d, skv),
            v: Head::zeros(skv, d),
            holds: None,
            scores: vec![0.0f32; BR * BC],
            run: Running {
                acc: vec![0.0f32; BR * d],
                max: [0.0; BR],
                sum: [0.0; BR],
            },
        }
    }
}

/// Bytes a worker of the forward holds for blocks of `skv` keys.
#[cfg(test)]
pub(super) fn scratch_bytes(skv: usize, d: usize) -> usize {
    let s = Scratch::new(skv, d);
    s.kt.bytes() + s.v.bytes() + 4 * (s.scores.len() + s.run.acc.len() + 2 * BR)
}

/// The online-softmax state of one query tile: unnormalised output rows, running maxima
/// and sums.
struct Running {
    acc: Vec<f32>,
    max: [f32; BR],
    sum: [f32; BR],
}

/// Forward of `q` over one key/value block: writes the output normalised over this block
/// alone and its log-sum-exp, ready for [`crate::ring_attention::merge_partial`].
///
/// A query row that sees no key of the block gets `out = 0` and `lse = −∞`, which
/// [`crate::ring_attention::merge_partial`] treats as "no contribution".
pub fn block_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    block: KvBlock<'_>,
) {
    block.check();
    let (sh, q_pos) = (block.shape, block.q_pos);
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
    let (qld, kld, scale) = (a * d, akv * d, sh.scale());
    let (out_len, lse_len) = (out.len(), lse.len());
    let (out_ptr, lse_ptr) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
    let (q_tiles, chunks) = (tile_ranges(q_pos, BR), KvChunk::split(block.kv_pos));
    let kernel = Kernel::detect();
    let scratch = || Scratch::new(skv, d);
    // Pieces of at least a worker's share rounded down (rayon halves a range while both
    // halves keep that many): scratch is set up once per piece, about once per worker, and
    // a piece's query heads are consecutive, so those of one key/value head lay it out once.
    let min_len = (sh.batch * a / rayon::current_num_threads()).max(1);
    let tasks = (0..sh.batch * a).into_par_iter().with_min_len(min_len);
    tasks.for_each_init(scratch, |s, task| {
        let (bi, hq) = (task / a, task % a);
        let kv_off = bi * skv * kld + hq / sh.group() * d;
        // SAFETY: this task writes only rows of batch `bi`, columns and lse rows of head `hq`.
        let out = unsafe { out_ptr.slice(out_len) };
        let lse = unsafe { lse_ptr.slice(lse_len) };
        if s.holds != Some(kv_off) {
            s.kt.transpose(&k[kv_off..], kld);
            s.v.gather(&v[kv_off..], kld);
            s.holds = Some(kv_off);
        }
        for (rt, &qr) in q_tiles.iter().enumerate() {
            let tile = QTile::new(rt, q_pos, qr, block.starts_of(bi));
            let (r0, br) = (tile.r0, tile.rows());
            let q = Rows::new(&q[bi * sq * qld + hq * d..], qld);
            forward_tile(s, (q, kernel), &chunks, &tile, scale);
            let lse = &mut lse[(bi * a + hq) * sq + r0..][..br];
            let out = &mut out[bi * sq * qld + r0 * qld + hq * d..];
            finish_tile(out, qld, lse, &s.run, br, d);
        }
    });
}

/// One query tile against every chunk it sees: leaves its unnormalised output rows, maxima
/// and sums in `s.run`.
fn forward_tile(
    s: &mut Scratch,
    (q, kernel): (Rows<'_>, Kernel),
    chunks: &[KvChunk<'_>],
    tile: &QTile<'_>,
    scale: f32,
) {
    let (r0, br, d) = (tile.r0, tile.rows(), s.v.cols());
    let heads = Scores {
        q,
        kt: &s.kt,
        d,
        kernel,
    };
    let (scores, run) = (&mut s.scores, &mut s.run);
    run.acc[..br * d].fill(0.0);
    run.max[..br].fill(f32::NEG_INFINITY);
    run.sum[..br].fill(0.0);
    for chunk in chunks {
        let Some(cols) = tile.cols(chunk) else {
            continue;
        };
        heads.product(scores, r0, br, chunk.c0, cols);
        let full = tile.full(chunk);
        for i in 0..br {
            let row = &mut scores[i * BC..i * BC + cols];
            let vis = chunk.visible(row, tile.row(i), full);
            online_softmax_row(row, run, i, d, vis, scale);
        }
        let (acc, p) = (Out::add(&mut run.acc, d), Operand::rows(scores, BC));
        product(kernel, (br, d, cols), acc, p, s.v.row(chunk.c0));
    }
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
