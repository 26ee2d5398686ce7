//! The multiply-add rate of one core through each vector instruction this CPU has: f32 FMA
//! (AVX-512 or AVX2) and, where present, AVX-512 BF16's `vdpbf16ps` (two bf16 products into an
//! f32 lane). The ceiling of a GEMM kernel built on each; `cargo run --release --example
//! isa_rates`. docs/cpu-performance.md ("Vector paths") quotes it.

use std::time::Instant;

/// Iterations of the timed loops (24 independent accumulators each).
const ITERS: usize = 20_000_000;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// f32 FMAs on 16 lanes, 24 independent chains; returns a checksum.
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn fma512(n: usize) -> f32 {
        let (a, b) = (_mm512_set1_ps(1.0001), _mm512_set1_ps(0.9999));
        let mut acc = [_mm512_setzero_ps(); 24];
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(a, b, *x);
            }
        }
        _mm512_reduce_add_ps(
            acc.iter()
                .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x)),
        )
    }

    /// f32 FMAs on 8 lanes, 12 independent chains (AVX2 has 16 registers).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(n: usize) -> f32 {
        let (a, b) = (_mm256_set1_ps(1.0001), _mm256_set1_ps(0.9999));
        let mut acc = [_mm256_setzero_ps(); 12];
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(a, b, *x);
            }
        }
        let mut lanes = [0.0f32; 8];
        let mut s = 0.0;
        for x in acc {
            _mm256_storeu_ps(lanes.as_mut_ptr(), x);
            s += lanes.iter().sum::<f32>();
        }
        s
    }

    /// `vdpbf16ps` on 16 lanes (32 bf16 products each), 24 independent chains.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16(n: usize) -> f32 {
        // 1.0 in bf16 in both halves of every 32-bit lane.
        let one: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80));
        let mut acc = [_mm512_setzero_ps(); 24];
        for _ in 0..n {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, one, one);
            }
        }
        _mm512_reduce_add_ps(
            acc.iter()
                .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x)),
        )
    }
}

/// Best of three timings of `f`, as GFLOP/s for `flops` floating-point operations.
fn rate(flops: f64, f: impl Fn() -> f32) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            flops / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let n = ITERS as f64;
        if has!("avx512f") && has!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA.
            let r = rate(n * 24.0 * 32.0, || unsafe { x86::fma512(ITERS) });
            println!("f32 FMA, AVX-512: {r:.1} GFLOP/s per core");
        }
        if has!("avx2") && has!("fma") {
            // SAFETY: the CPU has AVX2 and FMA.
            let r = rate(n * 12.0 * 16.0, || unsafe { x86::fma256(ITERS) });
            println!("f32 FMA, AVX2: {r:.1} GFLOP/s per core");
        }
        if has!("avx512f") && has!("avx512bf16") {
            // SAFETY: the CPU has AVX-512F and AVX-512 BF16.
            let r = rate(n * 24.0 * 64.0, || unsafe { x86::dpbf16(ITERS) });
            println!("bf16 dot products (vdpbf16ps), AVX-512 BF16: {r:.1} GFLOP/s per core");
        } else {
            println!("no AVX-512 BF16 on this CPU");
        }
        let amx = std::fs::read_to_string("/proc/cpuinfo")
            .map(|s| s.contains(" amx_bf16"))
            .unwrap_or(false);
        println!("AMX (amx_bf16) listed by the kernel: {amx}");
    }
    #[cfg(not(target_arch = "x86_64"))]
    println!("only x86-64 instruction rates are measured");
}
