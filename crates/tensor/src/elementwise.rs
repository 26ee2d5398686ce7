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

/// Every element of `dst` set to `value`. From [`PAR_FILL_BYTES`] on, inside a rayon pool,
/// the pool's threads fill it in chunks: zeroing a step's gradients (small: 134 MB) took
/// 10.5 ms on one core at 12.7 GB/s (`bench --profile`) while the other waited. Outside a
/// pool it stays one pass on the calling thread, as a parallel fill would start rayon's
/// global pool beside the rank's own.
pub fn fill<T: Copy + Send + Sync>(dst: &mut [T], value: T) {
    let in_pool = rayon::current_thread_index().is_some();
    if in_pool && std::mem::size_of_val(dst) >= PAR_FILL_BYTES {
        dst.par_chunks_mut(CHUNK).for_each(|c| c.fill(value));
    } else {
        dst.fill(value);
    }
}

/// The size from which [`fill`] splits over the pool.
pub const PAR_FILL_BYTES: usize = 1 << 20;

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

/// `dst = round(dst + src)` for IEEE-half `dst`: widened, added in f32, rounded once.
pub fn add_assign_f16(dst: &mut [half::f16], src: &[f32]) {
    use half::slice::HalfFloatSliceExt;
    assert_eq!(dst.len(), src.len(), "add_assign_f16: lengths differ");
    const BLOCK: usize = 256;
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| {
            let mut wide = [0.0f32; BLOCK];
            for (d, s) in d.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
                let w = &mut wide[..d.len()];
                d.convert_to_f32_slice(w);
                w.iter_mut().zip(s).for_each(|(w, s)| *w += s);
                d.convert_from_f32_slice(w);
            }
        });
}

/// `dst *= s`.
pub fn scale(dst: &mut [f32], s: f32) {
    dst.par_chunks_mut(CHUNK)
        .for_each(|d| d.iter_mut().for_each(|x| *x *= s));
}

#[cfg(test)]
mod tests {
    use super::{add, fill, PAR_FILL_BYTES};
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

    #[test]
    fn fills_reach_every_element_in_and_out_of_a_pool() {
        let n = PAR_FILL_BYTES / 4 + 3 * (1 << 14) + 7; // above the threshold, a ragged chunk
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for value in [0.0f32, -2.5] {
            let mut inside = vec![1.0f32; n];
            pool.install(|| fill(&mut inside, value));
            assert!(inside.iter().all(|&x| x == value), "in a pool, {value}");
            let mut outside = vec![1.0f32; n];
            fill(&mut outside, value);
            assert!(outside.iter().all(|&x| x == value), "outside, {value}");
        }
    }
}
