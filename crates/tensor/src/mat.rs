//! Strides of a matrix operand: the one type the host matmuls share.

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
