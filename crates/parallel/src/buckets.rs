//! Gradient buckets and ZeRO shards over the flat parameter buffer, laid out by the one bucket
//! function the estimator uses too ([`ferrotron_config::bucket_units`]).
//!
//! Buckets group whole units (embedding, block, head) in **backward order** — head first,
//! embedding last — until they hold at least `bucket_bytes` of gradients; each bucket is one
//! contiguous flat range because units are laid out in forward order. Under ZeRO-3 every unit
//! is its own bucket, so a unit is gathered and reduced as one piece.
//!
//! Every bucket is split among the `N` data-parallel ranks: rank `r` owns
//! `[a + ⌊r·n/N⌋, a + ⌊(r+1)·n/N⌋)` of a bucket `[a, a+n)`. A rank's shard is the union of its
//! pieces of every bucket, stored contiguously in bucket order (its *local* index space), so
//! optimizer states, master weights and (ZeRO-2/3) gradients of a rank are flat buffers of
//! `shard_len` elements. Without ZeRO every rank owns every bucket whole.
//!
//! Mixture-of-experts experts ([`Unit::Experts`]) are reduced over the replicas of this rank's
//! experts (`N/ep` of the `N` ranks, `GroupKind::ExpertDataCp`) instead of all `N`, so a
//! bucket never mixes them with dense units, and an expert bucket is split among the members
//! of that group. The `N` ranks are data × context parallel (index `dp·cp + cp_i`), and the
//! rank of data-parallel index `dp` holds the experts of index `dp % ep`: its piece of an
//! expert bucket is that of member `(dp / ep)·cp + cp_i`.

use std::ops::Range;

use ferrotron_config::{bucket_units, piece, BucketUnit};
use ferrotron_model::{ParamLayout, Unit};

/// One bucket.
#[derive(Debug, Clone)]
pub struct Bucket {
    /// Flat range of the bucket.
    pub range: Range<usize>,
    /// Units in the bucket, in backward order.
    pub units: Vec<Unit>,
    /// Flat range owned by each member of the bucket's group (data-parallel ranks, or
    /// expert-data ranks for an expert bucket).
    pub pieces: Vec<Range<usize>>,
    /// Whether the bucket holds experts (reduced over the expert-data group).
    pub experts: bool,
}

/// Buckets and shards of one layout for one data-parallel degree.
#[derive(Debug, Clone)]
pub struct BucketPlan {
    /// Buckets in backward order (the order their reductions start).
    pub buckets: Vec<Bucket>,
    /// Data-parallel degree the pieces are cut for.
    pub ranks: usize,
    /// Whether ranks own pieces (ZeRO ≥ 1) or every rank owns every bucket whole.
    pub sharded: bool,
    /// Expert-parallel degree: expert buckets are split among `ranks / ep` members.
    pub ep: usize,
    /// Context-parallel degree (`ranks` counts data × context parallel ranks).
    pub cp: usize,
}

impl BucketPlan {
    /// Plans buckets of at least `bucket_elems` elements (one unit per bucket when
    /// `unit_buckets`), split among `ranks` when `sharded`.
    pub fn new(
        layout: &ParamLayout,
        bucket_elems: usize,
        ranks: usize,
        sharded: bool,
        unit_buckets: bool,
    ) -> Self {
        Self::with_experts(layout, bucket_elems, ranks, (1, 1), sharded, unit_buckets)
    }

    /// Like [`BucketPlan::new`], with expert parallelism of degree `ep` over `ranks = dp·cp`
    /// data × context parallel ranks (`(ep, cp)`): expert buckets are split among the
    /// `ranks / ep` replicas of each rank's experts.
    pub fn with_experts(
        layout: &ParamLayout,
        bucket_elems: usize,
        ranks: usize,
        (ep, cp): (usize, usize),
        sharded: bool,
        unit_buckets: bool,
    ) -> Self {
        let backward: Vec<Unit> = layout.units().into_iter().rev().collect();
        let sizes: Vec<BucketUnit> = backward
            .iter()
            .map(|&u| BucketUnit {
                elems: layout.unit_range(u).len() as u64,
                expert: ParamLayout::is_expert_unit(u),
            })
            .collect();
        let buckets = bucket_units(&sizes, bucket_elems as u64, unit_buckets)
            .into_iter()
            .map(|span| {
                let units = backward[span.units.clone()].to_vec();
                // Backward order walks the flat buffer from the end.
                let first = layout.unit_range(units[units.len() - 1]).start;
                let range = first..layout.unit_range(units[0]).end;
                let members = if span.expert { ranks / ep } else { ranks };
                Self::bucket(range, units, span.expert, members, sharded)
            })
            .collect();
        BucketPlan {
            buckets,
            ranks,
            sharded,
            ep,
            cp,
        }
    }

    fn bucket(
        range: Range<usize>,
        units: Vec<Unit>,
        experts: bool,
        ranks: usize,
        sharded: bool,
    ) -> Bucket {
        let n = range.len() as u64;
        let pieces = (0..ranks)
            .map(|r| {
                if sharded {
                    let p = piece(n, r, ranks);
                    range.start + p.start as usize..range.start + p.end as usize
                } else {
                    range.clone()
                }
            })
            .collect();
        Bucket {
            range,
            units,
            pieces,
            experts,
        }
    }

    /// The index in bucket `k`'s group of the rank with index `r` among the `ranks`: `r`, or
    /// for an expert bucket its index among the replicas of its experts.
    pub fn member(&self, k: usize, r: usize) -> usize {
        if self.buckets[k].experts {
            let (dp, cp) = (r / self.cp, r % self.cp);
            dp / self.ep * self.cp + cp
        } else {
            r
        }
    }

    /// The bucket holding `unit`.
    pub fn bucket_of(&self, unit: Unit) -> usize {
        self.buckets
            .iter()
            .position(|b| b.units.contains(&unit))
            .expect("every unit is in a bucket")
    }

    /// Elements data-parallel rank `r` owns.
    pub fn shard_len(&self, r: usize) -> usize {
        (0..self.buckets.len())
            .map(|k| self.buckets[k].pieces[self.member(k, r)].len())
            .sum()
    }

    /// Data-parallel rank `r`'s pieces: (bucket index, flat range, local offset in the shard
    /// buffer).
    pub fn pieces(&self, r: usize) -> Vec<(usize, Range<usize>, usize)> {
        let mut offset = 0;
        self.buckets
            .iter()
            .enumerate()
            .map(|(k, b)| {
                let piece = b.pieces[self.member(k, r)].clone();
                let at = offset;
                offset += piece.len();
                (k, piece, at)
            })
            .collect()
    }

    /// Lengths of every group member's piece of bucket `k` (the counts of its reduce-scatter
    /// and all-gather).
    pub fn counts(&self, k: usize) -> Vec<usize> {
        self.buckets[k].pieces.iter().map(|p| p.len()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_config::ModelConfig;

    #[test]
    fn buckets_tile_the_buffer_in_backward_order_and_shards_partition_it() {
        let cfg = ModelConfig {
            layers: 3,
            ..ModelConfig::default()
        };
        let layout = ParamLayout::new(&cfg);
        for (elems, unit_buckets) in [(1, false), (200_000, false), (usize::MAX, false), (1, true)]
        {
            let plan = BucketPlan::new(&layout, elems, 3, true, unit_buckets);
            let mut end = layout.total;
            for b in &plan.buckets {
                assert_eq!(b.range.end, end);
                end = b.range.start;
                let covered: usize = b.pieces.iter().map(|p| p.len()).sum();
                assert_eq!(covered, b.range.len());
            }
            assert_eq!(end, 0);
            assert_eq!(
                (0..3).map(|r| plan.shard_len(r)).sum::<usize>(),
                layout.total
            );
            assert_eq!(
                plan.buckets.last().unwrap().units.last(),
                Some(&Unit::Embed)
            );
        }
        assert_eq!(BucketPlan::new(&layout, 1, 2, true, true).buckets.len(), 5);
        assert_eq!(
            BucketPlan::new(&layout, usize::MAX, 2, true, false)
                .buckets
                .len(),
            1
        );
        let whole = BucketPlan::new(&layout, 1, 4, false, false);
        assert_eq!(whole.shard_len(2), layout.total);
    }

    #[test]
    fn expert_buckets_are_separate_and_split_over_the_expert_data_group() {
        let cfg = ModelConfig {
            layers: 4,
            experts: 4,
            moe_every: 2,
            ..ModelConfig::default()
        };
        let layout = ParamLayout::new(&cfg);
        // One bucket would hold everything: experts still get buckets of their own.
        let plan = BucketPlan::with_experts(&layout, usize::MAX, 4, (2, 1), true, false);
        for b in &plan.buckets {
            let experts = b
                .units
                .iter()
                .filter(|u| matches!(u, Unit::Experts(_)))
                .count();
            assert!(experts == 0 || experts == b.units.len(), "{:?}", b.units);
            assert_eq!(b.experts, experts > 0);
            // Expert buckets: 4 / 2 expert-data members.
            assert_eq!(b.pieces.len(), if b.experts { 2 } else { 4 });
        }
        assert_eq!(plan.buckets.len(), 5);
        // Data-parallel ranks 0 and 1 (expert-data index 0) own the same expert pieces.
        let experts_of = |r: usize| -> Vec<std::ops::Range<usize>> {
            plan.pieces(r)
                .into_iter()
                .filter(|(k, _, _)| plan.buckets[*k].experts)
                .map(|(_, range, _)| range)
                .collect()
        };
        assert_eq!(experts_of(0), experts_of(1));
        assert_ne!(experts_of(0), experts_of(2));
        let expert_elems: usize = experts_of(0)
            .iter()
            .chain(&experts_of(2))
            .map(|r| r.len())
            .sum();
        assert_eq!(expert_elems, cfg.num_expert_params());
    }
}
