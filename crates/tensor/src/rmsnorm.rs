//! RMSNorm (Hugging Face Llama): `y = w ⊙ x / sqrt(mean(x²) + ε)`.

use rayon::prelude::*;

/// Rows per rayon task.
const ROWS: usize = 16;

/// Rows per block of the backward's weight-gradient partials (fixed, for a fixed order).
const DW_ROWS: usize = 64;

/// `Σ a_i·b_i·c_i` in 8 lanes (lane `l` takes the indices `≡ l mod 8`), then the lanes and the
/// tail in a fixed order: the same value on any thread, and no chain of dependent adds as
/// long as the row (a sum in order ran at a quarter of the memory bandwidth).
#[inline]
fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let (a8, b8, c8) = (a.chunks_exact(8), b.chunks_exact(8), c.chunks_exact(8));
    let tail = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .zip(c8.remainder())
        .fold(0.0, |s, ((a, b), c)| s + a * b * c);
    let mut acc = [0.0f32; 8];
    for ((a, b), c) in a8.zip(b8).zip(c8) {
        for l in 0..8 {
            acc[l] += a[l] * b[l] * c[l];
        }
    }
    crate::fastmath::join8(acc, tail, |a, b| a + b)
}

/// `Σ a_i·b_i`, as [`dot3`].
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .fold(0.0, |s, (a, b)| s + a * b);
    let mut acc = [0.0f32; 8];
    for (a, b) in a8.zip(b8) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    crate::fastmath::join8(acc, tail, |a, b| a + b)
}

/// Forward over `t` rows of width `h`. Writes `y` and the reciprocal RMS of every row
/// (`rstd[t]`, kept for backward).
pub fn rmsnorm_forward(y: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], h: usize, eps: f32) {
    y.par_chunks_mut(h * ROWS)
        .zip(rstd.par_chunks_mut(ROWS))
        .zip(x.par_chunks(h * ROWS))
        .for_each(|((y, r), x)| {
            for ((y, r), x) in y.chunks_mut(h).zip(r.iter_mut()).zip(x.chunks(h)) {
                let ms = dot(x, x) / h as f32;
                *r = 1.0 / (ms + eps).sqrt();
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = x * *r * w;
                }
            }
        });
}

/// `y = x · rstd · w` over rows of width `h`: the normalised output again from the input and
/// the reciprocal RMS the forward kept (bit-identical to the forward's `y`).
pub fn rmsnorm_apply(y: &mut [f32], x: &[f32], rstd: &[f32], w: &[f32], h: usize) {
    y.par_chunks_mut(h * ROWS)
        .zip(x.par_chunks(h * ROWS))
        .zip(rstd.par_chunks(ROWS))
        .for_each(|((y, x), r)| {
            for ((y, x), r) in y.chunks_mut(h).zip(x.chunks(h)).zip(r) {
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = x * *r * w;
                }
            }
        });
}

/// Backward: `dx = r·(dn − n·mean(dn ⊙ n))` with `n = x·r`, `dn = dy ⊙ w`; `dw += Σ dy ⊙ n`.
/// `dx` is overwritten (or added to when `accumulate`).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    rstd: &[f32],
    w: &[f32],
    h: usize,
    accumulate: bool,
) {
    // Each block of rows adds its `dy ⊙ n` into a partial of its own, and the partials are
    // added in block order: `dw` does not depend on how the blocks were spread over threads.
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(h * DW_ROWS)
        .zip(dy.par_chunks(h * DW_ROWS))
        .zip(x.par_chunks(h * DW_ROWS))
        .zip(rstd.par_chunks(DW_ROWS))
        .map(|(((dx, dy), x), r)| {
            let mut acc = vec![0.0f32; h];
            for (((dx, dy), x), r) in dx.chunks_mut(h).zip(dy.chunks(h)).zip(x.chunks(h)).zip(r) {
                let mean = r * dot3(dy, w, x) / h as f32;
                for (i, ((dx, dy), x)) in dx.iter_mut().zip(dy).zip(x).enumerate() {
                    let n = x * r;
                    let g = r * (dy * w[i] - n * mean);
                    if accumulate {
                        *dx += g;
                    } else {
                        *dx = g;
                    }
                    acc[i] += dy * n;
                }
            }
            acc
        })
        .collect();
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(d, p)| *d += p);
    }
}
