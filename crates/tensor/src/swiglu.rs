//! SwiGLU: `act = silu(gate) ⊙ up`, `silu(x) = x·σ(x)`.

use rayon::prelude::*;

use crate::PAR_CHUNK;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `act = silu(gate) ⊙ up`.
pub fn swiglu_forward(act: &mut [f32], gate: &[f32], up: &[f32]) {
    act.par_chunks_mut(PAR_CHUNK)
        .zip(gate.par_chunks(PAR_CHUNK))
        .zip(up.par_chunks(PAR_CHUNK))
        .for_each(|((a, g), u)| {
            for ((a, g), u) in a.iter_mut().zip(g).zip(u) {
                *a = g * sigmoid(*g) * u;
            }
        });
}

/// Given `dact`, writes `dgate = dact ⊙ up ⊙ σ(g)(1 + g(1 − σ(g)))` and `dup = dact ⊙ silu(g)`.
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dact: &[f32], gate: &[f32], up: &[f32]) {
    dgate
        .par_chunks_mut(PAR_CHUNK)
        .zip(dup.par_chunks_mut(PAR_CHUNK))
        .zip(dact.par_chunks(PAR_CHUNK))
        .zip(gate.par_chunks(PAR_CHUNK).zip(up.par_chunks(PAR_CHUNK)))
        .for_each(|(((dg, du), da), (g, u))| {
            for i in 0..dg.len() {
                let s = sigmoid(g[i]);
                let silu = g[i] * s;
                dg[i] = da[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
                du[i] = da[i] * silu;
            }
        });
}
