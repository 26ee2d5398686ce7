//! How a kernel is timed: on the rank's pool, beside the other ranks' pools running their
//! own copy, with the pool threads' private caches emptied before every timed repeat.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use ferrotron_train::trainer::thread_pool;

/// `f(true)`'s result on a pool of `threads` threads while `ranks − 1` other pools of as many
/// threads run `f(false)` over and over: a rank's kernel timed as it runs in a step, beside
/// the other ranks' (ranks as threads share the cores, caches and memory bandwidth). The
/// flag says whether `f` is the timed call: the others run their kernel back to back,
/// without emptying the caches between repeats, so that they load the machine as a step's
/// kernels do.
pub(crate) fn contended<T: Send>(
    ranks: usize,
    threads: usize,
    f: impl Fn(bool) -> T + Sync,
) -> Result<T, crate::BenchError> {
    /// Stops the other ranks' loops however the timed call ends (a panic included).
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 1..ranks {
            s.spawn(|| {
                if let Ok(pool) = thread_pool(threads) {
                    pool.install(|| {
                        while !stop.load(Ordering::Relaxed) {
                            f(false);
                        }
                    });
                }
            });
        }
        let _stop = Stop(&stop);
        Ok(thread_pool(threads).map(|pool| pool.install(|| f(true)))?)
    })
}

/// Bytes each pool thread reads before a timed repeat: twice this CPU's L2 cache (sysfs;
/// 2 MiB per core when unknown), so that a kernel's operands come from the shared L3 or
/// memory, as in a step, where the kernels between two uses of a buffer have moved it out
/// of the core's own cache.
fn evict_bytes() -> usize {
    let l2 = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index2/size")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
            let n: usize = n.parse().ok()?;
            Some(match unit {
                "K" => n << 10,
                "M" => n << 20,
                _ => n,
            })
        })
        .unwrap_or(2 << 20);
    2 * l2.clamp(256 << 10, 64 << 20)
}

/// Moves the data of earlier repeats out of every pool thread's private caches: each thread
/// of the current pool reads a buffer of [`evict_bytes`] of its own.
struct Evict {
    buffers: Vec<Vec<u8>>,
}

impl Evict {
    fn new() -> Self {
        let n = evict_bytes();
        let threads = rayon::current_num_threads();
        Evict {
            buffers: (0..threads).map(|t| vec![t as u8 + 1; n]).collect(),
        }
    }

    fn run(&self) {
        let sums = rayon::broadcast(|ctx| {
            let buf = &self.buffers[ctx.index() % self.buffers.len()];
            buf.iter()
                .step_by(64)
                .fold(0u64, |a, &b| a.wrapping_add(b as u64))
        });
        std::hint::black_box(sums);
    }
}

/// Median seconds of `f` over repeats filling about `budget_s` (at least 3, after a warm-up);
/// with `evict`, each begun with the pool's private caches emptied of its operands
/// ([`Evict`]).
pub(super) fn median_time(budget_s: f64, evict: bool, mut f: impl FnMut()) -> f64 {
    median_time_fresh(budget_s, evict, || (), |_| f())
}

/// [`median_time`] of `f` on outputs that `alloc` allocates before every repeat, untimed:
/// the engine allocates each kernel's outputs zero-filled just before the kernel (the
/// allocator's `memset` leaves their lines in the allocating core's cache, and writing
/// them from the pool's threads then costs more than writing a buffer reused from the
/// shared cache: 10–40% of a tiny GEMM's time here). The filling itself is costed apart
/// (`KernelRates::zero_fill`).
pub(super) fn median_time_fresh<P>(
    budget_s: f64,
    evict: bool,
    mut alloc: impl FnMut() -> P,
    mut f: impl FnMut(&mut P),
) -> f64 {
    let evict = evict.then(Evict::new);
    let mut timed = |e: &Option<Evict>| {
        if let Some(e) = e {
            e.run();
        }
        let mut out = alloc();
        let t = Instant::now();
        f(&mut out);
        let s = t.elapsed().as_secs_f64();
        drop(out);
        s
    };
    timed(&evict);
    let once = timed(&evict).max(1e-7);
    let reps = ((budget_s / once) as usize).clamp(3, 200);
    let mut times: Vec<f64> = (0..reps).map(|_| timed(&evict)).collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
