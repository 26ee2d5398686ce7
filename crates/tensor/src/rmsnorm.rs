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
            for (((dx, dy), x), &r) in dx.chunks_mut(h).zip(dy.chunks(h)).zip(x.chunks(h)).zip(r) {
                let mean = r * dot3(dy, w, x) / h as f32;
                let terms = dy.iter().zip(x).zip(w).zip(acc.iter_mut());
                // Two loops rather than a test per element: each vectorises on its own.
                if accumulate {
                    for (dx, (((dy, x), w), acc)) in dx.iter_mut().zip(terms) {
                        let n = x * r;
                        *dx += r * (dy * w - n * mean);
                        *acc += dy * n;
                    }
                } else {
                    for (dx, (((dy, x), w), acc)) in dx.iter_mut().zip(terms) {
                        let n = x * r;
                        *dx = r * (dy * w - n * mean);
                        *acc += dy * n;
                    }
                }
            }
            acc
        })
        .collect();
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(d, p)| *d += p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows past a block of [`DW_ROWS`], a width past the 8 lanes: accumulating adds the
    /// overwriting call's `dx` to what was there, element by element, and both calls add
    /// the same `dw`.
    #[test]
    fn accumulate_adds_what_overwrite_writes() {
        let (t, h) = (DW_ROWS + 5, 37);
        let val = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * s).sin()).collect() };
        let (x, dy, w) = (val(t * h, 0.37), val(t * h, 0.71), val(h, 0.13));
        let (mut y, mut rstd) = (vec![0.0; t * h], vec![0.0; t]);
        rmsnorm_forward(&mut y, &mut rstd, &x, &w, h, 1e-5);
        let (mut over, mut dw1) = (vec![f32::NAN; t * h], vec![0.5; h]);
        rmsnorm_backward(&mut over, &mut dw1, &dy, &x, &rstd, &w, h, false);
        let before = val(t * h, 1.9);
        let (mut acc, mut dw2) = (before.clone(), vec![0.5; h]);
        rmsnorm_backward(&mut acc, &mut dw2, &dy, &x, &rstd, &w, h, true);
        for i in 0..t * h {
            assert_eq!(acc[i].to_bits(), (before[i] + over[i]).to_bits(), "dx[{i}]");
        }
        assert_eq!(dw1, dw2);
        // dx against the formula in f64 for one row.
        let row = DW_ROWS + 2;
        let (xr, dr) = (&x[row * h..][..h], &dy[row * h..][..h]);
        let r = rstd[row] as f64;
        let mean: f64 = (0..h)
            .map(|i| (dr[i] * w[i] * xr[i]) as f64 * r)
            .sum::<f64>()
            / h as f64;
        for i in 0..h {
            let want = r * (dr[i] as f64 * w[i] as f64 - xr[i] as f64 * r * mean);
            assert!((over[row * h + i] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
        }
    }
}
