//! A kernel profiler: a [`Backend`] that runs another backend's kernels and times each call
//! (the wall time from the call, once the device has finished what was queued before it, to
//! the end of [`Backend::synchronize`]), adding it to the
//! call's class with the floating-point operations and the memory traffic the call implies.
//!
//! Classes are what a step profile reports: every GEMM shape on its own (forward, backward
//! input, backward weight), attention forward and backward, norms, RoPE, SwiGLU, the LM head
//! with its cross-entropy, AdamW, the gradient norm, copies and casts, embeddings, the
//! mixture of experts' routing. The costs are the kernels' own counts:
//! - a GEMM `[m×k]·[k×n]` is `2mkn` FLOPs and reads/writes its three matrices once;
//! - causal attention computes the visible part of the score matrix, `s(s+1)/2` entries per
//!   head (a ring block: the pairs whose key is at or before the query's global position):
//!   the forward is two products (`QKᵀ`, `PV`) over them, `4·d` FLOPs per entry; the backward
//!   five (`QKᵀ` again, `dV`, `dP`, `dQ`, `dK`), `10·d`;
//! - the LM head is `2·t·h·v` forward and twice that backward (the logits' gradient feeds
//!   both the input and the weight gradient);
//! - element-wise kernels move the bytes they read and write, once each.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::adamw::AdamW;
use crate::attention::{AttnSaved, AttnShape};
use crate::backend::{AttnGrads, AuxLoss, HeadShape, KvBlock, LinearShape, NormSaved, Operand};
use crate::backend::{RouteShape, Routed};
use crate::fp8::Fp8Quant;
use crate::kernels::*;
use crate::moe::{AuxStats, Dispatch, Routing};
use crate::muon::MuonMomentum;
use crate::ring_attention::BlockShape;
use crate::rope::RopeTable;
use crate::xent::XentGrads;
use crate::{bf16, f16, DeviceSlice, Ledger, RingBlock};

/// What one kernel call costs: its class, its FLOPs and the bytes it moves.
#[derive(Debug, Clone)]
struct Cost {
    class: String,
    flops: f64,
    bytes: f64,
}

fn cost(class: impl Into<String>, flops: f64, bytes: f64) -> Cost {
    Cost {
        class: class.into(),
        flops,
        bytes,
    }
}

/// A memory-bound kernel moving `elems` f32 values in and out.
fn memory(class: &str, elems: usize) -> Cost {
    cost(class, 0.0, 4.0 * elems as f64)
}

/// A GEMM `[m×k]·[k×n]`, named by its role and shape.
fn gemm(role: &str, m: usize, k: usize, n: usize) -> Cost {
    let (mf, kf, nf) = (m as f64, k as f64, n as f64);
    cost(
        format!("GEMM {role} {m}×{k}·{k}×{n}"),
        2.0 * mf * kf * nf,
        4.0 * (mf * kf + kf * nf + mf * nf),
    )
}

/// Attention of `b` sequences, `a` query heads of `d`, over `entries` visible
/// query-key pairs per head: `products` matrix products over those entries.
fn attention(class: &str, products: f64, (b, a, entries, d): (usize, usize, f64, usize)) -> Cost {
    let flops = products * 2.0 * (b * a) as f64 * entries * d as f64;
    cost(class, flops, 0.0)
}

/// Visible pairs of causal attention over a whole sequence of `s`: `s(s+1)/2`.
fn causal(s: usize) -> f64 {
    (s * (s + 1) / 2) as f64
}

/// Visible pairs per sequence of a ring block: keys at or before each query's global
/// position and, under document masking, at or after its document's start (averaged over the
/// sequences, whose documents differ).
fn visible(block: &KvBlock<'_>) -> f64 {
    let mut kv = block.kv_pos.to_vec();
    kv.sort_unstable();
    let seen = |lo: usize, q: usize| {
        (kv.partition_point(|&k| k <= q) - kv.partition_point(|&k| k < lo)) as f64
    };
    match block.q_start {
        None => block.q_pos.iter().map(|&q| seen(0, q)).sum(),
        Some(starts) => {
            let n = block.q_pos.len().max(1);
            let pairs: f64 = (starts.iter().enumerate())
                .map(|(r, &lo)| seen(lo, block.q_pos[r % n]))
                .sum();
            pairs / block.shape.batch.max(1) as f64
        }
    }
}

/// Time, FLOPs and bytes of one class of kernel calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KernelStat {
    /// Calls.
    pub calls: u64,
    /// Wall seconds, call to synchronisation.
    pub seconds: f64,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written.
    pub bytes: f64,
    /// CPU seconds of every thread of the process during the calls ([`process_cpu_seconds`]):
    /// against `threads × seconds`, how busy the cores were inside this class.
    pub cpu_seconds: f64,
}

/// CPU seconds (user + system) every thread of this process has used so far
/// (`CLOCK_PROCESS_CPUTIME_ID`, nanosecond resolution); 0 where the clock is unavailable.
pub fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Runs `inner`'s kernels, timing each call by class.
pub struct ProfiledBackend {
    inner: Arc<dyn Backend>,
    stats: Mutex<BTreeMap<String, KernelStat>>,
}

impl ProfiledBackend {
    /// Profiles the kernels of `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> ProfiledBackend {
        ProfiledBackend {
            inner,
            stats: Mutex::new(BTreeMap::new()),
        }
    }

    /// Every class so far, by name.
    pub fn snapshot(&self) -> BTreeMap<String, KernelStat> {
        self.stats.lock().expect("profile lock").clone()
    }

    /// Forgets what was recorded (after warm-up steps).
    pub fn reset(&self) {
        self.stats.lock().expect("profile lock").clear();
    }

    fn record(&self, c: Cost, (start, cpu0): (Instant, f64)) {
        let seconds = start.elapsed().as_secs_f64();
        let cpu_seconds = process_cpu_seconds() - cpu0;
        let mut stats = self.stats.lock().expect("profile lock");
        let s = stats.entry(c.class).or_default();
        s.calls += 1;
        s.seconds += seconds;
        s.flops += c.flops;
        s.bytes += c.bytes;
        s.cpu_seconds += cpu_seconds;
    }
}

/// Each kernel: its cost (computed from the arguments before the call), then the inner
/// backend's kernel, synchronised and timed.
macro_rules! profiled_kernels {
    ($family:ident {
        $(passed fn $pass:ident(&self) -> $pr:ty;)*
        $(fn $name:ident(&self, $($a:ident: $t:ty),*) $(-> $r:ty)? => $cost:expr;)*
    }) => {
        impl $family for ProfiledBackend {
            // Queries, not kernels: answered by the inner backend, untimed.
            $(fn $pass(&self) -> $pr {
                self.inner.$pass()
            })*
            $(fn $name(&self, $($a: $t),*) $(-> $r)? {
                let c: Cost = $cost;
                // Work queued before the call (a device's fills and copies) is not the call's.
                self.inner.synchronize();
                let start = (Instant::now(), process_cpu_seconds());
                let out = self.inner.$name($($a),*);
                self.inner.synchronize();
                self.record(c, start);
                out
            })*
        }
    };
}

const COPIES: &str = "copies, casts, fills, adds, scaling";

impl Backend for ProfiledBackend {
    fn memory(&self) -> Option<Arc<dyn crate::memory::DeviceMemory>> {
        self.inner.memory()
    }
    fn synchronize(&self) {
        self.inner.synchronize()
    }
}

#[rustfmt::skip]
profiled_kernels!(Products {
    passed fn reads_bf16(&self) -> bool;
    passed fn best_product_rate(&self) -> Option<f64>;
    fn linear_forward(&self, y: &mut DeviceSlice<f32>, x: Operand<'_>, w: Operand<'_>, sh: LinearShape)
        => gemm("forward", sh.t, sh.d_in, sh.d_out);
    fn linear_backward_input(&self, dx: &mut DeviceSlice<f32>, dy: Operand<'_>, w: Operand<'_>, sh: LinearShape, accumulate: bool)
        => gemm("backward input", sh.t, sh.d_out, sh.d_in);
    fn linear_backward_weight(&self, dw: &mut DeviceSlice<f32>, dy: Operand<'_>, x: Operand<'_>, sh: LinearShape)
        => gemm("backward weight", sh.d_out, sh.t, sh.d_in);
    fn bias_forward(&self, y: &mut DeviceSlice<f32>, b: &DeviceSlice<f32>)
        => memory("bias", 2 * y.len());
    fn bias_backward(&self, db: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>)
        => memory("bias", dy.len());
});

#[rustfmt::skip]
profiled_kernels!(Norms {
    fn rmsnorm_forward(&self, y: &mut DeviceSlice<f32>, rstd: &mut DeviceSlice<f32>, x: &DeviceSlice<f32>, w: &DeviceSlice<f32>, h: usize, eps: f32)
        => memory("RMSNorm forward", 2 * x.len());
    fn rmsnorm_backward(&self, dx: &mut DeviceSlice<f32>, dw: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>, saved: NormSaved<'_>, accumulate: bool)
        => memory("RMSNorm backward", (3 + accumulate as usize) * saved.x.len());
    fn rmsnorm_apply(&self, y: &mut DeviceSlice<f32>, saved: NormSaved<'_>)
        => memory("RMSNorm forward", 2 * saved.x.len());
});

#[rustfmt::skip]
profiled_kernels!(AttentionKernels {
    fn rope(&self, x: &mut DeviceSlice<f32>, positions: &[usize], heads: usize, table: &RopeTable, inverse: bool)
        => memory("RoPE", 2 * x.len());
    fn attention_forward(&self, out: &mut DeviceSlice<f32>, lse: &mut DeviceSlice<f32>, q: &DeviceSlice<f32>, k: &DeviceSlice<f32>, v: &DeviceSlice<f32>, shape: AttnShape)
        => attention("attention forward", 2.0, (shape.batch, shape.heads, causal(shape.seq), shape.head_dim));
    fn attention_backward(&self, grads: AttnGrads<'_>, delta: &mut DeviceSlice<f32>, dout: &DeviceSlice<f32>, saved: AttnSaved<'_, DeviceSlice<f32>>, shape: AttnShape)
        => attention("attention backward", 5.0, (shape.batch, shape.heads, causal(shape.seq), shape.head_dim));
    fn attention_block_forward(&self, out: &mut DeviceSlice<f32>, lse: &mut DeviceSlice<f32>, q: &DeviceSlice<f32>, k: &DeviceSlice<f32>, v: &DeviceSlice<f32>, block: KvBlock<'_>)
        => attention("attention forward", 2.0, (block.shape.batch, block.shape.heads, visible(&block), block.shape.head_dim));
    fn attention_merge(&self, out: &mut DeviceSlice<f32>, lse: &mut DeviceSlice<f32>, part_out: &DeviceSlice<f32>, part_lse: &DeviceSlice<f32>, sh: BlockShape)
        => memory("attention merge, delta", 3 * out.len());
    fn attention_delta(&self, delta: &mut DeviceSlice<f32>, dout: &DeviceSlice<f32>, out: &DeviceSlice<f32>, sh: BlockShape)
        => memory("attention merge, delta", 2 * out.len());
    fn attention_block_backward(&self, grads: AttnGrads<'_>, dout: &DeviceSlice<f32>, saved: RingBlock<'_>, block: KvBlock<'_>)
        => attention("attention backward", 5.0, (block.shape.batch, block.shape.heads, visible(&block), block.shape.head_dim));
});

#[rustfmt::skip]
profiled_kernels!(MoeKernels {
    fn moe_route(&self, ledger: &Ledger, logits: &DeviceSlice<f32>, bias: Option<&[f32]>, sh: RouteShape) -> Routing
        => memory("MoE routing, dispatch", logits.len());
    fn moe_route_backward(&self, d_logits: &mut DeviceSlice<f32>, d_gates: &DeviceSlice<f32>, routing: &Routing, sh: RouteShape)
        => memory("MoE routing, dispatch", d_logits.len());
    fn moe_aux_stats(&self, routing: &Routing, sh: RouteShape) -> AuxStats
        => memory("MoE routing, dispatch", sh.t * sh.top_k);
    fn moe_aux_loss_backward(&self, d_logits: &mut DeviceSlice<f32>, aux: AuxLoss<'_>, routing: &Routing, sh: RouteShape)
        => memory("MoE routing, dispatch", d_logits.len());
    fn moe_gather_rows(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, h: usize, dispatch: &Dispatch)
        => memory("MoE routing, dispatch", 2 * dst.len());
    fn moe_scatter_add_rows(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, h: usize, dispatch: &Dispatch)
        => memory("MoE routing, dispatch", 3 * src.len());
    fn moe_combine_forward(&self, out: &mut DeviceSlice<f32>, expert_out: &DeviceSlice<f32>, h: usize, routed: Routed<'_>)
        => memory("MoE routing, dispatch", out.len() + expert_out.len());
    fn moe_combine_backward(&self, d_expert_out: &mut DeviceSlice<f32>, d_gates: &mut DeviceSlice<f32>, d_out: &DeviceSlice<f32>, expert_out: &DeviceSlice<f32>, h: usize, routed: Routed<'_>)
        => memory("MoE routing, dispatch", d_out.len() + 2 * expert_out.len());
});

#[rustfmt::skip]
profiled_kernels!(LossKernels {
    fn lm_head_xent(&self, ledger: &Ledger, xn: &DeviceSlice<f32>, w: Operand<'_>, targets: &DeviceSlice<u32>, sh: HeadShape, grads: Option<XentGrads<'_, DeviceSlice<f32>>>) -> f64
        => lm_head(xn.len() / sh.h.max(1), sh.h, sh.v, grads.is_some());
    fn logits_row_max(&self, out: &mut DeviceSlice<f32>, lg: &DeviceSlice<f32>, vl: usize)
        => memory("cross-entropy (vocabulary-parallel)", lg.len());
    fn max_over_ranks(&self, out: &mut DeviceSlice<f32>, gathered: &DeviceSlice<f32>, ranks: usize)
        => memory("cross-entropy (vocabulary-parallel)", gathered.len());
    fn logits_exp_stats(&self, out: &mut DeviceSlice<f32>, lg: &DeviceSlice<f32>, targets: &DeviceSlice<u32>, row_max: &DeviceSlice<f32>, slice: (usize, usize))
        => memory("cross-entropy (vocabulary-parallel)", lg.len());
    fn vocab_lse(&self, ledger: &Ledger, lse: &mut DeviceSlice<f64>, row_max: &DeviceSlice<f32>, stats: &DeviceSlice<f32>) -> f64
        => memory("cross-entropy (vocabulary-parallel)", stats.len());
    fn vocab_softmax_grad(&self, lg: &mut DeviceSlice<f32>, targets: &DeviceSlice<u32>, lse: &DeviceSlice<f64>, slice: (usize, usize), scale: f32)
        => memory("cross-entropy (vocabulary-parallel)", 2 * lg.len());
});

#[rustfmt::skip]
profiled_kernels!(Elementwise {
    fn swiglu_forward(&self, act: &mut DeviceSlice<f32>, gate: &DeviceSlice<f32>, up: &DeviceSlice<f32>)
        => memory("SwiGLU forward", 3 * act.len());
    fn swiglu_backward(&self, dgate: &mut DeviceSlice<f32>, dup: &mut DeviceSlice<f32>, dact: &DeviceSlice<f32>, gate: &DeviceSlice<f32>, up: &DeviceSlice<f32>)
        => memory("SwiGLU backward", 5 * dact.len());
    fn embedding_forward(&self, x: &mut DeviceSlice<f32>, table: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize)
        => memory("embedding", 2 * x.len());
    fn embedding_backward(&self, dtable: &mut DeviceSlice<f32>, dx: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize)
        => memory("embedding", 3 * dx.len());
    fn embedding_forward_slice(&self, x: &mut DeviceSlice<f32>, table: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize, v0: usize)
        => memory("embedding", 2 * x.len());
    fn embedding_backward_slice(&self, dtable: &mut DeviceSlice<f32>, dx: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize, v0: usize)
        => memory("embedding", 3 * dx.len());
    fn add(&self, out: &mut DeviceSlice<f32>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>)
        => memory("residual add", 3 * out.len());
    fn copy(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>)
        => memory(COPIES, 2 * dst.len());
    fn copy_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<bf16>)
        => memory(COPIES, dst.len());
    fn fill(&self, dst: &mut DeviceSlice<f32>, value: f32)
        => memory(COPIES, dst.len());
    fn fill_bf16(&self, dst: &mut DeviceSlice<bf16>, value: bf16)
        => cost(COPIES, 0.0, 2.0 * dst.len() as f64);
    fn add_assign(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>)
        => memory(COPIES, 3 * dst.len());
    fn add_assign_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>)
        => memory(COPIES, 2 * dst.len());
    fn scale(&self, dst: &mut DeviceSlice<f32>, s: f32)
        => memory(COPIES, 2 * dst.len());
    fn round_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>)
        => cost(COPIES, 0.0, 6.0 * dst.len() as f64);
    fn widen_bf16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<bf16>)
        => cost(COPIES, 0.0, 6.0 * dst.len() as f64);
    fn fill_f16(&self, dst: &mut DeviceSlice<f16>, value: f16)
        => cost(COPIES, 0.0, 2.0 * dst.len() as f64);
    fn add_assign_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>)
        => memory(COPIES, 2 * dst.len());
    fn round_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>)
        => cost(COPIES, 0.0, 6.0 * dst.len() as f64);
    fn widen_f16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f16>)
        => cost(COPIES, 0.0, 6.0 * dst.len() as f64);
    fn fp8_amax(&self, out: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, q: Fp8Quant)
        => memory("FP8 emulation", src.len());
    fn fp8_apply(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, amax: &DeviceSlice<f32>, q: Fp8Quant)
        => memory("FP8 emulation", 2 * dst.len());
});

#[rustfmt::skip]
profiled_kernels!(OptimizerKernels {
    fn adamw(&self, param: &mut DeviceSlice<f32>, grad: &DeviceSlice<f32>, m: &mut DeviceSlice<f32>, v: &mut DeviceSlice<f32>, grad_scale: f32, hyper: AdamW)
        => memory("AdamW", 7 * param.len());
    fn muon_momentum(&self, u: &mut DeviceSlice<f32>, m: &mut DeviceSlice<f32>, grad: &DeviceSlice<f32>, grad_scale: f32, hyper: MuonMomentum)
        => memory("Muon momentum", 5 * u.len());
    fn sum_squares(&self, ledger: &Ledger, x: &DeviceSlice<f32>) -> f64
        => memory("gradient norm", x.len());
    fn sum_squares_ranges(&self, ledger: &Ledger, x: Operand<'_>, ranges: &[Range<usize>]) -> Vec<f64>
        => cost("gradient norm", 0.0, (x.element_bytes() * ranges.iter().map(|r| r.len()).sum::<usize>()) as f64);
});

/// The LM head with its cross-entropy over `t` tokens (`h` → `v`): one GEMM forward, two
/// more backward when `grads` (the input and the weight gradient).
fn lm_head(t: usize, h: usize, v: usize, grads: bool) -> Cost {
    let products = if grads { 3.0 } else { 1.0 };
    let (tf, hf, vf) = (t as f64, h as f64, v as f64);
    cost(
        format!("LM head + cross-entropy {t}×{h}·{h}×{v}"),
        products * 2.0 * tf * hf * vf,
        products * 4.0 * (tf * hf + hf * vf),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Category, CpuBackend};

    #[test]
    fn calls_are_counted_by_class_with_their_flops_and_bytes() {
        let be = ProfiledBackend::new(Arc::new(CpuBackend::default()));
        let ledger = Ledger::new();
        let (t, i, o) = (8, 16, 4);
        let x = ledger.upload(Category::Workspace, "x", &vec![1.0f32; t * i]);
        let w = ledger.upload(Category::Workspace, "w", &vec![0.5f32; o * i]);
        let mut y = ledger.zeros::<f32>(Category::Workspace, t * o);
        be.linear_forward(&mut y, x.operand(), w.operand(), LinearShape::new(t, i, o));
        be.linear_forward(&mut y, x.operand(), w.operand(), LinearShape::new(t, i, o));
        let out = ledger.download("y", &y);
        assert!(out.iter().all(|&v| v == 8.0), "the inner kernel ran");
        let mut sum = ledger.zeros::<f32>(Category::Workspace, t * o);
        be.add(&mut sum, &y, &y);
        let stats = be.snapshot();
        let g = &stats["GEMM forward 8×16·16×4"];
        assert_eq!(g.calls, 2);
        assert_eq!(g.flops, 2.0 * 2.0 * (t * i * o) as f64);
        assert_eq!(g.bytes, 2.0 * 4.0 * (t * i + i * o + t * o) as f64);
        assert!(g.seconds > 0.0);
        assert_eq!(stats["residual add"].bytes, 4.0 * 3.0 * (t * o) as f64);
        be.reset();
        assert!(be.snapshot().is_empty());
    }

    /// CPU seconds of the calling thread alone.
    fn thread_cpu_seconds() -> f64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
        assert_eq!(
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) },
            0
        );
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }

    /// The process clock counts at least the CPU this thread burned (other threads only add
    /// to it), at a resolution far below the 10 ms of `/proc/self/stat`'s ticks.
    #[test]
    fn process_cpu_time_counts_this_threads_work_finely() {
        let (p0, t0) = (process_cpu_seconds(), thread_cpu_seconds());
        let mut x = 1.0f64;
        while thread_cpu_seconds() - t0 < 0.003 {
            for _ in 0..1000 {
                x = std::hint::black_box(x * 1.000_000_1 + 1e-9);
            }
        }
        // The thread's clock is read inside the process's interval at both ends, so the
        // process's interval holds the thread's.
        let t1 = thread_cpu_seconds();
        let p1 = process_cpu_seconds();
        assert!(t1 - t0 >= 0.003 && t1 - t0 < 1.0, "thread {}", t1 - t0);
        assert!(
            p1 - p0 >= t1 - t0,
            "process {} < thread {}",
            p1 - p0,
            t1 - t0
        );
        // Two reads in a row differ by far less than a tick.
        let (a, b) = (process_cpu_seconds(), process_cpu_seconds());
        assert!(b >= a && b - a < 0.005, "{a} then {b}");
    }

    /// A kernel on a one-thread pool keeps at most that thread busy, plus whatever other
    /// threads of the test process burn meanwhile: its class records CPU seconds above zero.
    #[test]
    fn each_class_records_the_cpu_seconds_of_its_calls() {
        let be = ProfiledBackend::new(Arc::new(CpuBackend::default()));
        let ledger = Ledger::new();
        let n = 192;
        let x = ledger.upload(Category::Workspace, "x", &vec![0.25f32; n * n]);
        let mut y = ledger.zeros::<f32>(Category::Workspace, n * n);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let t0 = thread_cpu_seconds();
        pool.install(|| {
            for _ in 0..20 {
                be.linear_forward(&mut y, x.operand(), x.operand(), LinearShape::new(n, n, n));
            }
        });
        let g = &be.snapshot()[&format!("GEMM forward {n}×{n}·{n}×{n}")];
        assert_eq!(g.calls, 20);
        // The pool's thread did the work, not this one, and its CPU is in the class.
        assert!(thread_cpu_seconds() - t0 < g.cpu_seconds);
        assert!(
            g.cpu_seconds > 0.2 * g.seconds,
            "{} of {}",
            g.cpu_seconds,
            g.seconds
        );
    }

    #[test]
    fn causal_attention_counts_the_visible_scores() {
        // One head of 4 queries over 4 keys: 10 causal entries; the forward's two products
        // are 2 · 2 · 10 · d FLOPs.
        let c = attention("attention forward", 2.0, (1, 1, causal(4), 8));
        assert_eq!(c.flops, 2.0 * 2.0 * 10.0 * 8.0);
        // A ring block: queries at 4..6 see keys 0..2 all (4 pairs); at 0, 7 see 1 and 2 keys
        // of [0, 7]; and at 1, 6 see 1 and 1.
        let sh = |q: usize, kv: usize, batch: usize| crate::ring_attention::BlockShape {
            batch,
            q_len: q,
            kv_len: kv,
            heads: 1,
            kv_heads: 1,
            head_dim: 8,
        };
        let pairs = |q: &[usize], kv: &[usize]| visible(&KvBlock::causal(q, kv, sh(2, 2, 1)));
        assert_eq!(pairs(&[4, 5], &[0, 1]), 4.0);
        assert_eq!(pairs(&[0, 7], &[7, 0]), 3.0);
        assert_eq!(pairs(&[1, 6], &[0, 7]), 2.0);
        // Document masking: two sequences over keys 0..4, the first cut at 2 (its queries at
        // 2 and 3 see 1 and 2 keys), the second whole (3 and 4): (3 + 7) / 2 per sequence.
        let (q, kv) = ([2, 3], [0, 1, 2, 3]);
        let block = KvBlock {
            q_pos: &q,
            kv_pos: &kv,
            q_start: Some(&[2, 2, 0, 0]),
            shape: sh(2, 4, 2),
        };
        assert_eq!(visible(&block), 5.0);
    }
}
