//! Collective benchmark with bandwidths as nccl-tests defines them (its `doc/PERFORMANCE.md`).
//!
//! - Size `S`: bytes of the whole array the collective works on. For all-reduce and
//!   broadcast that is each rank's buffer. For all-gather it is the gathered output
//!   (`sendcount · n` elements), for reduce-scatter the input being reduced
//!   (`recvcount · n`), for all-to-all each rank's send buffer (`n` blocks).
//! - Algorithm bandwidth `algbw = S / t`.
//! - Bus bandwidth `busbw = algbw · factor`, the factor reflecting the traffic each rank's
//!   link must carry so that the number compares to the hardware's peak whatever `n`:
//!   all-reduce `2(n−1)/n`; all-gather, reduce-scatter and all-to-all `(n−1)/n`;
//!   broadcast 1.
//! - GB/s are 10⁹ bytes per second.
//!
//! Elements are f32. `t` is the median over the timed iterations of this rank's wall time
//! for one operation (nccl-tests reports the mean; the median resists stragglers on a
//! shared CPU); a barrier precedes every iteration so that members start together.

use std::time::Instant;

use crate::buf::CommBuf;
use crate::comm::Comm;
use crate::error::CommError;
use crate::op::ReduceOp;

/// The collectives the benchmark measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// Sum all-reduce.
    AllReduce,
    /// Even all-gather.
    AllGather,
    /// Even reduce-scatter.
    ReduceScatter,
    /// Broadcast from group index 0.
    Broadcast,
    /// Even all-to-all.
    AllToAll,
}

impl CollectiveKind {
    /// Name as in nccl-tests' binaries: `all_reduce`, `all_gather`, ...
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::AllToAll => "all_to_all",
        }
    }

    /// `busbw / algbw` for a group of `n` ranks (0 for an empty group).
    pub fn bus_factor(self, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let ring = (n - 1) as f64 / n as f64;
        match self {
            CollectiveKind::AllReduce => 2.0 * ring,
            CollectiveKind::AllGather
            | CollectiveKind::ReduceScatter
            | CollectiveKind::AllToAll => ring,
            CollectiveKind::Broadcast => 1.0,
        }
    }
}

/// One measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BenchPoint {
    /// What was measured.
    pub kind: CollectiveKind,
    /// Group size.
    pub ranks: usize,
    /// Size `S` actually used, in bytes (the request rounded down to whole f32 elements,
    /// split evenly over the members where the collective splits it; at least one element
    /// per member).
    pub bytes: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median seconds per operation.
    pub time_s: f64,
    /// `S / time_s` in GB/s.
    pub algbw_gbps: f64,
    /// `algbw · bus_factor(n)` in GB/s.
    pub busbw_gbps: f64,
}

/// Measures `kind` on `group` (this rank must be a member; every member calls this with
/// the same arguments) with size `S ≈ bytes` (see the module documentation), after one
/// untimed warm-up iteration.
pub fn bench_collective(
    comm: &Comm,
    group: impl AsRef<[usize]>,
    kind: CollectiveKind,
    bytes: usize,
    iters: usize,
) -> Result<BenchPoint, CommError> {
    let group = group.as_ref();
    let n = group.len();
    if iters == 0 || n == 0 {
        return Err(CommError::InvalidArgument {
            op: "bench",
            message: format!(
                "need at least one iteration and one member (iters={iters}, group {group:?})"
            ),
        });
    }
    let elems = match kind {
        CollectiveKind::AllReduce | CollectiveKind::Broadcast => (bytes / 4).max(1),
        _ => (bytes / 4 / n).max(1) * n,
    };
    let per = elems / n;
    let ledger = comm.ledger();
    let mut times = Vec::with_capacity(iters.min(1 << 16));
    for it in 0..=iters {
        let len = if kind == CollectiveKind::AllGather {
            per
        } else {
            elems
        };
        let input = CommBuf::from_f32_slice(ledger, &vec![1.0; len]);
        comm.barrier(group).wait()?;
        let start = Instant::now();
        match kind {
            CollectiveKind::AllReduce => comm.all_reduce(group, input, ReduceOp::Sum).wait(),
            CollectiveKind::AllGather => comm.all_gather(group, input, vec![per; n]).wait(),
            CollectiveKind::ReduceScatter => comm.reduce_scatter(group, input, vec![per; n]).wait(),
            CollectiveKind::Broadcast => comm.broadcast(group, input, 0).wait(),
            CollectiveKind::AllToAll => comm
                .all_to_all(group, input, vec![per; n], vec![per; n])
                .wait(),
        }?;
        if it > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let time_s = median(&mut times).max(f64::MIN_POSITIVE);
    let size = elems * 4;
    let algbw_gbps = size as f64 / time_s / 1e9;
    Ok(BenchPoint {
        kind,
        ranks: n,
        bytes: size,
        iters,
        time_s,
        algbw_gbps,
        busbw_gbps: algbw_gbps * kind.bus_factor(n),
    })
}

/// Median (mean of the two middle values for an even count); 0 for none.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        l if l % 2 == 1 => v[l / 2],
        l => (v[l / 2 - 1] + v[l / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(CollectiveKind::AllReduce.bus_factor(4), 1.5);
        assert_eq!(CollectiveKind::AllReduce.bus_factor(1), 0.0);
        assert_eq!(CollectiveKind::AllGather.bus_factor(8), 0.875);
        assert_eq!(CollectiveKind::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(CollectiveKind::AllToAll.bus_factor(4), 0.75);
        assert_eq!(CollectiveKind::Broadcast.bus_factor(8), 1.0);
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
