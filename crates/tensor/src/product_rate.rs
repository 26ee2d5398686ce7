//! The best rate a backend's products reached, per compute thread: the floor of a run's MFU
//! denominator, so that no measured peak below what the run's own products did (a peak taken
//! while the machine was busy) makes MFU read above 100%.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Products smaller than this many FLOPs are not timed: the clock's resolution would count
/// for too much of them.
pub const MIN_TIMED_FLOPS: f64 = (1u64 << 24) as f64;

/// The best FLOP/s per thread seen so far (shared by every clone of a backend).
#[derive(Debug, Default)]
pub struct BestRate(AtomicU64);

impl BestRate {
    /// Runs `product` (of `flops` FLOPs on `threads` threads), timing it where it is large
    /// enough, and keeps its rate per thread if it is the best so far.
    pub fn time<R>(&self, flops: f64, threads: usize, product: impl FnOnce() -> R) -> R {
        if flops < MIN_TIMED_FLOPS {
            return product();
        }
        let start = Instant::now();
        let out = product();
        let seconds = start.elapsed().as_secs_f64();
        if seconds > 0.0 {
            self.offer(flops / seconds / threads.max(1) as f64);
        }
        out
    }

    /// Keeps `rate` (FLOP/s per thread) if it beats the best so far.
    pub fn offer(&self, rate: f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                (rate > f64::from_bits(old)).then_some(rate.to_bits())
            });
    }

    /// The best FLOP/s per thread (None before any timed product).
    pub fn best(&self) -> Option<f64> {
        let v = f64::from_bits(self.0.load(Ordering::Relaxed));
        (v > 0.0).then_some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_rate_per_thread_is_kept() {
        let r = BestRate::default();
        assert_eq!(r.best(), None);
        r.offer(5e9);
        r.offer(3e9);
        assert_eq!(r.best(), Some(5e9));
        // A product too small to time leaves it alone.
        assert_eq!(r.time(1e6, 1, || 7), 7);
        assert_eq!(r.best(), Some(5e9));
        // A timed one of 2³⁰ FLOPs on 2 threads: its rate per thread is at most its FLOPs
        // over 2 × the time it took, measured around it.
        let outer = Instant::now();
        r.time(2f64.powi(30), 2, || {
            std::thread::sleep(std::time::Duration::from_millis(20))
        });
        let bound = 2f64.powi(30) / 2.0 / outer.elapsed().as_secs_f64();
        let best = r.best().unwrap();
        assert!(best >= bound && best < 2f64.powi(30) / 2.0 / 0.02, "{best}");
    }
}
