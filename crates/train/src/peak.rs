//! The machine's matmul peak: the MFU denominator on a CPU is the measured throughput of the
//! f32 `gemm` kernel on this machine with the run's thread count, not a datasheet figure.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use ferrotron_tensor::linear::{matmul, Mat, Threads};

/// Side of the square matmul measured: large enough to reach the kernel's plateau.
pub const PEAK_SIZE: usize = 1536;

/// Median FLOP/s of `reps` square f32 matmuls of side [`PEAK_SIZE`] on the current rayon pool.
pub fn measure_matmul_peak(reps: usize) -> f64 {
    let n = PEAK_SIZE;
    let a: Vec<f32> = (0..n * n).map(|i| ((i % 97) as f32) * 0.01).collect();
    let b: Vec<f32> = (0..n * n).map(|i| ((i % 89) as f32) * 0.01).collect();
    let mut c = vec![0.0f32; n * n];
    let run = |c: &mut [f32]| {
        matmul(
            n,
            n,
            n,
            c,
            Mat::rows(n),
            false,
            &a,
            Mat::rows(n),
            &b,
            Mat::rows(n),
            Threads::Pool,
        )
    };
    run(&mut c); // warm-up: page faults, packing buffers
    let mut rates: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            run(&mut c);
            2.0 * (n * n * n) as f64 / t.elapsed().as_secs_f64()
        })
        .collect();
    rates.sort_by(|x, y| x.total_cmp(y));
    rates[rates.len() / 2]
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

/// The cached peak (FLOP/s) for `threads`, if any.
pub fn cached_peak(threads: usize) -> Option<f64> {
    let text = std::fs::read_to_string(cache_path()?).ok()?;
    let map: BTreeMap<String, f64> = serde_json::from_str(&text).ok()?;
    map.get(&cache_key(threads)).map(|g| g * 1e9)
}

/// Stores a measured peak (FLOP/s) for `threads`; failures to write the cache are ignored
/// (the cache only saves a measurement next time).
pub fn store_peak(threads: usize, flops: f64) {
    let Some(path) = cache_path() else { return };
    let mut map: BTreeMap<String, f64> = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    map.insert(cache_key(threads), flops / 1e9);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = crate::metrics::write_json(&path, &map);
}
