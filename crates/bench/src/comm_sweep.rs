//! `bench-comm`'s measurement: collective bandwidth over a sweep of message sizes, as
//! nccl-tests reports it (algorithm and bus bandwidth), on ranks as threads or any
//! communicator, and the summary the planner's `cpu-local` profile caches.

use std::time::Duration;

use ferrotron_comm::bench::{bench_collective, BenchPoint, CollectiveKind};
use ferrotron_comm::{run_ranks, Comm, CommError};
use ferrotron_config::ParallelConfig;

use crate::comm_cache::{MeasuredComm, MIN_BANDWIDTH_BYTES};

/// Every point of the sweep on `ranks` ranks as threads of this process (rank 0's).
///
/// # Errors
///
/// A collective that failed, or `ranks` = 0.
pub fn on_threads(ranks: usize, sizes: Sizes) -> Result<Vec<BenchPoint>, crate::BenchError> {
    if ranks == 0 {
        return Err(crate::BenchError::Failed(
            "--ranks must be at least 1".into(),
        ));
    }
    let group: Vec<usize> = (0..ranks).collect();
    let mut results = run_ranks(ranks, Duration::from_secs(600), |ctx| {
        let comm = ctx.own_comm()?;
        measure(&comm, &group, sizes)
    })
    .map_err(|e| crate::BenchError::Failed(e.to_string()))?;
    Ok(results.swap_remove(0))
}

/// The collectives a sweep measures.
const KINDS: [CollectiveKind; 5] = [
    CollectiveKind::AllReduce,
    CollectiveKind::AllGather,
    CollectiveKind::ReduceScatter,
    CollectiveKind::AllToAll,
    CollectiveKind::Broadcast,
];

/// The message sizes of a sweep: from `min_bytes` (at least 4) to `max_bytes`, each
/// `factor` (at least 2) times the last.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Smallest message in bytes.
    pub min_bytes: usize,
    /// Largest message in bytes.
    pub max_bytes: usize,
    /// Size multiplier between points.
    pub factor: usize,
}

impl Sizes {
    fn list(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut s = self.min_bytes.max(4);
        while s <= self.max_bytes {
            out.push(s);
            s *= self.factor.max(2);
        }
        out
    }
}

/// Iterations per size: many for small messages, few for large ones.
fn iters(bytes: usize) -> usize {
    ((64 << 20) / bytes.max(1)).clamp(3, 200)
}

/// Runs every collective at every size on `comm` (one rank of `group`; every rank calls it).
///
/// # Errors
///
/// A collective that failed.
pub fn measure(comm: &Comm, group: &[usize], sizes: Sizes) -> Result<Vec<BenchPoint>, CommError> {
    let mut points = Vec::new();
    for kind in KINDS {
        for bytes in sizes.list() {
            points.push(bench_collective(comm, group, kind, bytes, iters(bytes))?);
        }
    }
    Ok(points)
}

/// The table rows of `points` (collective, ranks, size, µs, algbw, busbw).
pub fn rows(points: &[BenchPoint]) -> Vec<String> {
    points
        .iter()
        .map(|p| {
            format!(
                "| {} | {} | {} | {:.1} | {:.3} | {:.3} |",
                p.kind.name(),
                p.ranks,
                human(p.bytes),
                p.time_s * 1e6,
                p.algbw_gbps,
                p.busbw_gbps
            )
        })
        .collect()
}

/// Messages at most this large measure a collective's fixed time rather than its bandwidth.
const MAX_LATENCY_BYTES: usize = 4 << 10;

/// What the planner's `cpu-local` profile needs: each collective's bus bandwidth at the
/// measured size nearest the engine's default gradient bucket (`parallel.bucket_mb`; on a
/// CPU the rate depends on whether messages stay in cache, so the size the engine mostly
/// sends decides) and the fixed time of small messages (`latency_us`); `None` unless the sweep
/// reached [`MIN_BANDWIDTH_BYTES`].
pub fn summarise(points: &[BenchPoint]) -> Option<MeasuredComm> {
    let largest = points.iter().map(|p| p.bytes).max()?;
    let ranks = points.first()?.ranks;
    if largest < MIN_BANDWIDTH_BYTES || ranks < 2 {
        return None;
    }
    let bucket = (ParallelConfig::default().bucket_mb * 1e6) as usize;
    let size = points
        .iter()
        .map(|p| p.bytes)
        .min_by_key(|b| b.abs_diff(bucket))?;
    let at = |kind: CollectiveKind, bytes: usize| {
        points
            .iter()
            .filter(|p| p.kind == kind)
            .min_by_key(|p| p.bytes.abs_diff(bytes))
    };
    let bw = |kind| at(kind, size).map(|p: &BenchPoint| p.busbw_gbps);
    Some(MeasuredComm {
        ranks,
        bytes: size,
        all_reduce_gbps: bw(CollectiveKind::AllReduce)?,
        all_gather_gbps: bw(CollectiveKind::AllGather)?,
        reduce_scatter_gbps: bw(CollectiveKind::ReduceScatter)?,
        all_to_all_gbps: bw(CollectiveKind::AllToAll)?,
        broadcast_gbps: bw(CollectiveKind::Broadcast)?,
        latency_us: latency_us(points),
    })
}

/// The fixed time of a collective: the median time of every collective's messages of at
/// most 4 KiB (one size's median alone moved from 9 to 70 µs between two runs here, as a
/// rank happened to sleep or spin), 0 without such messages.
fn latency_us(points: &[BenchPoint]) -> f64 {
    let mut small: Vec<f64> = points
        .iter()
        .filter(|p| p.bytes <= MAX_LATENCY_BYTES)
        .map(|p| p.time_s * 1e6)
        .collect();
    small.sort_by(f64::total_cmp);
    match small.len() {
        0 => 0.0,
        n if n % 2 == 1 => small[n / 2],
        n => 0.5 * (small[n / 2 - 1] + small[n / 2]),
    }
}

/// `b` bytes in B, KiB or MiB.
fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(kind: CollectiveKind, bytes: usize, time_s: f64) -> BenchPoint {
        BenchPoint {
            kind,
            ranks: 2,
            bytes,
            iters: 10,
            time_s,
            algbw_gbps: 0.0,
            busbw_gbps: 0.0,
        }
    }

    /// The latency is the median over every collective's messages of at most 4 KiB; larger
    /// ones are left out; none gives 0.
    #[test]
    fn the_latency_is_the_median_of_the_small_messages() {
        let mut points = vec![
            point(CollectiveKind::AllReduce, 1024, 70e-6),
            point(CollectiveKind::AllGather, 4096, 30e-6),
            point(CollectiveKind::ReduceScatter, 1024, 10e-6),
            point(CollectiveKind::AllReduce, 16384, 5e-3),
        ];
        assert!((latency_us(&points) - 30.0).abs() < 1e-9);
        points.push(point(CollectiveKind::AllToAll, 1024, 50e-6));
        assert!((latency_us(&points) - 40.0).abs() < 1e-9);
        assert_eq!(latency_us(&points[3..4]), 0.0);
    }
}
