//! The linear layers' products over operands of either precision: the host side of the
//! precision seam. With bf16 products a bf16 operand is packed as it is stored, with no
//! f32 copy; on `gemm` or OpenBLAS it is widened first (exactly), so every library gives the
//! product of the same values.

use std::borrow::Cow;

use half::bf16;

use super::HostMatmul;
use crate::backend::LinearShape;
use crate::bf16_gemm::matmul_bf16;
use crate::mat::Mat;

/// A host operand of a product: f32 or bf16 elements.
#[derive(Clone, Copy)]
pub enum HostOperand<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
}

impl HostOperand<'_> {
    /// The elements as f32: borrowed, or widened (exactly) into a copy.
    pub fn widened(&self) -> Cow<'_, [f32]> {
        match self {
            HostOperand::F32(x) => Cow::Borrowed(x),
            HostOperand::Bf16(x) => Cow::Owned(x.iter().map(|v| v.to_f32()).collect()),
        }
    }
}

/// `dst[m×n] (+)= a · b` on the bf16 products, each operand read in its own precision.
fn bf16_product(
    mnk: (usize, usize, usize),
    (dst, ldc, accumulate): (&mut [f32], usize, bool),
    (a, am): (HostOperand<'_>, Mat),
    (b, bm): (HostOperand<'_>, Mat),
) {
    use HostOperand::{Bf16, F32};
    match (a, b) {
        (F32(a), F32(b)) => matmul_bf16(mnk, dst, ldc, accumulate, a, am, b, bm),
        (F32(a), Bf16(b)) => matmul_bf16(mnk, dst, ldc, accumulate, a, am, b, bm),
        (Bf16(a), F32(b)) => matmul_bf16(mnk, dst, ldc, accumulate, a, am, b, bm),
        (Bf16(a), Bf16(b)) => matmul_bf16(mnk, dst, ldc, accumulate, a, am, b, bm),
    }
}

impl HostMatmul {
    /// Whether a bf16 operand is read as stored (the bf16 products), not widened first.
    pub fn reads_bf16(&self) -> bool {
        matches!(self, HostMatmul::Bf16)
    }

    /// [`HostMatmul::linear_forward`] over operands of either precision (its bf16 products
    /// run here).
    pub fn forward(&self, y: &mut [f32], x: HostOperand<'_>, w: HostOperand<'_>, sh: LinearShape) {
        let LinearShape { t, d_in, d_out } = sh;
        match (self, x, w) {
            (HostMatmul::Bf16, x, w) => bf16_product(
                (t, d_out, d_in),
                (y, d_out, false),
                (x, Mat::rows(d_in)),
                (w, Mat::transposed(d_in)),
            ),
            _ => self.linear_forward(y, &x.widened(), &w.widened(), t, d_in, d_out),
        }
    }

    /// [`HostMatmul::linear_backward_input`] over operands of either precision.
    pub fn backward_input(
        &self,
        (dx, accumulate): (&mut [f32], bool),
        dy: HostOperand<'_>,
        w: HostOperand<'_>,
        sh: LinearShape,
    ) {
        let LinearShape { t, d_in, d_out } = sh;
        match (self, dy, w) {
            (HostMatmul::Bf16, dy, w) => bf16_product(
                (t, d_in, d_out),
                (dx, d_in, accumulate),
                (dy, Mat::rows(d_out)),
                (w, Mat::rows(d_in)),
            ),
            _ => {
                let (dy, w) = (dy.widened(), w.widened());
                self.linear_backward_input(dx, &dy, &w, t, d_in, d_out, accumulate)
            }
        }
    }

    /// [`HostMatmul::linear_backward_weight`] over operands of either precision.
    pub fn backward_weight(
        &self,
        dw: &mut [f32],
        dy: HostOperand<'_>,
        x: HostOperand<'_>,
        sh: LinearShape,
    ) {
        let LinearShape { t, d_in, d_out } = sh;
        match (self, dy, x) {
            (HostMatmul::Bf16, dy, x) => bf16_product(
                (d_out, d_in, t),
                (dw, d_in, true),
                (dy, Mat::transposed(d_out)),
                (x, Mat::rows(d_in)),
            ),
            _ => self.linear_backward_weight(dw, &dy.widened(), &x.widened(), t, d_in, d_out),
        }
    }
}
