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

    #[test]
    fn every_path_gives_the_same_bits_and_the_reference_values() {
        let n = 3 * PAR_CHUNK + 37;
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 37) % 211) as f32 * 0.1 - 10.0)
            .collect();
        let u: Vec<f32> = (0..n)
            .map(|i| ((i * 13) % 101) as f32 * 0.02 - 1.0)
            .collect();
        let da: Vec<f32> = (0..n).map(|i| ((i * 7) % 53) as f32 * 0.03 - 0.8).collect();
        let (mut a, mut a_ref) = (vec![0.0; n], vec![0.0; n]);
        swiglu_forward(&mut a, &g, &u);
        forward_body(&mut a_ref, &g, &u);
        assert!(a
            .iter()
            .zip(&a_ref)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
        let (mut dg_ref, mut du_ref) = (vec![0.0; n], vec![0.0; n]);
        swiglu_backward(&mut dg, &mut du, &da, &g, &u);
        backward_body(&mut dg_ref, &mut du_ref, &da, &g, &u);
        assert!(dg
            .iter()
            .zip(&dg_ref)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(du
            .iter()
            .zip(&du_ref)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
        // Against silu in f64: x·σ(x)·u.
        for i in (0..n).step_by(97) {
            let (x, v) = (g[i] as f64, u[i] as f64);
            let want = x / (1.0 + (-x).exp()) * v;
            assert!(
                (a[i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{i}"
            );
        }
    }
}
