//! SwiGLU: `act = silu(gate) ⊙ up`, `silu(x) = x·σ(x)`, with the vectorised sigmoid of
//! [`crate::fastmath`] (AVX-512 or AVX2 where the CPU has them; the same bits either way).

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

crate::fastmath::dispatched! {
    /// [`forward_body`] on the widest lanes this CPU has.
    fn forward_lanes(a: &mut [f32], g: &[f32], u: &[f32]) -> () = forward_body;
}

crate::fastmath::dispatched! {
    /// [`backward_body`] on the widest lanes this CPU has.
    fn backward_lanes(dg: &mut [f32], du: &mut [f32], da: &[f32], g: &[f32], u: &[f32]) -> () = backward_body;
}

/// `act = silu(gate) ⊙ up`.
pub fn swiglu_forward(act: &mut [f32], gate: &[f32], up: &[f32]) {
    act.par_chunks_mut(PAR_CHUNK)
        .zip(gate.par_chunks(PAR_CHUNK))
        .zip(up.par_chunks(PAR_CHUNK))
        .for_each(|((a, g), u)| forward_lanes(a, g, u));
}

/// Given `dact`, writes `dgate = dact ⊙ up ⊙ σ(g)(1 + g(1 − σ(g)))` and `dup = dact ⊙ silu(g)`.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dact: &[f32], gate: &[f32], up: &[f32]) {
    dgate
        .par_chunks_mut(PAR_CHUNK)
        .zip(dup.par_chunks_mut(PAR_CHUNK))
        .zip(dact.par_chunks(PAR_CHUNK))
        .zip(gate.par_chunks(PAR_CHUNK).zip(up.par_chunks(PAR_CHUNK)))
        .for_each(|(((dg, du), da), (g, u))| backward_lanes(dg, du, da, g, u));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The bodies compiled for AVX2, as `dispatched!` does, to test that path on a CPU
    /// whose widest is AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn on_avx2(a: &mut [f32], d: [&mut [f32]; 2], da: &[f32], g: &[f32], u: &[f32]) {
        let [dg, du] = d;
        forward_body(a, g, u);
        backward_body(dg, du, da, g, u);
    }

    #[test]
    fn widest_and_avx2_paths_give_the_baselines_bits_and_the_reference_values() {
        let n = 3 * PAR_CHUNK + 37;
        let data = |m: usize, k: usize, f: f32, c: f32| -> Vec<f32> {
            (0..n).map(|i| ((i * m) % k) as f32 * f - c).collect()
        };
        let (g, u, da) = (
            data(37, 211, 0.1, 10.0),
            data(13, 101, 0.02, 1.0),
            data(7, 53, 0.03, 0.8),
        );
        let zeros = || vec![0.0f32; n];
        let (mut a, mut dg, mut du) = (zeros(), zeros(), zeros());
        swiglu_forward(&mut a, &g, &u);
        swiglu_backward(&mut dg, &mut du, &da, &g, &u);
        let (mut a_ref, mut dg_ref, mut du_ref) = (zeros(), zeros(), zeros());
        forward_body(&mut a_ref, &g, &u);
        backward_body(&mut dg_ref, &mut du_ref, &da, &g, &u);
        assert!(same_bits(&a, &a_ref) && same_bits(&dg, &dg_ref) && same_bits(&du, &du_ref));
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            let (mut a2, mut dg2, mut du2) = (zeros(), zeros(), zeros());
            // SAFETY: the CPU has AVX2.
            unsafe { on_avx2(&mut a2, [&mut dg2, &mut du2], &da, &g, &u) };
            assert!(same_bits(&a2, &a_ref) && same_bits(&dg2, &dg_ref) && same_bits(&du2, &du_ref));
        }
        // Against silu in f64: x·σ(x)·u.
        for i in (0..n).step_by(97) {
            let (x, v) = (g[i] as f64, u[i] as f64);
            let want = x / (1.0 + (-x).exp()) * v;
            let err = (a[i] as f64 - want).abs();
            assert!(err <= 1e-6 * (1.0 + want.abs()), "{i}: {err}");
        }
    }
}
