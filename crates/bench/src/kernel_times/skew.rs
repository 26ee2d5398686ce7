//! The ranks' arrival skew: ranks as threads running the same work between two collectives
//! do not finish together (this machine's cores drift apart by several percent within
//! milliseconds, and a rank woken from a wait starts late), and every blocking collective
//! waits for the last one. Measured as the mean excess of the slowest rank's segment over
//! the ranks' mean segment, for segments of a few lengths.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use ferrotron_tensor::linear::linear_forward;
use ferrotron_train::trainer::thread_pool;

/// Segment lengths measured, in seconds: from a tiny model's norm between two gathers to
/// a small model's projection (longer segments take the longest's fraction).
const SEGMENTS_S: [f64; 4] = [0.0005, 0.002, 0.008, 0.032];

/// Seconds of repeats per segment length (`validate-cost` measures the skew again with every
/// timing of a layout's kernels, as it moves with this machine's load: 1% to 7% at 32 ms
/// here; `plan` uses the cached one).
const BUDGET_S: f64 = 0.5;

/// Whether `skew` holds a measurement of every one of [`SEGMENTS_S`], each a finite fraction
/// of 0 or more (a cache edited or damaged by hand is measured again).
pub(super) fn complete(skew: &[(f64, f64)]) -> bool {
    skew.len() == SEGMENTS_S.len()
        && skew
            .iter()
            .zip(SEGMENTS_S)
            .all(|(m, s)| m.0 == s && m.1.is_finite() && m.1 >= 0.0)
}

/// `(segment seconds, excess fraction)` for each of [`SEGMENTS_S`]: `ranks` ranks of
/// `threads` threads each start a segment together (after a barrier), run the same GEMMs for
/// about its length and record when they finish; the excess is the time from the first
/// start to the last finish over the ranks' mean time from their release, less one.
pub(super) fn arrival_skew(
    ranks: usize,
    threads: usize,
) -> Result<Vec<(f64, f64)>, crate::BenchError> {
    // One GEMM of 128 rows, 256 × 256: a fraction of a millisecond on one thread.
    let (t, d) = (128, 256);
    let once = {
        let pool = thread_pool(threads)?;
        let (x, w, mut y) = (
            vec![0.5f32; t * d],
            vec![0.25f32; d * d],
            vec![0.0f32; t * d],
        );
        pool.install(|| {
            linear_forward(&mut y, &x, &w, t, d, d);
            let start = Instant::now();
            for _ in 0..20 {
                linear_forward(&mut y, &x, &w, t, d, d);
            }
            start.elapsed().as_secs_f64() / 20.0
        })
    };
    let mut out = Vec::with_capacity(SEGMENTS_S.len());
    for seg in SEGMENTS_S {
        let reps = ((seg / once.max(1e-7)).round() as usize).max(1);
        let rounds = ((BUDGET_S / seg) as usize).clamp(16, 1000);
        let barrier = Barrier::new(ranks);
        // Every rank's pool built before any rank waits at the barrier: a rank that failed
        // to build one would leave the others waiting.
        let pools = (0..ranks)
            .map(|_| thread_pool(threads))
            .collect::<Result<Vec<_>, _>>()?;
        let per_rank: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|s| {
            let handles: Vec<_> = pools
                .iter()
                .map(|pool| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        let (x, w) = (vec![0.5f32; t * d], vec![0.25f32; d * d]);
                        let mut y = vec![0.0f32; t * d];
                        pool.install(|| {
                            (0..rounds + 1)
                                .map(|_| {
                                    barrier.wait();
                                    let start = Instant::now();
                                    for _ in 0..reps {
                                        linear_forward(&mut y, &x, &w, t, d, d);
                                    }
                                    (start, Instant::now())
                                })
                                .collect::<Vec<_>>()
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().map_err(|_| {
                        crate::BenchError::Failed(
                            "a rank failed while measuring the arrival skew".into(),
                        )
                    })
                })
                .collect::<Result<Vec<_>, crate::BenchError>>()
        })?;
        out.push((seg, excess(&per_rank)));
    }
    Ok(out)
}

/// Σ over rounds (first start to last end) ÷ Σ mean busy − 1, the first round (warm-up)
/// left out.
fn excess(per_rank: &[Vec<(Instant, Instant)>]) -> f64 {
    let rounds = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    let (mut wall, mut busy) = (Duration::ZERO, Duration::ZERO);
    for i in 1..rounds {
        let first = per_rank.iter().map(|r| r[i].0).min();
        let last = per_rank.iter().map(|r| r[i].1).max();
        if let (Some(first), Some(last)) = (first, last) {
            wall += last - first;
        }
        let sum: Duration = per_rank.iter().map(|r| r[i].1 - r[i].0).sum();
        busy += sum / per_rank.len() as u32;
    }
    if busy.is_zero() {
        return 0.0;
    }
    (wall.as_secs_f64() / busy.as_secs_f64() - 1.0).max(0.0)
}
