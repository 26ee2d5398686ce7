//! SwiGLU: `act = silu(gate) ⊙ up`, `silu(x) = x·σ(x)`, with the vectorised sigmoid of
//! [`crate::fastmath`] (AVX2 where the CPU has it; the same bits either way).

use rayon::prelude::*;

use crate::fastmath::sigmoid;
use crate::PAR_CHUNK;

#[inline(always)]
fn forward_body(a: &mut [f32], g: &[f32], u: &[f32]) {
    for ((a, g), u) in a.iter_mut().zip(g).zip(u) {
        *a = g * sigmoid(*g) * u;
    }
}

#[inline(always)]
fn backward_body(dg: &mut [f32], du: &mut [f32], da: &[f32], g: &[f32], u: &[f32]) {
    let n = dg.len();
    let (du, da, g, u) = (&mut du[..n], &da[..n], &g[..n], &u[..n]);
    for i in 0..n {
        let s = sigmoid(g[i]);
        let silu = g[i] * s;
        dg[i] = da[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
        du[i] = da[i] * silu;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn forward_avx2(a: &mut [f32], g: &[f32], u: &[f32]) {
    forward_body(a, g, u)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn backward_avx2(dg: &mut [f32], du: &mut [f32], da: &[f32], g: &[f32], u: &[f32]) {
    backward_body(dg, du, da, g, u)
}

fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `act = silu(gate) ⊙ up`.
pub fn swiglu_forward(act: &mut [f32], gate: &[f32], up: &[f32]) {
    let wide = avx2();
    act.par_chunks_mut(PAR_CHUNK)
        .zip(gate.par_chunks(PAR_CHUNK))
        .zip(up.par_chunks(PAR_CHUNK))
        .for_each(|((a, g), u)| {
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: the CPU has AVX2.
                return unsafe { forward_avx2(a, g, u) };
            }
            let _ = wide;
            forward_body(a, g, u)
        });
}

/// Given `dact`, writes `dgate = dact ⊙ up ⊙ σ(g)(1 + g(1 − σ(g)))` and `dup = dact ⊙ silu(g)`.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dact: &[f32], gate: &[f32], up: &[f32]) {
    let wide = avx2();
    dgate
        .par_chunks_mut(PAR_CHUNK)
        .zip(dup.par_chunks_mut(PAR_CHUNK))
        .zip(dact.par_chunks(PAR_CHUNK))
        .zip(gate.par_chunks(PAR_CHUNK).zip(up.par_chunks(PAR_CHUNK)))
        .for_each(|(((dg, du), da), (g, u))| {
            #[cfg(target_arch = "x86_64")]
            if wide {
                // SAFETY: the CPU has AVX2.
                return unsafe { backward_avx2(dg, du, da, g, u) };
            }
            let _ = wide;
            backward_body(dg, du, da, g, u)
        });
}
