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
//! visible to query `i` iff `kv_pos[j] <= q_pos[i]`. Under document masking each query also
//! has the position its document starts at, and sees only keys from there on
//! ([`KvBlock::q_start`]): packed documents attend only within themselves. Tiles with no
//! visible pair are skipped without a matmul; that is what turns the zig-zag split's balanced
//! pair count into balanced work.
//!
//! Layouts (positions are shared by every batch row): `q, out: [b·q_len, heads·d]`,
//! `k, v: [b·kv_len, kv_heads·d]`, `lse, delta: [b, heads, q_len]`. Query head `i` reads
//! key/value head `i / (heads / kv_heads)`, as in [`crate::attention`].

use rayon::prelude::*;

#[cfg(test)]
mod document_tests;
mod split;
#[cfg(test)]
mod tests;

mod micro;
mod tiles;

pub use split::{block_flops, contiguous_positions, zigzag_positions, SplitError};
pub use tiles::{block_backward, block_forward};

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
}

/// One (query block, key/value block) pair of ring attention: the global positions of the
/// queries and of the keys (a key is visible to a query at or after it), where each query's
/// document starts under document masking, and the shape.
#[derive(Debug, Clone, Copy)]
pub struct KvBlock<'a> {
    /// Global positions of the queries within their sequences.
    pub q_pos: &'a [usize],
    /// Global positions of the keys and values.
    pub kv_pos: &'a [usize],
    /// Document masking: `[batch · q_len]`, the global position at which each query's
    /// document starts (query `i` of sequence `b` sees only keys at `q_start[b·q_len + i]`
    /// or later). None: every earlier key of the sequence is visible.
    pub q_start: Option<&'a [usize]>,
    /// The block's shape.
    pub shape: BlockShape,
}

impl<'a> KvBlock<'a> {
    /// A block under the plain causal mask (no document starts).
    pub fn causal(q_pos: &'a [usize], kv_pos: &'a [usize], shape: BlockShape) -> Self {
        KvBlock {
            q_pos,
            kv_pos,
            q_start: None,
            shape,
        }
    }

    /// The document starts of sequence `b`'s queries (None without document masking).
    pub(crate) fn starts_of(&self, b: usize) -> Option<&'a [usize]> {
        let n = self.shape.q_len;
        self.q_start.map(|s| &s[b * n..(b + 1) * n])
    }

    /// The kernels write through raw pointers and strided matmuls, so a wrong length must stop
    /// here rather than reach them.
    fn check(&self) {
        let sh = &self.shape;
        assert!(
            sh.kv_heads > 0 && sh.heads.is_multiple_of(sh.kv_heads),
            "heads {} not a multiple of kv_heads {}",
            sh.heads,
            sh.kv_heads
        );
        assert_eq!(self.q_pos.len(), sh.q_len, "q_pos length vs q_len");
        assert_eq!(self.kv_pos.len(), sh.kv_len, "kv_pos length vs kv_len");
        if let Some(s) = self.q_start {
            assert_eq!(
                s.len(),
                sh.batch * sh.q_len,
                "q_start length vs batch · q_len"
            );
            let own = s
                .iter()
                .enumerate()
                .all(|(r, &st)| st <= self.q_pos[r % sh.q_len]);
            assert!(own, "a query's document starts after the query");
        }
    }
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
