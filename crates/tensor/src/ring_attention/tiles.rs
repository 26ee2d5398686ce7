//! The tiled kernels behind [`block_forward`] and [`block_backward`]: tiles of [`BR`] query
//! rows against chunks of up to [`BC`] keys, each product through [`micro::product`] (its
//! own kernel on AVX2, `gemm`'s elsewhere), the softmax on [`fastmath`]'s vector paths. This file holds what both directions share: the tiles,
//! the chunks and the score product.
//!
//! Where a chunk's key positions ascend (whole sequences, and both of the split's layouts),
//! the kernels work on prefixes: a tile's score product stops at the last key its latest
//! query sees, and each row's exponentials stop at its own last visible key, the rest of the
//! row set to 0 without an exponential. Chunks in any other order fall back to masking each
//! score by position. Tiles with no visible pair are skipped without a product. Under document
//! masking, keys before a query's document start are masked in its row (score −∞), and chunks
//! wholly before the documents of a tile's queries are skipped too.

use super::micro::{self, product, Head, Kernel, Rows};

mod backward;
mod forward;

pub use backward::block_backward;
pub use forward::block_forward;

#[cfg(doc)]
use crate::fastmath;

/// Query rows per tile.
pub(super) const BR: usize = ferrotron_config::ATTENTION_TILE_ROWS;
/// Keys per chunk: the widest score tile.
pub(super) const BC: usize = ferrotron_config::ATTENTION_TILE_KEYS;

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
pub(super) fn tile_full(q: (usize, usize), kv: (usize, usize)) -> bool {
    kv.1 <= q.0
}

/// The query rows of one tile: where they start, their positions and the range those span,
/// and under document masking each row's document start with the smallest and largest.
pub(super) struct QTile<'a> {
    /// First row of the tile.
    pub r0: usize,
    /// The rows' positions.
    pub pos: &'a [usize],
    /// Smallest and largest of them.
    pub range: (usize, usize),
    /// Each row's document start, and their smallest and largest (None: no documents).
    starts: Option<(&'a [usize], (usize, usize))>,
}

impl<'a> QTile<'a> {
    /// Tile `rt` (of [`BR`] rows) of queries at `q_pos` spanning `range`, with the document
    /// starts of the sequence's queries (`starts`, all of them) if masking.
    pub fn new(
        rt: usize,
        q_pos: &'a [usize],
        range: (usize, usize),
        starts: Option<&'a [usize]>,
    ) -> Self {
        let r0 = rt * BR;
        let br = BR.min(q_pos.len() - r0);
        let starts = starts.map(|s| {
            let s = &s[r0..r0 + br];
            (s, tile_ranges(s, br)[0])
        });
        QTile {
            r0,
            pos: &q_pos[r0..r0 + br],
            range,
            starts,
        }
    }

    /// Rows in the tile.
    pub fn rows(&self) -> usize {
        self.pos.len()
    }

    /// Row `i`'s (first visible key position, position).
    pub fn row(&self, i: usize) -> (usize, usize) {
        (self.starts.map_or(0, |(s, _)| s[i]), self.pos[i])
    }

    /// As [`KvChunk::cols`], also `None` when every key comes before every row's document.
    pub fn cols(&self, chunk: &KvChunk<'_>) -> Option<usize> {
        match self.starts {
            Some((_, (lo, _))) if chunk.range.1 < lo => None,
            _ => chunk.cols(self.range),
        }
    }

    /// Every pair of the tile with `chunk` is visible, so no score needs a mask.
    pub fn full(&self, chunk: &KvChunk<'_>) -> bool {
        let after_starts = self.starts.is_none_or(|(_, (_, hi))| chunk.range.0 >= hi);
        after_starts && tile_full(self.range, chunk.range)
    }
}

/// Up to [`BC`] consecutive keys of a block: where they start and their positions.
pub(super) struct KvChunk<'a> {
    /// First key of the chunk in the block.
    pub c0: usize,
    /// The chunk's key positions.
    pos: &'a [usize],
    /// Smallest and largest of them.
    pub range: (usize, usize),
    /// Whether the positions ascend, so the keys a query sees are a prefix.
    ascending: bool,
}

impl<'a> KvChunk<'a> {
    /// A block's keys in chunks of [`BC`].
    pub fn split(kv_pos: &'a [usize]) -> Vec<KvChunk<'a>> {
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
    pub fn cols(&self, q: (usize, usize)) -> Option<usize> {
        if tile_masked(q, self.range) {
            return None;
        }
        Some(if self.ascending {
            self.pos.partition_point(|&p| p <= q.1)
        } else {
            self.pos.len()
        })
    }

    /// The keys of `row` (a score row of this chunk) visible to the query at `qp` whose
    /// document starts at `start`, as a prefix length: for ascending keys the prefix of keys
    /// up to `qp`; otherwise every later key's score is set to −∞ (its exponential is 0) and
    /// the whole row is returned. Scores of keys before `start` are set to −∞ either way.
    pub fn visible(&self, row: &mut [f32], (start, qp): (usize, usize), full: bool) -> usize {
        if full {
            return row.len();
        }
        let end = if self.ascending {
            self.pos[..row.len()].partition_point(|&p| p <= qp)
        } else {
            for (z, &kp) in row.iter_mut().zip(self.pos) {
                if kp > qp {
                    *z = f32::NEG_INFINITY;
                }
            }
            row.len()
        };
        if start > 0 {
            for (z, &kp) in row[..end].iter_mut().zip(self.pos) {
                if kp < start {
                    *z = f32::NEG_INFINITY;
                }
            }
        }
        end
    }
}

/// The score product's operands: a query head's rows and its key/value head's `Kᵀ`, and the
/// kernel the products run on.
#[derive(Clone, Copy)]
pub(super) struct Scores<'a> {
    /// The query head's rows.
    pub q: Rows<'a>,
    /// `Kᵀ` of its key/value head.
    pub kt: &'a Head,
    /// Head dimension.
    pub d: usize,
    /// The kernel the products run on.
    pub kernel: Kernel,
}

impl Scores<'_> {
    /// `scores[br × cols] = Q[r0..r0+br] · K[c0..c0+cols]ᵀ` (row stride [`BC`]), unscaled; the
    /// columns up to the next multiple of 16 are written too (scores of `Kᵀ`'s zero padding
    /// or of keys past `cols`), and no one reads them.
    pub fn product(&self, scores: &mut [f32], r0: usize, br: usize, c0: usize, cols: usize) {
        let out = micro::Out::write(scores, BC);
        let n = cols.next_multiple_of(16);
        product(
            self.kernel,
            (br, n, self.d),
            out,
            self.q.row(r0),
            self.kt.col(c0),
        );
    }
}
