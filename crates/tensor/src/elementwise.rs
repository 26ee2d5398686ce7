//! Element-wise kernels outside any layer: the residual add, copies, fills, in-place sums and
//! scaling.

use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 14;

/// `out = a + b`, element by element.
pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(
        out.len() == a.len() && a.len() == b.len(),
        "add: lengths differ"
    );
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| {
            o.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(o, (a, b))| *o = a + b)
        });
}

/// `dst = src` (one `memcpy`: bound by memory bandwidth, which one core saturates here).
pub fn copy<T: Copy + Send + Sync>(dst: &mut [T], src: &[T]) {
    dst.copy_from_slice(src);
}

/// Every element of `dst` set to `value` (one pass, as [`copy`]).
pub fn fill<T: Copy + Send + Sync>(dst: &mut [T], value: T) {
    dst.fill(value);
}

/// `dst += src`, element by element.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "add_assign: lengths differ");
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += s));
}

/// `dst = round(dst + src)` for bf16 `dst`: widened, added in f32, rounded once.
pub fn add_assign_bf16(dst: &mut [half::bf16], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "add_assign_bf16: lengths differ");
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| {
            d.iter_mut()
                .zip(s)
                .for_each(|(d, s)| *d = half::bf16::from_f32(d.to_f32() + s))
        });
}

/// `dst *= s`.
pub fn scale(dst: &mut [f32], s: f32) {
    dst.par_chunks_mut(CHUNK)
        .for_each(|d| d.iter_mut().for_each(|x| *x *= s));
}

#[cfg(test)]
mod tests {
    use super::add;
    use crate::rmsnorm::{rmsnorm_apply, rmsnorm_forward};

    #[test]
    fn residual_add_and_the_restored_norm_are_exact() {
        let n = 3 * (1 << 14) + 5;
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = vec![0.0; n];
        add(&mut out, &a, &b);
        assert!(out
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(o, (a, b))| *o == a + b));
        // The norm rebuilt from the saved reciprocal RMS equals the forward's, bit for bit.
        let (t, h) = (37, 24);
        let x: Vec<f32> = (0..t * h).map(|i| (i as f32 * 0.23).sin() * 3.0).collect();
        let w: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 / h as f32).collect();
        let (mut y, mut rstd) = (vec![0.0; t * h], vec![0.0; t]);
        rmsnorm_forward(&mut y, &mut rstd, &x, &w, h, 1e-5);
        let mut again = vec![f32::NAN; t * h];
        rmsnorm_apply(&mut again, &x, &rstd, &w, h);
        assert_eq!(y, again);
    }
}
