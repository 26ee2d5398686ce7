//! Data-parallel and ZeRO communication against the compute it hides behind, unit by unit.
//!
//! A pass walks the stage's units (forward order, or backward order for backward) on a
//! compute stream while one communication stream runs the collectives in issue order:
//! ZeRO-3 gathers unit `u+1` as soon as unit `u` starts (prefetch), the first gather is
//! exposed; a bucket's reduction (all-reduce for ZeRO-0, reduce-scatter otherwise) starts
//! when the unit that closes it has finished its backward (the engine's buckets, `crates/config/src/buckets.rs`). The exposed time of a pass is its length minus its compute. So the last
//! bucket — the embedding's, as nothing follows it in backward — is never hidden.

use crate::shard::stage_buckets;

/// A data-parallel group: size and bus bandwidths (bytes/s).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Group {
    /// Ranks.
    pub n: f64,
    /// All-reduce bus bandwidth.
    pub all_reduce: f64,
    /// All-gather bus bandwidth.
    pub all_gather: f64,
    /// Reduce-scatter bus bandwidth.
    pub reduce_scatter: f64,
    /// Fixed seconds of one collective.
    pub latency: f64,
}

/// What one stage needs: per unit (forward order) compute seconds of one micro-batch, and
/// (dense, expert) elements; the two groups; bytes of a weight and of a reduced gradient.
pub(crate) struct Stage<'a> {
    pub fwd: &'a [f64],
    pub bwd: &'a [f64],
    pub elems: &'a [(u64, u64)],
    pub dense: Group,
    pub expert: Group,
    pub weight_bytes: f64,
    pub grad_bytes: f64,
    pub bucket_elems: u64,
    pub zero: u8,
    /// Whether reductions and gathers overlap compute at all (false: every second exposed).
    pub overlap: bool,
}

/// Seconds, busy and exposed, and bytes moved, per micro-batch and once per step.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DpCost {
    pub mb_busy: f64,
    pub mb_exposed: f64,
    pub mb_bytes: f64,
    pub step_busy: f64,
    pub step_exposed: f64,
    pub step_bytes: f64,
}

/// Length of a pass: `compute[u]` needs `gather[u]` done first (prefetched one unit ahead);
/// `reduce[u]` is issued once unit `u` is done. One stream each for compute and collectives.
fn pass(compute: &[f64], gather: &[f64], reduce: &[f64]) -> f64 {
    let n = compute.len();
    if n == 0 {
        return 0.0;
    }
    let mut comm_free = gather[0];
    let mut gather_end = comm_free;
    let mut comp_end: f64 = 0.0;
    for u in 0..n {
        let start = comp_end.max(gather_end);
        comp_end = start + compute[u];
        if u + 1 < n {
            gather_end = comm_free.max(start) + gather[u + 1];
            comm_free = gather_end;
        }
        if reduce[u] > 0.0 {
            comm_free = comm_free.max(comp_end) + reduce[u];
        }
    }
    comp_end.max(comm_free)
}

fn frac(n: f64) -> f64 {
    (n - 1.0) / n
}

/// The stage's data-parallel and ZeRO communication.
pub(crate) fn dp_cost(s: &Stage<'_>) -> DpCost {
    let n_units = s.fwd.len();
    let bwd_rev: Vec<f64> = s.bwd.iter().rev().copied().collect();
    let fwd_sum: f64 = s.fwd.iter().sum();
    let bwd_sum: f64 = s.bwd.iter().sum();
    let mut reduce = vec![0.0; n_units];
    let mut gather_fwd = vec![0.0; n_units];
    let mut all_gather_step = 0.0;
    let mut cost = DpCost::default();
    // Reductions: the engine's buckets (dense and expert ones, each over its own group).
    for (b, closer) in stage_buckets(s.elems, s.bucket_elems, s.zero >= 3) {
        let g = if b.expert { s.expert } else { s.dense };
        if g.n <= 1.0 {
            continue;
        }
        let k = b.elems as f64 * s.grad_bytes;
        let (bytes, secs) = if s.zero == 0 {
            (
                2.0 * frac(g.n) * k,
                g.latency + 2.0 * frac(g.n) * k / g.all_reduce,
            )
        } else {
            (frac(g.n) * k, g.latency + frac(g.n) * k / g.reduce_scatter)
        };
        reduce[closer] += secs;
        if s.zero >= 2 {
            cost.mb_bytes += bytes;
        } else {
            cost.step_bytes += bytes;
        }
    }
    // Weight gathers: per unit (ZeRO-3) or once per step (ZeRO-1/2), each part over its group.
    for (part, g) in [(0, s.dense), (1, s.expert)] {
        let sizes: Vec<u64> = s
            .elems
            .iter()
            .map(|e| if part == 0 { e.0 } else { e.1 })
            .collect();
        if g.n <= 1.0 || sizes.iter().all(|&x| x == 0) {
            continue;
        }
        let weights: f64 = sizes.iter().sum::<u64>() as f64 * s.weight_bytes;
        if s.zero >= 3 {
            for (u, &e) in sizes.iter().enumerate() {
                if e > 0 {
                    gather_fwd[u] +=
                        g.latency + frac(g.n) * e as f64 * s.weight_bytes / g.all_gather;
                }
            }
            cost.mb_bytes += 2.0 * frac(g.n) * weights;
        } else if s.zero >= 1 {
            all_gather_step += frac(g.n) * weights / g.all_gather;
            cost.step_bytes += frac(g.n) * weights;
        }
    }
    let reduce_sum: f64 = reduce.iter().sum();
    let gather_sum: f64 = gather_fwd.iter().sum();
    let gather_rev: Vec<f64> = gather_fwd.iter().rev().copied().collect();
    let zeros = vec![0.0; n_units];
    let (backward, forward) = if s.overlap {
        (
            pass(&bwd_rev, &gather_rev, &reduce) - bwd_sum,
            pass(s.fwd, &gather_fwd, &zeros) - fwd_sum,
        )
    } else {
        (reduce_sum + gather_sum, gather_sum)
    };
    match s.zero {
        0 | 1 => {
            cost.step_busy = reduce_sum + all_gather_step;
            cost.step_exposed = backward + all_gather_step;
        }
        2 => {
            cost.mb_busy = reduce_sum;
            cost.mb_exposed = backward;
            cost.step_busy = all_gather_step;
            cost.step_exposed = all_gather_step;
        }
        _ => {
            cost.mb_busy = 2.0 * gather_sum + reduce_sum;
            cost.mb_exposed = forward + backward;
        }
    }
    cost
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_hide_what_they_can() {
        // Reductions shorter than the following compute hide, except the last one.
        assert_eq!(pass(&[1.0, 1.0, 1.0], &[0.0; 3], &[0.5, 0.5, 0.5]), 3.5);
        // A slow stream queues: 0.5 + 2 + 2 + 2 after unit 0 ends at 1.
        assert_eq!(pass(&[1.0, 1.0, 1.0], &[0.0; 3], &[2.0, 2.0, 2.0]), 7.0);
        // Gathers: the first is exposed, the next prefetched behind compute.
        assert_eq!(pass(&[1.0, 1.0], &[0.25, 0.5], &[0.0; 2]), 2.25);
        assert_eq!(pass(&[1.0, 1.0], &[0.25, 2.0], &[0.0; 2]), 3.25);
    }
}
