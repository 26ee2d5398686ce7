//! Measures what the CPU cost model needs ([`ferrotron_plan::cpu_kernels`]): the time of
//! each GEMM and attention shape a layout's step calls, the element-wise memory bandwidth and
//! the fixed cost of one kernel call, on a pool of the rank's thread count; cached per CPU
//! and thread count in `kernel_times.json` beside the matmul peak, shapes added as needed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use ferrotron_plan::cpu_kernels::{
    AttnShape, BlockElementwise, GemmForm, GemmShape, HeadShape, KernelRates, Needs,
};
use ferrotron_tensor::attention::{self, AttnSaved};
use ferrotron_tensor::elementwise::{add, add_assign};
use ferrotron_tensor::linear::{linear_backward_input, linear_backward_weight, linear_forward};
use ferrotron_tensor::ring_attention::{self as ring, zigzag_positions, BlockShape, KvBlock};
use ferrotron_tensor::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use ferrotron_tensor::rope::{rope_apply, RopeTable};
use ferrotron_tensor::swiglu::{swiglu_backward, swiglu_forward};
use ferrotron_tensor::xent::{lm_head_xent, XentGrads};
use ferrotron_tensor::Ledger;

use crate::peak::{cache_dir, cache_key};
use ferrotron_train::trainer::thread_pool;

use crate::BenchError;

mod skew;
mod timing;
use timing::{contended, median_time, median_time_fresh};

/// The largest shape measured, in operand elements: larger ones are timed at the peak.
pub const MAX_ELEMS: usize = 64 << 20;

fn gemm_elems(g: &GemmShape) -> usize {
    g.t * g.d_in + g.d_in * g.d_out + g.t * g.d_out
}

fn attention_elems(a: &AttnShape) -> usize {
    a.batch * a.seq * (a.heads + a.kv_heads) * a.head_dim * 3
}

fn elementwise_elems(e: &BlockElementwise) -> usize {
    6 * e.t * e.ffn + 4 * e.t_norm * e.hidden + e.t * (e.heads + e.kv_heads) * e.head_dim
}

fn head_elems(h: &HeadShape) -> usize {
    h.t * h.hidden + 2 * h.vocab * h.hidden + h.chunk * h.vocab
}

/// `needs` without the shapes too large to time here (operands past [`MAX_ELEMS`]): the
/// cost model times those at the peak or the bandwidth.
pub fn measurable(mut needs: Needs) -> Needs {
    needs.gemm.retain(|g| gemm_elems(g) <= MAX_ELEMS);
    needs.attention.retain(|a| attention_elems(a) <= MAX_ELEMS);
    needs
        .elementwise
        .retain(|e| elementwise_elems(e) <= MAX_ELEMS);
    needs.head.retain(|h| head_elems(h) <= MAX_ELEMS);
    needs
}

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

/// How kernels are timed, and which kernels: times cached by an earlier method are measured
/// again.
/// 2: each kernel's outputs newly allocated before every repeat, as in a step.
/// 3: GEMM repeats cycle through copies of their operands ([`ROTATE_BYTES`]).
/// 4: the engine's kernels changed (the cross-entropy's sums of exponentials vectorised,
///    softmax and RMSNorm sums in 8 lanes, the exponential without a division), so times
///    taken from the earlier ones no longer describe it.
const METHOD: u32 = 4;

/// Cache key: the CPU, the threads per rank, (beyond one) the ranks sharing the machine and
/// the timing [`METHOD`].
fn key(threads: usize, ranks: usize) -> String {
    match ranks {
        0 | 1 => format!("{} | method {METHOD}", cache_key(threads)),
        r => format!("{} | {r} ranks | method {METHOD}", cache_key(threads)),
    }
}

/// The cached kernel times of `ranks` ranks of `threads` threads on this CPU, if any.
pub fn cached(threads: usize, ranks: usize) -> Option<KernelRates> {
    load().remove(&key(threads, ranks))
}

/// Bytes of operands a GEMM's timed repeats cycle through: a step's GEMMs read a different
/// layer's weights and activations each time, and its weight gradients land in different
/// parts of the flat gradient buffer. One buffer reused by every repeat stays warm in the
/// shared cache and the TLB: tiny's weight-gradient GEMMs timed that way were 20–40% faster
/// than the same GEMMs cycling through 16 layers' buffers, and than in `bench --profile`.
const ROTATE_BYTES: usize = 32 << 20;

/// How many copies of operands of `bytes` the repeats cycle through (1 to 16).
fn copies(bytes: usize) -> usize {
    (ROTATE_BYTES / bytes.max(1)).clamp(1, 16)
}

fn time_gemm(g: &GemmShape, evict: bool) -> f64 {
    let (t, i, o) = (g.t, g.d_in, g.d_out);
    let n = copies(4 * gemm_elems(g));
    let x: Vec<Vec<f32>> = (0..n).map(|_| vec![0.5f32; t * i]).collect();
    let w: Vec<Vec<f32>> = (0..n).map(|_| vec![0.25f32; o * i]).collect();
    let dy: Vec<Vec<f32>> = (0..n).map(|_| vec![0.125f32; t * o]).collect();
    // The forward's and the input gradient's outputs are new buffers in a step; the weight
    // gradient adds into the gradient buffer, each layer's part of it.
    let mut dw = vec![0.0f32; n * o * i];
    let out_len = match g.form {
        GemmForm::Forward => t * o,
        GemmForm::BackwardInput => t * i,
        GemmForm::BackwardWeight => 0,
    };
    let mut rep = 0;
    median_time_fresh(
        0.1,
        evict,
        || vec![0.0f32; out_len],
        |out| {
            let k = rep % n;
            rep += 1;
            let (x, w, dy) = (&x[k], &w[k], &dy[k]);
            match g.form {
                GemmForm::Forward => linear_forward(out, x, w, t, i, o),
                GemmForm::BackwardInput => linear_backward_input(out, dy, w, t, i, o, false),
                GemmForm::BackwardWeight => {
                    linear_backward_weight(&mut dw[k * o * i..(k + 1) * o * i], dy, x, t, i, o)
                }
            }
        },
    )
}

/// Queries, keys and values of `rows` tokens of shape `a`, filled with small varied values.
fn qkv(a: &AttnShape, rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nq, nkv) = (rows * a.heads * a.head_dim, rows * a.kv_heads * a.head_dim);
    (
        (0..nq).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect(),
        (0..nkv).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect(),
        (0..nkv).map(|i| ((i % 11) as f32 - 5.0) * 0.01).collect(),
    )
}

/// Forward and backward seconds of causal attention at shape `a` (one rank's ring under
/// context parallelism: [`time_ring`]).
fn time_attention(a: &AttnShape, evict: bool) -> (f64, f64) {
    if a.cp > 1 {
        return time_ring(a, evict);
    }
    let sh = attention::AttnShape {
        batch: a.batch,
        seq: a.seq,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
    };
    let rows = a.batch * a.seq;
    let (q, k, v) = qkv(a, rows);
    let (nq, nkv, nl) = (q.len(), k.len(), rows * a.heads);
    let (mut out, mut lse) = (vec![0.0f32; nq], vec![0.0f32; nl]);
    let fwd = median_time_fresh(
        0.1,
        evict,
        || (vec![0.0f32; nq], vec![0.0f32; nl]),
        |(o, l)| attention::attention_forward(o, l, &q, &k, &v, sh),
    );
    attention::attention_forward(&mut out, &mut lse, &q, &k, &v, sh);
    let dout = vec![0.01f32; nq];
    let bwd = median_time_fresh(
        0.1,
        evict,
        || [nq, nkv, nkv, nl].map(|n| vec![0.0f32; n]),
        |[dq, dk, dv, delta]| {
            let saved = AttnSaved {
                q: &q[..],
                k: &k[..],
                v: &v[..],
                out: &out[..],
                lse: &lse[..],
            };
            attention::attention_backward(dq, dk, dv, delta, &dout, saved, sh)
        },
    );
    (fwd, bwd)
}

/// Forward and backward seconds of rank 0's ring attention over `a.cp` ranks, as the
/// engine runs it (`crates/parallel/src/context_parallel.rs`): its `seq/cp` queries of the
/// zig-zag split against every rank's key/value block, each partial merged into the output;
/// backward, `Δ` and each block's gradients.
fn time_ring(a: &AttnShape, evict: bool) -> (f64, f64) {
    let (cp, sq) = (a.cp, a.seq / a.cp);
    let sh = BlockShape {
        batch: a.batch,
        q_len: sq,
        kv_len: sq,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
    };
    let pos = |r: usize| zigzag_positions(a.seq, cp, r).unwrap_or_else(|_| (0..sq).collect());
    let (q_pos, blocks): (Vec<usize>, Vec<Vec<usize>>) = (pos(0), (0..cp).map(pos).collect());
    let rows = a.batch * sq;
    let (q, k, v) = qkv(a, rows);
    let (nq, nkv, nl) = (q.len(), k.len(), rows * a.heads);
    // The rank's queries against every block, each partial merged into the output.
    let forward = |[out, lse, part_out, part_lse]: &mut [Vec<f32>; 4]| {
        for (j, kv_pos) in blocks.iter().enumerate() {
            if j == 0 {
                ring::block_forward(out, lse, &q, &k, &v, KvBlock::causal(&q_pos, kv_pos, sh));
            } else {
                let block = KvBlock::causal(&q_pos, kv_pos, sh);
                ring::block_forward(part_out, part_lse, &q, &k, &v, block);
                ring::merge_partial(out, lse, part_out, part_lse, sh);
            }
        }
    };
    // Every output is a new buffer in a step.
    let fresh = || [nq, nl, nq, nl].map(|n| vec![0.0f32; n]);
    let fwd = median_time_fresh(0.1, evict, fresh, forward);
    // The backward reads the final output and log-sum-exp over all blocks.
    let mut merged = fresh();
    forward(&mut merged);
    let [out, lse, ..] = merged;
    let dout = vec![0.01f32; nq];
    let bwd = median_time_fresh(
        0.1,
        evict,
        || [nq, nkv, nkv, nl].map(|n| vec![0.0f32; n]),
        |[dq, dk, dv, delta]| {
            ring::attention_delta(delta, &dout, &out, sh);
            for kv_pos in &blocks {
                let block = KvBlock::causal(&q_pos, kv_pos, sh);
                ring::block_backward(dq, dk, dv, &dout, &q, &k, &v, &lse, delta, block);
            }
        },
    );
    (fwd, bwd)
}

/// Forward and backward seconds of a dense block's element-wise kernels at shape `e`: two
/// RMSNorms, RoPE on queries and keys, SwiGLU, two residual adds (backward: the same
/// kernels' backward, the residual gradients accumulated, and SwiGLU's product recomputed
/// first, as the engine's block does).
fn time_elementwise(e: &BlockElementwise, evict: bool) -> (f64, f64) {
    let (tn, h, tf) = (e.t_norm, e.hidden, e.t * e.ffn);
    let x = vec![0.5f32; tn * h];
    let w = vec![1.0f32; h];
    let (mut y, mut rstd, mut dw) = (vec![0.0f32; tn * h], vec![0.0f32; tn], vec![0.0; h]);
    rmsnorm_forward(&mut y, &mut rstd, &x, &w, h, 1e-5);
    let table = RopeTable::new(e.t, e.head_dim, 1e4);
    let positions: Vec<usize> = (0..e.t).collect();
    let mut q = vec![0.1f32; e.t * e.heads * e.head_dim];
    let mut k = vec![0.1f32; e.t * e.kv_heads * e.head_dim];
    let (gate, up) = (vec![0.3f32; tf], vec![0.2f32; tf]);
    // Every output is a new buffer in a step (RoPE rotates its input in place).
    let fwd = median_time_fresh(
        0.05,
        evict,
        || {
            let norms = [0, 1].map(|_| [vec![0.0f32; tn * h], vec![0.0; tn], vec![0.0; tn * h]]);
            (norms, vec![0.0f32; tf])
        },
        |(norms, act)| {
            for [y, rstd, sum] in norms {
                rmsnorm_forward(y, rstd, &x, &w, h, 1e-5);
                add(sum, &x, y);
            }
            rope_apply(&mut q, &positions, e.heads, &table, false);
            rope_apply(&mut k, &positions, e.kv_heads, &table, false);
            swiglu_forward(act, &gate, &up);
        },
    );
    let mut sum = vec![0.0f32; tn * h];
    let bwd = median_time_fresh(
        0.05,
        evict,
        || {
            let dx = [0, 1].map(|_| vec![0.0f32; tn * h]);
            (dx, [0, 1, 2].map(|_| vec![0.0f32; tf]))
        },
        |(dxs, [act, dgate, dup])| {
            for dx in dxs {
                rmsnorm_backward(dx, &mut dw, &y, &x, &rstd, &w, h, true);
                add_assign(&mut sum, dx);
            }
            rope_apply(&mut q, &positions, e.heads, &table, true);
            rope_apply(&mut k, &positions, e.kv_heads, &table, true);
            // The backward recomputes SwiGLU's product (the forward keeps only its inputs).
            swiglu_forward(act, &gate, &up);
            swiglu_backward(dgate, dup, act, &gate, &up);
        },
    );
    (fwd, bwd)
}

/// Seconds of the LM head with its cross-entropy, forward and backward, at shape `hd`.
fn time_head(hd: &HeadShape, evict: bool) -> f64 {
    let ledger = Ledger::new();
    let xn = vec![0.01f32; hd.t * hd.hidden];
    let w = vec![0.02f32; hd.vocab * hd.hidden];
    let targets: Vec<u32> = (0..hd.t).map(|i| (i % hd.vocab) as u32).collect();
    // The input gradient is a new buffer in a step; the weight gradient adds into the
    // gradient buffer.
    let mut dw = vec![0.0f32; hd.vocab * hd.hidden];
    median_time_fresh(
        0.1,
        evict,
        || vec![0.0f32; hd.t * hd.hidden],
        |dx| {
            let grads = XentGrads {
                dx: &mut dx[..],
                dw: &mut dw[..],
                scale: 1.0,
            };
            lm_head_xent(
                &Default::default(),
                &ledger,
                &xn,
                &w,
                &targets,
                hd.hidden,
                hd.vocab,
                hd.chunk,
                Some(grads),
            );
        },
    )
}

/// Seconds of one small element-wise kernel call (1,024 elements): the fixed cost of a call.
fn time_call() -> f64 {
    let (a, b) = (vec![1.0f32; 1024], vec![2.0f32; 1024]);
    let mut out = vec![0.0f32; 1024];
    median_time(0.05, false, || add(&mut out, &a, &b))
}

/// Seconds a parallel call spends waking a pool whose threads have gone to sleep: the
/// median of a call made 2 ms after the last one (rayon parks idle threads within about
/// 50 µs) less the median of the same call made back to back.
fn time_wake() -> f64 {
    let call = || {
        let t = Instant::now();
        std::hint::black_box(rayon::broadcast(|ctx| ctx.index()));
        t.elapsed().as_secs_f64()
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let hot = median((0..101).map(|_| call()).collect());
    let parked = median(
        (0..51)
            .map(|_| {
                std::thread::sleep(std::time::Duration::from_millis(2));
                call()
            })
            .collect(),
    );
    (parked - hot).max(0.0)
}

/// Bytes per second of allocating zero-filled buffers of `n` f32 as the engine does (`vec!`
/// of zeros, eight held at once, then freed): after the first rounds the C allocator reuses
/// the freed blocks (a small buffer allocated above them keeps it from returning them to the
/// system, as the engine's long-lived buffers do), so `calloc` zero-fills each in one pass.
fn zero_fill_rate(n: usize) -> f64 {
    const HELD: usize = 8;
    let mut held: Vec<Vec<f32>> = Vec::with_capacity(HELD);
    let round = |held: &mut Vec<Vec<f32>>| {
        let t = Instant::now();
        for _ in 0..HELD {
            held.push(vec![0.0f32; n]);
        }
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(&held);
        held.clear();
        s
    };
    round(&mut held);
    for _ in 0..HELD {
        held.push(vec![0.0f32; n]);
    }
    let pin = std::hint::black_box(vec![1u8; 4096]);
    held.clear();
    let mut times: Vec<f64> = (0..7).map(|_| round(&mut held)).collect();
    drop(pin);
    times.sort_by(f64::total_cmp);
    (HELD * n * 4) as f64 / times[times.len() / 2].max(1e-9)
}

/// The kernel times `needs` asks for with `ranks` ranks of `threads` threads each on this
/// machine: the cached ones, the rest measured now (and cached); with `fresh`, all of them
/// measured now. Each is timed on a pool of its own while the other ranks' pools run the
/// same kernel.
pub fn kernel_times(
    needs: &Needs,
    threads: usize,
    ranks: usize,
    fresh: bool,
) -> Result<KernelRates, BenchError> {
    let threads = thread_pool(threads)?.current_num_threads();
    let key = key(threads, ranks);
    let mut all = load();
    let mut rates = all.remove(&key).unwrap_or_default();
    if fresh {
        rates.gemm.retain(|(g, _)| !needs.gemm.contains(g));
        rates
            .attention
            .retain(|(a, ..)| !needs.attention.contains(a));
        rates
            .elementwise
            .retain(|(e, ..)| !needs.elementwise.contains(e));
        rates.head.retain(|(h, _)| !needs.head.contains(h));
        (rates.bandwidth, rates.call_s, rates.zero_fill) = (0.0, 0.0, 0.0);
        rates.wake_s = 0.0;
        rates.skew.clear();
    }
    rates.threads = threads;
    rates.cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let timed = |f: &(dyn Fn(bool) -> f64 + Sync)| contended(ranks, threads, f);
    let timed2 = |f: &(dyn Fn(bool) -> (f64, f64) + Sync)| contended(ranks, threads, f);
    let needs = measurable(needs.clone());
    for g in &needs.gemm {
        if !rates.gemm.iter().any(|(s, _)| s == g) {
            rates.gemm.push((*g, timed(&|e| time_gemm(g, e))?));
        }
    }
    for a in &needs.attention {
        if !rates.attention.iter().any(|(s, ..)| s == a) {
            let (f, b) = timed2(&|e| time_attention(a, e))?;
            rates.attention.push((*a, f, b));
        }
    }
    for e in &needs.elementwise {
        if !rates.elementwise.iter().any(|(s, ..)| s == e) {
            let (f, b) = timed2(&|ev| time_elementwise(e, ev))?;
            rates.elementwise.push((*e, f, b));
        }
    }
    for hd in &needs.head {
        if !rates.head.iter().any(|(s, _)| s == hd) {
            rates.head.push((*hd, timed(&|e| time_head(hd, e))?));
        }
    }
    if rates.bandwidth <= 0.0 {
        rates.bandwidth = timed(&|_| crate::profile::measure_bandwidth(5))?;
    }
    if rates.call_s <= 0.0 {
        rates.call_s = timed(&|_| time_call())?;
    }
    if rates.wake_s <= 0.0 {
        rates.wake_s = timed(&|_| time_wake())?;
    }
    if ranks > 1 && !skew::complete(&rates.skew) {
        rates.skew = skew::arrival_skew(ranks, threads)?;
    }
    if rates.zero_fill <= 0.0 {
        // At the size of a block's largest activation (the MLP's).
        let n = needs
            .elementwise
            .iter()
            .map(|e| e.t * e.ffn)
            .max()
            .unwrap_or(1 << 20);
        rates.zero_fill = timed(&|_| zero_fill_rate(n))?;
    }
    all.insert(key, rates.clone());
    if let Some(path) = cache_path() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| BenchError::Io {
                action: "create directory",
                path: dir.to_owned(),
                source,
            })?;
        }
        ferrotron_train::metrics::write_json(&path, &all)?;
    }
    Ok(rates)
}
