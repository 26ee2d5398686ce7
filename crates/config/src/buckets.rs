//! Gradient buckets and ZeRO pieces: the one bucket layout the engine reduces over and the
//! estimator and planner predict.
//!
//! Buckets group whole units (embedding, block, a block's experts, head) in **backward
//! order** — head first, embedding last — until they hold at least `bucket_elems` gradient
//! elements; under ZeRO-3 every unit is its own bucket, so a unit is gathered and reduced as
//! one piece. Experts are reduced over another group than dense units, so a bucket never
//! mixes the two. Rank `r` of the `N` ranks sharing a bucket of `n` elements owns
//! `[⌊r·n/N⌋, ⌊(r+1)·n/N⌋)` of it.

use std::ops::Range;

/// One unit of the flat buffer, as the bucket layout sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketUnit {
    /// Gradient elements of the unit on this rank.
    pub elems: u64,
    /// Whether the unit holds experts (reduced over the expert-data group).
    pub expert: bool,
}

/// One bucket: which units it holds and how many elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketSpan {
    /// Indices into the backward-ordered unit list; the last one's gradients close it.
    pub units: Range<usize>,
    /// Elements of the bucket.
    pub elems: u64,
    /// Whether the bucket holds experts.
    pub expert: bool,
}

/// Elements of a `bucket_mb` MB (10⁶ bytes) bucket of `elem_bytes`-byte gradients (at least 1).
pub fn bucket_elems(bucket_mb: f64, elem_bytes: usize) -> usize {
    ((bucket_mb * 1e6) as usize / elem_bytes.max(1)).max(1)
}

/// Groups `units`, given in **backward** order, into buckets (see the module docs).
pub fn bucket_units(
    units: &[BucketUnit],
    bucket_elems: u64,
    unit_buckets: bool,
) -> Vec<BucketSpan> {
    let mut out = Vec::new();
    let mut open: Option<BucketSpan> = None;
    for (k, u) in units.iter().enumerate() {
        // Expert and dense units are reduced over different groups: never one bucket.
        if let Some(b) = open.take_if(|b| b.expert != u.expert) {
            out.push(b);
        }
        let mut b = open.take().unwrap_or(BucketSpan {
            units: k..k,
            elems: 0,
            expert: u.expert,
        });
        b.units.end = k + 1;
        b.elems += u.elems;
        if unit_buckets || b.elems >= bucket_elems {
            out.push(b);
        } else {
            open = Some(b);
        }
    }
    out.extend(open);
    out
}

/// The piece of member `r` of `ranks` in a bucket of `n` elements, as offsets into the
/// bucket: `⌊r·n/N⌋ .. ⌊(r+1)·n/N⌋`.
pub fn piece(n: u64, r: usize, ranks: usize) -> Range<u64> {
    let (n, r, ranks) = (n as u128, r as u128, ranks.max(1) as u128);
    (r * n / ranks) as u64..((r + 1) * n / ranks) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(elems: u64) -> BucketUnit {
        BucketUnit {
            elems,
            expert: false,
        }
    }

    #[test]
    fn buckets_close_on_size_kind_and_zero3() {
        // Backward order: head 4160, block 1, block 0 (36992 each), embedding 4096.
        let units = [dense(4160), dense(36_992), dense(36_992), dense(4096)];
        let sizes = |b: Vec<BucketSpan>| b.iter().map(|b| b.elems).collect::<Vec<_>>();
        assert_eq!(
            sizes(bucket_units(&units, 12_500, false)),
            [41_152, 36_992, 4_096]
        );
        assert_eq!(bucket_units(&units, 12_500, false)[0].units, 0..2);
        assert_eq!(
            sizes(bucket_units(&units, 1, true)),
            [4160, 36_992, 36_992, 4096]
        );
        assert_eq!(sizes(bucket_units(&units, u64::MAX, false)), [82_240]);
        // Experts between dense blocks get buckets of their own however large the bucket.
        let expert = BucketUnit {
            elems: 10,
            expert: true,
        };
        let moe = [dense(5), expert, dense(5), expert, dense(5)];
        let b = bucket_units(&moe, u64::MAX, false);
        assert_eq!(
            b.iter()
                .map(|b| (b.units.clone(), b.expert))
                .collect::<Vec<_>>(),
            [
                (0..1, false),
                (1..2, true),
                (2..3, false),
                (3..4, true),
                (4..5, false)
            ]
        );
    }

    #[test]
    fn pieces_tile_a_bucket() {
        assert_eq!(piece(10, 0, 3), 0..3);
        assert_eq!(piece(10, 1, 3), 3..6);
        assert_eq!(piece(10, 2, 3), 6..10);
        assert_eq!(piece(u64::MAX, 1, 2), u64::MAX / 2..u64::MAX);
        assert_eq!(bucket_elems(0.05, 4), 12_500);
        assert_eq!(bucket_elems(0.0, 4), 1);
    }
}
