//! The machine's matmul peak: the MFU denominator on a CPU is the measured throughput of the
//! f32 `gemm` kernel on this machine with the run's thread count, not a datasheet figure; for
//! a run whose products are bf16 (`train.matmul = "bf16"`), that of the bf16 products.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use ferrotron_config::Matmul;
use ferrotron_tensor::bf16_gemm::matmul_bf16;
use ferrotron_tensor::linear::{matmul, Mat, Threads};
use ferrotron_tensor::LinearShape;

/// The products a peak is measured on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Products {
    /// `gemm`'s f32 products: every run's denominator but those below.
    F32,
    /// The bf16 products of `train.matmul = "bf16"` (AVX-512 BF16).
    Bf16,
}

impl Products {
    /// The products whose peak is the denominator of a run on `matmul`.
    pub fn of(matmul: Matmul) -> Products {
        match matmul {
            Matmul::Bf16 => Products::Bf16,
            Matmul::Gemm | Matmul::OpenBlas => Products::F32,
        }
    }
}

/// Side of the square product [`measure_device_peak`] times: 137 GFLOP, milliseconds on a
/// data-centre GPU, well past a launch's latency.
pub const DEVICE_PEAK_SIZE: usize = 4096;

/// The GEMM peak of a device backend (a GPU's), FLOP/s: the median of `reps` forward products
/// `[n×n]·[n×n]ᵀ` ([`DEVICE_PEAK_SIZE`] for a run's MFU) with the products the backend runs (f32, or TF32
/// where the run allows it), on values spread over [-1, 1) (a GPU multiplies zeros faster),
/// each timed to the end of the device's work, after one untimed product. With bf16 products
/// that includes rounding both operands into the backend's scratch, as every product of such
/// a run does (the CPU's bf16 peak includes its rounding while packing too). Its buffers come
/// from a ledger of their own, freed before it returns, so the run's ledger never sees them.
/// `None` for a backend on host memory.
pub fn measure_device_peak(
    backend: &dyn ferrotron_tensor::Backend,
    n: usize,
    reps: usize,
) -> Option<f64> {
    use ferrotron_tensor::{Category, Ledger};
    let ledger = Ledger::on(backend.memory()?);
    let values: Vec<f32> = (0..n * n)
        .map(|i| (i % 2003) as f32 / 1001.5 - 1.0)
        .collect();
    let x = ledger.upload(Category::Workspace, "GEMM peak", &values);
    let w = ledger.upload(Category::Workspace, "GEMM peak", &values);
    let mut y = ledger.zeros::<f32>(Category::Workspace, n * n);
    let mut seconds = Vec::with_capacity(reps);
    for rep in 0..=reps {
        backend.synchronize();
        let start = Instant::now();
        backend.linear_forward(&mut y, x.operand(), w.operand(), LinearShape::new(n, n, n));
        backend.synchronize();
        if rep > 0 {
            seconds.push(start.elapsed().as_secs_f64());
        }
    }
    seconds.sort_by(f64::total_cmp);
    let median = seconds.get(seconds.len() / 2)?;
    Some(2.0 * (n * n * n) as f64 / median)
}

/// Side of the square matmul measured: large enough to reach the kernel's plateau.
pub const PEAK_SIZE: usize = 1536;

/// One measurement of the matmul peak, with how it was taken: whether other processes
/// competed for the cores (a peak measured under load reads low, and every MFU computed
/// against it then reads high) and how much its repeats varied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PeakMeasurement {
    /// Median FLOP/s of the repeats, in GFLOP/s.
    pub gflops: f64,
    /// Best repeat, GFLOP/s.
    pub best_gflops: f64,
    /// Repeats timed.
    pub reps: usize,
    /// The interquartile range of the repeats over their median.
    pub spread: f64,
    /// CPU time other processes (and the hypervisor, as steal) took during the
    /// measurement, as a share of every core's wall time.
    pub others_share: f64,
    /// When it was taken, seconds since the Unix epoch.
    pub taken_at: u64,
}

/// A measurement is quiet when other processes took under this share of the machine's
/// cores while it ran.
pub const QUIET_OTHERS: f64 = 0.05;
/// … and its repeats varied by less than this.
pub const QUIET_SPREAD: f64 = 0.10;

impl PeakMeasurement {
    /// Whether nothing competed with the measurement and its repeats agree.
    pub fn quiet(&self) -> bool {
        self.others_share < QUIET_OTHERS && self.spread < QUIET_SPREAD
    }

    /// The peak in FLOP/s.
    pub fn flops(&self) -> f64 {
        self.gflops * 1e9
    }

    /// How it was taken, for a person: "quiet (others 0.4% of the cores, spread 2.1%)".
    pub fn describe(&self) -> String {
        format!(
            "{} (other processes took {:.1}% of the cores, repeats' interquartile range {:.1}% of their median, {} repeats)",
            if self.quiet() { "quiet" } else { "NOT quiet" },
            100.0 * self.others_share,
            100.0 * self.spread,
            self.reps
        )
    }
}

/// Median FLOP/s of `reps` square f32 matmuls of side [`PEAK_SIZE`] on the current rayon pool.
pub fn measure_matmul_peak(reps: usize) -> f64 {
    measure_peak(reps).flops()
}

/// [`measure_matmul_peak`] of `products`.
pub fn measure_matmul_peak_of(products: Products, reps: usize) -> f64 {
    measure_peak_of(products, reps).flops()
}

/// Times `reps` square f32 matmuls of side [`PEAK_SIZE`] on the current rayon pool, watching
/// the machine's CPU time (`/proc/stat`) against this process's own for contention.
pub fn measure_peak(reps: usize) -> PeakMeasurement {
    measure_peak_of(Products::F32, reps)
}

/// [`measure_peak`] of `products` (the bf16 products only where the CPU has them).
pub fn measure_peak_of(products: Products, reps: usize) -> PeakMeasurement {
    let n = PEAK_SIZE;
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 97) as f32) * 0.01).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i % 89) as f32) * 0.01).collect();
    let mut c = vec![0.0f32; n * n];
    let (rows, shape) = (Mat::rows(n), (n, n, n));
    let run = |c: &mut [f32]| match products {
        Products::F32 => matmul(n, n, n, c, rows, false, &a, rows, &b, rows, Threads::Pool),
        Products::Bf16 => matmul_bf16(shape, c, n, false, &a, rows, &b, rows),
    };
    run(&mut c); // warm-up: page faults, packing buffers
    let (machine0, own0, start) = (machine_busy_seconds(), own_cpu_seconds(), Instant::now());
    let mut rates: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            run(&mut c);
            2.0 * (n * n * n) as f64 / t.elapsed().as_secs_f64()
        })
        .collect();
    let wall = start.elapsed().as_secs_f64();
    let others = (machine_busy_seconds() - machine0) - (own_cpu_seconds() - own0);
    let cores = machine_cores() as f64;
    rates.sort_by(|x, y| x.total_cmp(y));
    let median = rates[rates.len() / 2];
    PeakMeasurement {
        gflops: median / 1e9,
        best_gflops: rates[rates.len() - 1] / 1e9,
        reps: rates.len(),
        spread: interquartile(&rates) / median,
        others_share: (others / (wall * cores)).max(0.0),
        taken_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    }
}

/// The interquartile range of sorted `rates` (one slow repeat does not count; a quarter of
/// them does).
fn interquartile(rates: &[f64]) -> f64 {
    let q = |f: f64| rates[((rates.len() - 1) as f64 * f).round() as usize];
    q(0.75) - q(0.25)
}

/// Busy CPU seconds of the whole machine so far (`/proc/stat`'s first line: user, nice,
/// system, irq, softirq and steal, in 1/100 s); 0 where unreadable.
fn machine_busy_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = stat.lines().next() else {
        return 0.0;
    };
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| v.get(i))
        .sum::<f64>()
        / 100.0
}

/// CPUs `/proc/stat` counts (its `cpuN` lines): the machine's, whatever this process's
/// affinity, since its first line sums them all.
fn machine_cores() -> usize {
    let n = std::fs::read_to_string("/proc/stat")
        .map(|s| {
            s.lines()
                .filter(|l| {
                    l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit)
                })
                .count()
        })
        .unwrap_or(0);
    n.max(1)
}

/// This process's CPU seconds so far.
fn own_cpu_seconds() -> f64 {
    crate::profile::process_cpu_seconds()
}

/// Where this machine's measurements are cached: `$XDG_CACHE_HOME/ferrotron` or
/// `$HOME/.cache/ferrotron`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("ferrotron"))
}

/// Where measured peaks are cached: `matmul_peak.json` in [`cache_dir`].
pub fn cache_path() -> Option<PathBuf> {
    Some(cache_dir()?.join("matmul_peak.json"))
}

/// Key of a cached peak of `products`: [`cache_key`], marked for the bf16 products.
pub fn cache_key_of(threads: usize, products: Products) -> String {
    match products {
        Products::F32 => cache_key(threads),
        Products::Bf16 => format!("{} | bf16 products", cache_key(threads)),
    }
}

/// Key of a cached peak: the CPU model and thread count.
pub fn cache_key(threads: usize) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    format!("{cpu} | {threads} threads")
}

/// One entry of the cache: a measurement, or a bare GFLOP/s figure from before
/// measurements said how they were taken.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(untagged)]
enum Cached {
    Measured(PeakMeasurement),
    Legacy(f64),
}

fn read_cache() -> BTreeMap<String, Cached> {
    cache_path()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// The cached peak (FLOP/s) for `threads`, if any.
pub fn cached_peak(threads: usize) -> Option<f64> {
    cached_peak_of(threads, Products::F32)
}

/// The cached peak (FLOP/s) of `products` for `threads`, if any.
pub fn cached_peak_of(threads: usize, products: Products) -> Option<f64> {
    match read_cache().get(&cache_key_of(threads, products))? {
        Cached::Measured(m) => Some(m.flops()),
        Cached::Legacy(g) => Some(g * 1e9),
    }
}

/// The cached measurement for `threads`, if it says how it was taken.
pub fn cached_measurement(threads: usize) -> Option<PeakMeasurement> {
    cached_measurement_of(threads, Products::F32)
}

/// The cached measurement of `products` for `threads`, if it says how it was taken.
pub fn cached_measurement_of(threads: usize, products: Products) -> Option<PeakMeasurement> {
    match read_cache().get(&cache_key_of(threads, products))? {
        Cached::Measured(m) => Some(*m),
        Cached::Legacy(_) => None,
    }
}

/// What [`store_peak`] did with a measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// It is the cached peak now.
    Kept,
    /// A better quiet measurement is cached; it stays.
    BetterCached,
    /// It was not quiet, and is not cached.
    NotQuiet,
}

/// Caches `m` for `threads` when it is quiet and beats the cached one (or the cached one
/// was not quiet, or is a bare figure): the cache holds the best quiet measurement.
/// Failures to write the cache are ignored (it only saves a measurement next time).
pub fn store_peak(threads: usize, m: PeakMeasurement) -> Stored {
    store_peak_of(threads, Products::F32, m)
}

/// [`store_peak`] of `products`.
pub fn store_peak_of(threads: usize, products: Products, m: PeakMeasurement) -> Stored {
    let mut map = read_cache();
    let key = cache_key_of(threads, products);
    let verdict = keep(map.get(&key).copied(), &m);
    if verdict != Stored::Kept {
        return verdict;
    }
    map.insert(key, Cached::Measured(m));
    if let Some(path) = cache_path() {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = ferrotron_train::metrics::write_json(&path, &map);
    }
    Stored::Kept
}

/// Whether `new` replaces `old`.
fn keep(old: Option<Cached>, new: &PeakMeasurement) -> Stored {
    if !new.quiet() {
        return Stored::NotQuiet;
    }
    match old {
        Some(Cached::Measured(o)) if o.quiet() && o.gflops >= new.gflops => Stored::BetterCached,
        _ => Stored::Kept,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_peak_times_products_on_device_memory_and_none_on_the_host() {
        use ferrotron_tensor::{ArenaBackend, CpuBackend};
        assert_eq!(measure_device_peak(&CpuBackend::default(), 64, 3), None);
        // The arena runs the CPU's kernels on device memory: its peak is the host's products'
        // rate on a 192² product, below the plateau of the host's peak but not 100 times.
        let arena = ArenaBackend::opaque(4 << 20);
        let rate = measure_device_peak(&arena, 192, 5).expect("a device backend");
        let host = measure_matmul_peak(3);
        assert!(
            (host / 100.0..host * 10.0).contains(&rate),
            "arena {rate:.3e} FLOP/s vs host {host:.3e}"
        );
    }

    fn m(gflops: f64, others_share: f64, spread: f64) -> PeakMeasurement {
        PeakMeasurement {
            gflops,
            best_gflops: gflops,
            reps: 15,
            spread,
            others_share,
            taken_at: 0,
        }
    }

    #[test]
    fn the_cache_keeps_the_best_quiet_measurement() {
        let quiet = m(168.0, 0.01, 0.02);
        // Under load (85 GFLOP/s while another process ran): never cached.
        assert_eq!(keep(None, &m(85.0, 0.45, 0.02)), Stored::NotQuiet);
        assert_eq!(keep(None, &m(160.0, 0.01, 0.30)), Stored::NotQuiet);
        assert_eq!(keep(None, &quiet), Stored::Kept);
        let cached = Some(Cached::Measured(quiet));
        assert_eq!(keep(cached, &m(150.0, 0.0, 0.01)), Stored::BetterCached);
        assert_eq!(keep(cached, &m(171.0, 0.0, 0.01)), Stored::Kept);
        // A bare figure from an older cache, or a cached measurement that was not quiet, is
        // replaced by any quiet one.
        assert_eq!(keep(Some(Cached::Legacy(300.0)), &quiet), Stored::Kept);
        let loud = Some(Cached::Measured(m(200.0, 0.3, 0.0)));
        assert_eq!(keep(loud, &quiet), Stored::Kept);
    }

    #[test]
    fn the_bf16_products_peak_has_its_own_entry() {
        assert_eq!(cache_key_of(2, Products::F32), cache_key(2));
        assert_ne!(cache_key_of(2, Products::Bf16), cache_key(2));
        assert_eq!(Products::of(Matmul::OpenBlas), Products::F32);
        assert_eq!(Products::of(Matmul::Bf16), Products::Bf16);
    }

    #[test]
    fn old_and_new_cache_entries_parse() {
        let text = r#"{"a | 2 threads": 168.4, "b | 1 threads": {"gflops": 90.5, "best_gflops": 91.0, "reps": 15, "spread": 0.02, "others_share": 0.01, "taken_at": 1}}"#;
        let map: BTreeMap<String, Cached> = serde_json::from_str(text).unwrap();
        assert!(matches!(map["a | 2 threads"], Cached::Legacy(g) if g == 168.4));
        assert!(
            matches!(map["b | 1 threads"], Cached::Measured(m) if m.gflops == 90.5 && m.quiet())
        );
    }

    /// A measurement while another process computes on the same cores sees it: the other
    /// process's CPU time is counted, and the measurement is not quiet.
    #[test]
    fn contention_is_seen() {
        /// Busy loops, killed when dropped (also when the test fails).
        struct Busy(Vec<std::process::Child>);
        impl Drop for Busy {
            fn drop(&mut self) {
                for b in &mut self.0 {
                    let _ = b.kill();
                    let _ = b.wait();
                }
            }
        }
        let cores = machine_cores();
        let busy = Busy(
            (0..cores)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        );
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let loud = pool.install(|| measure_peak(3));
        drop(busy);
        assert!(
            loud.others_share > 0.3,
            "{cores} busy processes on {cores} cores: {}",
            loud.describe()
        );
        assert!(!loud.quiet());
    }
}
