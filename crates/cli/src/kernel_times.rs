//! Measures what the CPU cost model needs ([`ferrotron_plan::cpu_kernels`]): the time of
//! each GEMM and attention shape a layout's step calls, the element-wise memory bandwidth and
//! the fixed cost of one kernel call, on a pool of the rank's thread count; cached per CPU
//! and thread count in `kernel_times.json` beside the matmul peak, shapes added as needed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use ferrotron_plan::cpu_kernels::{AttnShape, GemmForm, GemmShape, KernelRates, Needs};
use ferrotron_tensor::attention::{self, AttnSaved};
use ferrotron_tensor::elementwise::add;
use ferrotron_tensor::linear::{linear_backward_input, linear_backward_weight, linear_forward};

use ferrotron_train::peak::{cache_dir, cache_key};
use ferrotron_train::trainer::thread_pool;

/// The largest shape measured, in operand elements: larger ones are timed at the peak.
const MAX_ELEMS: usize = 64 << 20;

/// `kernel_times.json` in the cache directory.
pub fn cache_path() -> Option<PathBuf> {
    Some(cache_dir()?.join("kernel_times.json"))
}

fn load() -> BTreeMap<String, KernelRates> {
    cache_path()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// The cached kernel times of `threads` threads per rank on this CPU, if any.
pub fn cached(threads: usize) -> Option<KernelRates> {
    load().remove(&cache_key(threads))
}

/// Median seconds of `f` over repeats filling about `budget_s` (at least 3, after a warm-up).
fn median_time(budget_s: f64, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64().max(1e-7);
    let reps = ((budget_s / once) as usize).clamp(3, 200);
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn time_gemm(g: &GemmShape) -> f64 {
    let (t, i, o) = (g.t, g.d_in, g.d_out);
    let x = vec![0.5f32; t * i];
    let w = vec![0.25f32; o * i];
    let dy = vec![0.125f32; t * o];
    let (mut y, mut dx, mut dw) = (vec![0.0f32; t * o], vec![0.0f32; t * i], vec![0.0; o * i]);
    median_time(0.1, || match g.form {
        GemmForm::Forward => linear_forward(&mut y, &x, &w, t, i, o),
        GemmForm::BackwardInput => linear_backward_input(&mut dx, &dy, &w, t, i, o, false),
        GemmForm::BackwardWeight => linear_backward_weight(&mut dw, &dy, &x, t, i, o),
    })
}

/// Forward and backward seconds of causal attention at shape `a`.
fn time_attention(a: &AttnShape) -> (f64, f64) {
    let sh = attention::AttnShape {
        batch: a.batch,
        seq: a.seq,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
    };
    let rows = a.batch * a.seq;
    let (nq, nkv, nl) = (
        rows * a.heads * a.head_dim,
        rows * a.kv_heads * a.head_dim,
        rows * a.heads,
    );
    let q: Vec<f32> = (0..nq).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let k: Vec<f32> = (0..nkv).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let v: Vec<f32> = (0..nkv).map(|i| ((i % 11) as f32 - 5.0) * 0.01).collect();
    let (mut out, mut lse) = (vec![0.0f32; nq], vec![0.0f32; nl]);
    let fwd = median_time(0.1, || {
        attention::attention_forward(&mut out, &mut lse, &q, &k, &v, sh)
    });
    let dout = vec![0.01f32; nq];
    let (mut dq, mut dk, mut dv, mut delta) =
        (vec![0.0; nq], vec![0.0; nkv], vec![0.0; nkv], vec![0.0; nl]);
    let bwd = median_time(0.1, || {
        let saved = AttnSaved {
            q: &q[..],
            k: &k[..],
            v: &v[..],
            out: &out[..],
            lse: &lse[..],
        };
        attention::attention_backward(&mut dq, &mut dk, &mut dv, &mut delta, &dout, saved, sh)
    });
    (fwd, bwd)
}

/// Seconds of one small element-wise kernel call (1,024 elements): the fixed cost of a call.
fn time_call() -> f64 {
    let (a, b) = (vec![1.0f32; 1024], vec![2.0f32; 1024]);
    let mut out = vec![0.0f32; 1024];
    median_time(0.05, || add(&mut out, &a, &b))
}

/// The kernel times `needs` asks for with `threads` threads per rank on this machine: the
/// cached ones, the rest measured now (and cached).
pub fn kernel_times(needs: &Needs, threads: usize) -> anyhow::Result<KernelRates> {
    let pool = thread_pool(threads)?;
    let threads = pool.current_num_threads();
    let key = cache_key(threads);
    let mut all = load();
    let mut rates = all.remove(&key).unwrap_or_default();
    rates.threads = threads;
    rates.cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    pool.install(|| {
        for g in &needs.gemm {
            // Shapes whose operands pass 64 Mi elements (256 MiB) are timed at the peak.
            let elems = g.t * g.d_in + g.d_in * g.d_out + g.t * g.d_out;
            if elems <= MAX_ELEMS && !rates.gemm.iter().any(|(s, _)| s == g) {
                rates.gemm.push((*g, time_gemm(g)));
            }
        }
        for a in &needs.attention {
            let elems = a.batch * a.seq * (a.heads + a.kv_heads) * a.head_dim * 3;
            if elems <= MAX_ELEMS && !rates.attention.iter().any(|(s, ..)| s == a) {
                let (f, b) = time_attention(a);
                rates.attention.push((*a, f, b));
            }
        }
        if rates.bandwidth <= 0.0 {
            rates.bandwidth = ferrotron_train::profile::measure_bandwidth(9);
        }
        if rates.call_s <= 0.0 {
            rates.call_s = time_call();
        }
    });
    all.insert(key, rates.clone());
    if let Some(path) = cache_path() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        ferrotron_train::metrics::write_json(&path, &all)?;
    }
    Ok(rates)
}
