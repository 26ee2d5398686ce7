//! [`block_backward`]: one task per (sequence, key/value head), owning that head's `dK`,
//! `dV` and the `dQ` of its query heads, with `Kᵀ` and `Vᵀ` laid out once for all of them;
//! each (query tile, key chunk) recomputes its probabilities from the saved log-sum-exp.

use rayon::prelude::*;

use super::{tile_ranges, KvChunk, QTile, Scores, BC, BR};
use crate::fastmath;
use crate::ring_attention::micro::{product, Head, Kernel, Operand, Out, Rows};
use crate::ring_attention::{BlockShape, KvBlock};
use crate::shared::Shared;

/// Gradient outputs of one backward task, each starting at its head's first column (row
/// strides `qld` and `kld`).
struct Grads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
    qld: usize,
    kld: usize,
}

/// What one worker reuses from task to task: the task's heads laid out for the products
/// (`Kᵀ`, `K`, `Vᵀ`, and `Q`, `dO` of one query head at a time), and two score tiles.
struct Scratch {
    kt: Head,
    k: Head,
    q: Head,
    dout: Head,
    vt: Head,
    tiles: [Vec<f32>; 2],
}

impl Scratch {
    /// For blocks of `sq` queries and `skv` keys of head dimension `d`.
    fn new(sq: usize, skv: usize, d: usize) -> Scratch {
        Scratch {
            kt: Head::zeros(d, skv),
            k: Head::zeros(skv, d),
            q: Head::zeros(sq, d),
            dout: Head::zeros(sq, d),
            vt: Head::zeros(d, skv),
            tiles: [vec![0.0f32; BR * BC], vec![0.0f32; BR * BC]],
        }
    }

    /// Bytes it holds.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        let heads = [&self.kt, &self.k, &self.q, &self.dout, &self.vt];
        heads.iter().map(|h| h.bytes()).sum::<usize>() + 4 * 2 * BR * BC
    }
}

/// One (query head, query tile) of the backward: its rows of the forward's inputs.
struct QueryTile<'a> {
    rows: QTile<'a>,
    dout: Rows<'a>,
    lse: &'a [f32],
    delta: &'a [f32],
    scale: f32,
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
    block: KvBlock<'_>,
) {
    block.check();
    let sh = block.shape;
    let lens = |n: usize, xs: &[usize]| xs.iter().all(|&l| l == n);
    assert!(
        lens(sh.q_elems(), &[q.len(), dq.len(), dout.len()]),
        "q/dq/dout length"
    );
    let kv_lens = [k.len(), v.len(), dk.len(), dv.len()];
    assert!(lens(sh.kv_elems(), &kv_lens), "k/v/dk/dv length");
    assert!(
        lens(sh.row_elems(), &[lse.len(), delta.len()]),
        "lse/delta length"
    );
    let (sq, skv, d) = (sh.q_len, sh.kv_len, sh.head_dim);
    let outputs = Outputs {
        dq: Shared(dq.as_mut_ptr()),
        dk: Shared(dk.as_mut_ptr()),
        dv: Shared(dv.as_mut_ptr()),
        lens: (dq.len(), dk.len()),
    };
    let inputs = Inputs {
        q,
        k,
        v,
        dout,
        lse,
        delta,
    };
    let (q_tiles, chunks) = (tile_ranges(block.q_pos, BR), KvChunk::split(block.kv_pos));
    let tiling = Tiling {
        q_tiles: &q_tiles,
        chunks: &chunks,
        q_pos: block.q_pos,
        q_start: None,
        scale: sh.scale(),
        kernel: Kernel::detect(),
    };
    let scratch = || Scratch::new(sq, skv, d);
    // One task per (batch, kv head): it owns dK, dV of that head and dQ of its query heads.
    // Pieces of at least a worker's share rounded down: scratch is set up once per piece.
    let n = sh.batch * sh.kv_heads;
    let tasks = (0..n)
        .into_par_iter()
        .with_min_len((n / rayon::current_num_threads()).max(1));
    tasks.for_each_init(scratch, |s, task| {
        let tiling = Tiling {
            q_start: block.starts_of(task / sh.kv_heads),
            ..tiling
        };
        backward_task(s, task, sh, (&inputs, &outputs), &tiling)
    });
}

/// The backward's inputs, whole: every sequence's rows of every head.
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
}

/// The gradient outputs, shared by the tasks (each writes its own heads), and the lengths of
/// `dq` and of `dk` (= `dv`'s).
struct Outputs {
    dq: Shared,
    dk: Shared,
    dv: Shared,
    lens: (usize, usize),
}

/// Task `task` = (sequence `bi`, key/value head `hk`): zeroes and fills that head's `dK`,
/// `dV`, adds to its query heads' `dQ`.
fn backward_task(
    s: &mut Scratch,
    task: usize,
    sh: BlockShape,
    (x, out): (&Inputs<'_>, &Outputs),
    t: &Tiling<'_>,
) {
    let (sq, skv, d) = (sh.q_len, sh.kv_len, sh.head_dim);
    let (a, akv, g) = (sh.heads, sh.kv_heads, sh.group());
    let (qld, kld) = (a * d, akv * d);
    let (bi, hk) = (task / akv, task % akv);
    let kv_off = bi * skv * kld + hk * d;
    // SAFETY: this task writes only batch `bi`'s rows of kv head `hk` and its query heads.
    let (dk, dv) = unsafe {
        (
            &mut out.dk.slice(out.lens.1)[kv_off..],
            &mut out.dv.slice(out.lens.1)[kv_off..],
        )
    };
    for r in 0..skv {
        dk[r * kld..r * kld + d].fill(0.0);
        dv[r * kld..r * kld + d].fill(0.0);
    }
    s.kt.transpose(&x.k[kv_off..], kld);
    s.vt.transpose(&x.v[kv_off..], kld);
    s.k.gather(&x.k[kv_off..], kld);
    for hq in hk * g..(hk + 1) * g {
        let q_off = bi * sq * qld + hq * d;
        // SAFETY: as above; query head `hq` belongs to kv head `hk`.
        let mut grads = Grads {
            dq: unsafe { &mut out.dq.slice(out.lens.0)[q_off..] },
            dk: &mut *dk,
            dv: &mut *dv,
            qld,
            kld,
        };
        let rows = (bi * a + hq) * sq..(bi * a + hq + 1) * sq;
        let head = QueryHead {
            q: &x.q[q_off..],
            dout: &x.dout[q_off..],
            lse: &x.lse[rows.clone()],
            delta: &x.delta[rows],
        };
        backward_head(s, &mut grads, t, head);
    }
}

/// What every task of one backward call walks: the query tiles' position ranges, the key
/// chunks, the query positions and (for the task's sequence) document starts, the softmax
/// scale and the products' kernel.
#[derive(Clone, Copy)]
struct Tiling<'a> {
    q_tiles: &'a [(usize, usize)],
    chunks: &'a [KvChunk<'a>],
    q_pos: &'a [usize],
    q_start: Option<&'a [usize]>,
    scale: f32,
    kernel: Kernel,
}

/// One query head's inputs: its rows of `q` and `dout` (from the head's first column, row
/// stride `heads · d`) and its rows of `lse` and `delta`.
struct QueryHead<'a> {
    q: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
}

/// Query head `head`'s share of a task's backward, every (query tile, key chunk) pair, the
/// task's key/value head already laid out in `s`.
fn backward_head(s: &mut Scratch, grads: &mut Grads<'_>, t: &Tiling<'_>, head: QueryHead<'_>) {
    s.q.gather(head.q, grads.qld);
    s.dout.gather(head.dout, grads.qld);
    let heads = Scores {
        q: s.q.rows(),
        kt: &s.kt,
        d: s.q.cols(),
        kernel: t.kernel,
    };
    let kv = (s.k.rows(), &s.vt);
    for (rt, &range) in t.q_tiles.iter().enumerate() {
        let rows = QTile::new(rt, t.q_pos, range, t.q_start);
        let (r0, br) = (rows.r0, rows.rows());
        let tile = QueryTile {
            rows,
            dout: s.dout.rows(),
            lse: &head.lse[r0..r0 + br],
            delta: &head.delta[r0..r0 + br],
            scale: t.scale,
        };
        for chunk in t.chunks {
            backward_tile(grads, &mut s.tiles, (heads, kv), &tile, chunk);
        }
    }
}

/// One (query tile, key chunk) of the backward: recomputes P from the saved log-sum-exp,
/// then `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = scale·P ⊙ (dP − Δ)`, `dQ += dS·K`, `dK += dSᵀ·Q`.
fn backward_tile(
    g: &mut Grads<'_>,
    tiles: &mut [Vec<f32>; 2],
    (h, (k, vt)): (Scores<'_>, (Rows<'_>, &Head)),
    t: &QueryTile<'_>,
    chunk: &KvChunk<'_>,
) {
    let Some(cols) = t.rows.cols(chunk) else {
        return;
    };
    let (p, dp) = tiles.split_at_mut(1);
    let (p, dp) = (&mut p[0], &mut dp[0]);
    let (br, c0, r0, d) = (t.rows.rows(), chunk.c0, t.rows.r0, h.d);
    h.product(p, r0, br, c0, cols);
    let full = t.rows.full(chunk);
    for i in 0..br {
        let row = &mut p[i * BC..i * BC + cols];
        // A row at lse = −∞ saw no key in any block; exp(z + ∞) would not be 0.
        if t.lse[i] == f32::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        let vis = chunk.visible(row, t.rows.row(i), full);
        let (seen, hidden) = row.split_at_mut(vis);
        fastmath::exp_scaled(seen, t.scale, t.lse[i]);
        hidden.fill(0.0);
    }
    let kernel = h.kernel;
    let dout = t.dout.row(r0);
    // dV += Pᵀ · dO
    let dv = Out::add(&mut g.dv[c0 * g.kld..], g.kld);
    product(kernel, (cols, d, br), dv, Operand::transposed(p, BC), dout);
    // dP = dO · Vᵀ (the columns up to the next multiple of 16, as for the scores)
    let n = cols.next_multiple_of(16);
    product(kernel, (br, n, d), Out::write(dp, BC), dout, vt.col(c0));
    for i in 0..br {
        let row = i * BC..i * BC + cols;
        fastmath::softmax_grad(&mut p[row.clone()], &dp[row], t.delta[i], t.scale);
    }
    // dQ += dS · K ; dK += dSᵀ · Q
    let (ds, dst) = (Operand::rows(p, BC), Operand::transposed(p, BC));
    let (dq, dk) = (&mut g.dq[r0 * g.qld..], &mut g.dk[c0 * g.kld..]);
    product(kernel, (br, d, cols), Out::add(dq, g.qld), ds, k.row(c0));
    product(kernel, (cols, d, br), Out::add(dk, g.kld), dst, h.q.row(r0));
}

#[cfg(test)]
mod tests {
    use super::Scratch;
    use ferrotron_config::{attention_scratch_per_thread, ModelConfig};

    /// What a worker of the backward sets up for blocks of a whole sequence is what the
    /// ledger counts per compute thread; smaller blocks (context parallelism) hold less, and
    /// so does the forward.
    #[test]
    fn a_workers_scratch_is_what_the_ledger_counts() {
        for (seq, hidden, heads) in [(128, 128, 4), (256, 512, 8), (200, 120, 3), (512, 768, 12)] {
            let model = ModelConfig {
                seq_len: seq,
                hidden,
                heads,
                kv_heads: heads,
                ..ModelConfig::default()
            };
            let (d, bound) = (
                model.head_dim(),
                attention_scratch_per_thread(&model) as usize,
            );
            assert_eq!(Scratch::new(seq, seq, d).bytes(), bound, "seq {seq} d {d}");
            assert!(Scratch::new(seq / 2, seq / 2, d).bytes() < bound);
            let forward = super::super::forward::scratch_bytes(seq, d);
            assert!(forward < bound, "forward {forward} against {bound}");
        }
    }
}
