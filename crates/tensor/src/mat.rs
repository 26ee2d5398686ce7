//! Strides of a matrix operand: the one type the host matmuls share, and the transposition
//! of a row-major matrix.

use std::mem::MaybeUninit;

use crate::transpose::{transpose_raw, Block};

/// A strided view of a row-major-or-not matrix for [`crate::linear::matmul`] and
/// [`crate::bf16_gemm::matmul_bf16`].
#[derive(Clone, Copy)]
pub struct Mat {
    /// Element stride between consecutive rows.
    pub rs: isize,
    /// Element stride between consecutive columns.
    pub cs: isize,
}

impl Mat {
    /// Row-major with `cols` columns (leading dimension `ld ≥ cols`).
    pub fn rows(ld: usize) -> Mat {
        Mat {
            rs: ld as isize,
            cs: 1,
        }
    }
    /// The transpose of a row-major matrix with leading dimension `ld`.
    pub fn transposed(ld: usize) -> Mat {
        Mat {
            rs: 1,
            cs: ld as isize,
        }
    }
}

/// Rows of the destination (columns of the source) one task of [`transpose`] writes.
const TRANSPOSE_STRIPE: usize = 32;

/// `dst[c·rows + r] = src[r·cols + c]`: the `[cols × rows]` transpose of the row-major
/// `[rows × cols]` matrix `src`, over the current rayon pool in stripes of destination rows,
/// each copied in 8 × 8 tiles (the `transpose` module).
pub fn transpose(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    // SAFETY: `f32` and `MaybeUninit<f32>` have the same layout, and `transpose_into` only
    // writes initialised values.
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    transpose_into(dst, src, rows, cols);
}

/// A new `[cols × rows]` vector holding the transpose of `src` (see [`transpose`]), written
/// once: no pass of zeros ahead of the copy.
pub fn transposed(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let n = elements(rows, cols);
    let mut out = Vec::with_capacity(n);
    transpose_into(&mut out.spare_capacity_mut()[..n], src, rows, cols);
    // SAFETY: `transpose_into` wrote all `n` elements (every destination row of every stripe).
    unsafe { out.set_len(n) };
    out
}

/// `rows · cols`; panics where the product overflows (the slices' lengths are compared
/// with it, and the tiles trust that comparison).
fn elements(rows: usize, cols: usize) -> usize {
    rows.checked_mul(cols)
        .unwrap_or_else(|| panic!("transpose: {rows} × {cols} elements overflow"))
}

fn transpose_into(dst: &mut [MaybeUninit<f32>], src: &[f32], rows: usize, cols: usize) {
    use rayon::prelude::*;
    let n = elements(rows, cols);
    assert!(
        dst.len() == n && src.len() == n,
        "transpose: {} and {} elements for {rows} × {cols}",
        dst.len(),
        src.len()
    );
    if rows == 0 || cols == 0 {
        return;
    }
    dst.par_chunks_mut(TRANSPOSE_STRIPE * rows)
        .enumerate()
        .for_each(|(stripe, d)| {
            let c0 = stripe * TRANSPOSE_STRIPE;
            let b = Block {
                rows,
                cols: d.len() / rows,
                sld: cols,
                dld: rows,
            };
            // SAFETY: the stripe's source columns `c0..c0 + b.cols` of every row lie inside
            // `src` (`rows · cols` elements, asserted above) and its `b.cols` destination rows
            // of `rows` elements are `d`; `transpose_raw` writes each of them once.
            unsafe { transpose_raw(d.as_mut_ptr().cast::<f32>(), src[c0..].as_ptr(), b) };
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shape whose element count wraps around `usize` is refused, not trusted: `2 × (2⁶³ +
    /// 1)` wraps to 2, the length of both slices.
    #[test]
    #[should_panic(expected = "overflow")]
    fn an_overflowing_shape_is_refused() {
        transpose(&mut [0.0; 2], &[0.0; 2], 2, (1 << 63) + 1);
    }

    #[test]
    #[should_panic(expected = "overflow")]
    fn an_overflowing_shape_is_refused_by_transposed() {
        transposed(&[0.0; 2], 2, (1 << 63) + 1);
    }
}
