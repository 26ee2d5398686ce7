//! The engine's ZeRO shard arithmetic over this estimator's units, through the one bucket
//! layout the engine runs ([`ferrotron_config::bucket_units`]): buckets group whole units in
//! backward order until they hold at least `bucket_elems` elements (one unit per bucket under
//! ZeRO-3), never mixing experts with dense units; rank `r` of `N` owns
//! `[a + ⌊r·n/N⌋, a + ⌊(r+1)·n/N⌋)` of every bucket `[a, a+n)`.

use ferrotron_config::{bucket_units, BucketSpan, BucketUnit};

/// The buckets of a stage whose units (forward order) hold `(dense, expert)` elements, in
/// backward order, each with the backward-order index of the unit whose gradients close it.
///
/// A unit's experts follow its dense part in forward order (the engine's `Experts(l)` after
/// `Block(l)`), so in backward order they come first; empty parts are left out.
pub(crate) fn stage_buckets(
    elems_forward: &[(u64, u64)],
    bucket_elems: u64,
    unit_buckets: bool,
) -> Vec<(BucketSpan, usize)> {
    let mut units = Vec::new();
    let mut owner = Vec::new();
    for (k, &(dense, expert)) in elems_forward.iter().rev().enumerate() {
        for (elems, is_expert) in [(expert, true), (dense, false)] {
            if elems > 0 {
                units.push(BucketUnit {
                    elems,
                    expert: is_expert,
                });
                owner.push(k);
            }
        }
    }
    bucket_units(&units, bucket_elems.max(1), unit_buckets)
        .into_iter()
        .map(|b| {
            let closer = owner[b.units.end - 1];
            (b, closer)
        })
        .collect()
}

/// Largest number of elements any rank owns: `max_r Σ_buckets |piece(r)|`, which is
/// `Σ_buckets ⌈n/N⌉`. With `n = qN + m`, rank `r`'s piece has `q + ⌊(r+1)m/N⌋ − ⌊rm/N⌋`
/// elements, and the last rank (`r = N−1`) gets `q + m − ⌊m − m/N⌋ = q + 1` of every bucket
/// with `m > 0`: it attains the bound in every bucket at once. (Visiting every rank instead
/// took 77% of a 166 s plan on a million GPUs.)
fn max_owned(buckets: &[u64], ranks: u64) -> u64 {
    buckets.iter().map(|n| n.div_ceil(ranks.max(1))).sum()
}

/// Elements the largest shard holds of a stage whose units (forward order) hold `(dense,
/// expert)` elements, under ZeRO stage `zero` with buckets of `bucket_elems`: dense buckets
/// are split over `ranks.0` ranks, expert buckets over `ranks.1`. Without ZeRO every rank
/// owns everything.
pub(crate) fn stage_shard_elems(
    elems_forward: &[(u64, u64)],
    bucket_elems: u64,
    ranks: (usize, usize),
    zero: u8,
) -> u64 {
    let buckets = stage_buckets(elems_forward, bucket_elems, zero >= 3);
    if zero == 0 {
        return buckets.iter().map(|(b, _)| b.elems).sum();
    }
    let sizes = |expert: bool| -> Vec<u64> {
        buckets
            .iter()
            .filter(|(b, _)| b.expert == expert)
            .map(|(b, _)| b.elems)
            .collect()
    };
    max_owned(&sizes(false), ranks.0 as u64) + max_owned(&sizes(true), ranks.1 as u64)
}

/// Ψ_r of the rank owning the most: the elements of dense units `units_forward` (forward
/// order) that the largest shard holds when `ranks` data-parallel ranks share them under
/// ZeRO stage `zero` with buckets of `bucket_elems` elements.
pub fn max_shard_elems(units_forward: &[u64], bucket_elems: u64, ranks: usize, zero: u8) -> u64 {
    let elems: Vec<(u64, u64)> = units_forward.iter().map(|&n| (n, 0)).collect();
    stage_shard_elems(&elems, bucket_elems, (ranks, 1), zero)
}

/// The largest bucket of a stage, in elements (the transient reduction buffer of ZeRO-2/3).
pub(crate) fn largest_bucket(elems_forward: &[(u64, u64)], bucket_elems: u64, zero: u8) -> u64 {
    stage_buckets(elems_forward, bucket_elems, zero >= 3)
        .into_iter()
        .map(|(b, _)| b.elems)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dp_parity model of crates/train (hidden 64, 2 layers, heads 4, kv 2, ffn 128,
    /// vocab 64): embedding 4096, blocks 36992, head 64 + 4096.
    const UNITS: [u64; 4] = [4096, 36992, 36992, 4160];

    fn dense(units: &[u64]) -> Vec<(u64, u64)> {
        units.iter().map(|&n| (n, 0)).collect()
    }

    fn buckets(units: &[u64], bucket_elems: u64, unit_buckets: bool) -> Vec<u64> {
        stage_buckets(&dense(units), bucket_elems, unit_buckets)
            .into_iter()
            .map(|(b, _)| b.elems)
            .collect()
    }

    #[test]
    fn buckets_follow_backward_order() {
        // f32, 0.05 MB → 12500 elements: head + block 1, block 0, embedding.
        assert_eq!(buckets(&UNITS, 12_500, false), [41_152, 36_992, 4_096]);
        assert_eq!(buckets(&UNITS, 1, true), [4_160, 36_992, 36_992, 4_096]);
        assert_eq!(buckets(&UNITS, u64::MAX, false), [82_240]);
        // Closed by block 1 (backward index 1), block 0 (2) and the embedding (3).
        let closers: Vec<usize> = stage_buckets(&dense(&UNITS), 12_500, false)
            .into_iter()
            .map(|(_, k)| k)
            .collect();
        assert_eq!(closers, [1, 2, 3]);
        // A mixture of experts: block 1's experts close a bucket of their own before it.
        let moe = [(4096, 0), (100, 800), (100, 800), (4160, 0)];
        let spans: Vec<(u64, bool, usize)> = stage_buckets(&moe, u64::MAX, false)
            .into_iter()
            .map(|(b, k)| (b.elems, b.expert, k))
            .collect();
        assert_eq!(
            spans,
            [
                (4160, false, 0),
                (800, true, 1),
                (100, false, 1),
                (800, true, 2),
                (4196, false, 3)
            ]
        );
        assert_eq!(largest_bucket(&moe, u64::MAX, 1), 4196);
        // Dense pieces over 4 ranks, expert pieces over 2.
        assert_eq!(
            stage_shard_elems(&moe, u64::MAX, (4, 2), 1),
            1040 + 25 + 1049 + 800
        );
    }

    #[test]
    fn uneven_shards_are_exact() {
        // dp=3: pieces of 41152 are 13717/13717/13718, of 36992 12330/12331/12331, of 4096
        // 1365/1365/1366 → ranks own 27412, 27413, 27415 elements.
        assert_eq!(max_shard_elems(&UNITS, 12_500, 3, 1), 27_415);
        assert_eq!(max_shard_elems(&UNITS, 12_500, 3, 0), 82_240);
        // ZeRO-3, unit buckets: 4160 → 1387 max, 36992 → 12331, 4096 → 1366, but rank 2 holds
        // 1387 + 12331 + 12331 + 1366 = 27415 too.
        assert_eq!(max_shard_elems(&UNITS, 12_500, 3, 3), 27_415);
        assert_eq!(max_shard_elems(&UNITS, 12_500, 4, 2), 82_240 / 4);
        assert_eq!(largest_bucket(&dense(&UNITS), 12_500, 1), 41_152);
    }

    #[test]
    fn huge_groups_fall_back_to_a_tight_bound() {
        // Identical buckets: some rank gets the larger piece of every one, so the exact
        // maximum (300k ranks, visited) and the bound (400k ranks, not visited) are Σ⌈n/N⌉.
        let b = buckets(&[1_000_003u64; 200], 1, true);
        assert_eq!(max_owned(&b, 300_000), 200 * 4);
        assert_eq!(max_owned(&b, 400_000), 200 * 3);
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;
    use ferrotron_config::piece;

    /// The closed form equals the maximum over every rank of its pieces (`piece`, which the
    /// engine's ZeRO uses).
    #[test]
    fn the_closed_form_is_the_largest_rank_share() {
        let buckets = [1_000_003u64, 7, 65_536, 999_999_937, 12_345, 1];
        for ranks in [1usize, 2, 3, 7, 64, 1000, 4099] {
            let exact = (0..ranks)
                .map(|r| {
                    buckets
                        .iter()
                        .map(|&n| piece(n, r, ranks))
                        .map(|p| p.end - p.start)
                        .sum::<u64>()
                })
                .max()
                .unwrap();
            assert_eq!(max_owned(&buckets, ranks as u64), exact, "{ranks} ranks");
        }
    }
}
