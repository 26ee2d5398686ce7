//! The engine's ZeRO shard arithmetic as a pure function of unit sizes (crates/train
//! `buckets.rs`): buckets group whole units in backward order until they hold at least
//! `bucket_elems` elements (one unit per bucket under ZeRO-3); rank `r` of `N` owns
//! `[a + ⌊r·n/N⌋, a + ⌊(r+1)·n/N⌋)` of every bucket `[a, a+n)`.

/// Buckets for units given in **forward** order, in backward order, each as (elements,
/// backward-order index of the unit whose completion closes it). Empty units are skipped.
pub(crate) fn bucket_closers(
    units_forward: &[u64],
    bucket_elems: u64,
    unit_buckets: bool,
) -> Vec<(u64, usize)> {
    let mut out = Vec::new();
    let mut current: Option<(u64, usize)> = None;
    for (k, &n) in units_forward
        .iter()
        .rev()
        .enumerate()
        .filter(|(_, &n)| n > 0)
    {
        let len = current.take().map_or(0, |c| c.0) + n;
        if unit_buckets || len >= bucket_elems {
            out.push((len, k));
        } else {
            current = Some((len, k));
        }
    }
    out.extend(current);
    out
}

/// Bucket sizes (elements) for units given in forward order, in backward order.
pub(crate) fn buckets(units_forward: &[u64], bucket_elems: u64, unit_buckets: bool) -> Vec<u64> {
    bucket_closers(units_forward, bucket_elems, unit_buckets)
        .into_iter()
        .map(|b| b.0)
        .collect()
}

/// Piece of rank `r` of `ranks` in a bucket of `n` elements: `⌊(r+1)·n/N⌋ − ⌊r·n/N⌋`.
fn piece(n: u64, r: u64, ranks: u64) -> u64 {
    let (n, r, ranks) = (n as u128, r as u128, ranks as u128);
    ((r + 1) * n / ranks - r * n / ranks) as u64
}

/// Largest number of elements any rank owns: `max_r Σ_buckets piece(r)`. Exact (every rank
/// visited) while `ranks × buckets ≤ 2²⁶`; beyond that the bound `Σ ⌈n/N⌉`, which exceeds
/// the exact value by less than one element per bucket.
fn max_owned(buckets: &[u64], ranks: u64) -> u64 {
    if ranks <= 1 {
        return buckets.iter().sum();
    }
    if ranks.saturating_mul(buckets.len() as u64) > 1 << 26 {
        return buckets.iter().map(|n| n.div_ceil(ranks)).sum();
    }
    (0..ranks)
        .map(|r| buckets.iter().map(|&n| piece(n, r, ranks)).sum::<u64>())
        .max()
        .unwrap_or(0)
}

/// Ψ_r of the rank owning the most: the elements of units `units_forward` (forward order)
/// that the largest shard holds when `ranks` data-parallel ranks share them under ZeRO stage
/// `zero` with buckets of `bucket_elems` elements. Without ZeRO every rank owns everything.
pub fn max_shard_elems(units_forward: &[u64], bucket_elems: u64, ranks: usize, zero: u8) -> u64 {
    if zero == 0 || ranks <= 1 {
        return units_forward.iter().sum();
    }
    let b = buckets(units_forward, bucket_elems.max(1), zero >= 3);
    max_owned(&b, ranks as u64)
}

/// The largest bucket, in elements (the transient reduction buffer of ZeRO-2/3).
pub(crate) fn largest_bucket(units_forward: &[u64], bucket_elems: u64, zero: u8) -> u64 {
    buckets(units_forward, bucket_elems.max(1), zero >= 3)
        .into_iter()
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dp_parity model of crates/train (hidden 64, 2 layers, heads 4, kv 2, ffn 128,
    /// vocab 64): embedding 4096, blocks 36992, head 64 + 4096.
    const UNITS: [u64; 4] = [4096, 36992, 36992, 4160];

    #[test]
    fn buckets_follow_backward_order() {
        // f32, 0.05 MB → 12500 elements: head + block 1, block 0, embedding.
        assert_eq!(buckets(&UNITS, 12_500, false), [41_152, 36_992, 4_096]);
        assert_eq!(buckets(&UNITS, 1, true), [4_160, 36_992, 36_992, 4_096]);
        assert_eq!(buckets(&UNITS, u64::MAX, false), [82_240]);
        // Closed by block 1 (backward index 1), block 0 (2) and the embedding (3).
        assert_eq!(
            bucket_closers(&UNITS, 12_500, false),
            [(41_152, 1), (36_992, 2), (4_096, 3)]
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
        assert_eq!(largest_bucket(&UNITS, 12_500, 1), 41_152);
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
