//! Muon's kernels: the momentum update, element by element, and the quintic Newton–Schulz
//! iteration that orthogonalises a whole matrix, composed of the backend's products and
//! element-wise kernels (so it runs wherever they do).
//!
//! Keller Jordan's reference (`zeropower_via_newtonschulz5`): `X = G / (‖G‖_F + 1e-7)`, then
//! `steps` times `A = X·Xᵀ`, `B = b·A + c·A·A`, `X = a·X + B·X`, with a tall `G` transposed
//! first so that `A` is the smaller Gram matrix. Here a tall `X` keeps its layout and uses
//! the other Gram matrix, `A = Xᵀ·X` and `X = a·X + X·B`, the same iterate transposed back.
//! The reference runs the iteration in bf16; here it runs in f32.

use rayon::prelude::*;

pub use ferrotron_config::{newton_schulz_flops, newton_schulz_scratch_elems};

use crate::{Category, Device, DeviceSlice, LinearShape, Operand, PAR_CHUNK};

/// The quintic's coefficients `(a, b, c)` of the reference implementation.
pub const NS_COEFFS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);

/// Added to the Frobenius norm before the first iterate is normalised.
pub const NS_EPS: f64 = 1e-7;

/// Hyper-parameters of one momentum update.
#[derive(Debug, Clone, Copy)]
pub struct MuonMomentum {
    /// Momentum coefficient β.
    pub beta: f32,
    /// Nesterov: the update is `(1 − β)·g + β·m` instead of `m`.
    pub nesterov: bool,
}

/// `g' = grad_scale·g`, `m ← β·m + (1 − β)·g'`, and `u` = the update to orthogonalise:
/// `(1 − β)·g' + β·m` (Nesterov) or `m`.
pub fn muon_momentum(u: &mut [f32], m: &mut [f32], g: &[f32], grad_scale: f32, h: MuonMomentum) {
    let b = h.beta;
    u.par_chunks_mut(PAR_CHUNK)
        .zip(m.par_chunks_mut(PAR_CHUNK))
        .zip(g.par_chunks(PAR_CHUNK))
        .for_each(|((u, m), g)| {
            for i in 0..u.len() {
                let g = g[i] * grad_scale;
                m[i] = b * m[i] + (1.0 - b) * g;
                u[i] = if h.nesterov {
                    (1.0 - b) * g + b * m[i]
                } else {
                    m[i]
                };
            }
        });
}

/// Replaces `x` (`[rows, cols]`, row-major) by its orthogonalised iterate after `steps`
/// quintic Newton–Schulz iterations. The scratch ([`newton_schulz_scratch_elems`]) is
/// counted as workspace while it lives; the matrix's squared norm is one host transfer.
pub fn newton_schulz(
    dev: Device<'_>,
    x: &mut DeviceSlice<f32>,
    rows: usize,
    cols: usize,
    steps: usize,
) {
    assert_eq!(x.len(), rows * cols, "newton_schulz: matrix length");
    let (ledger, be) = (dev.ledger, dev.backend);
    let norm = be.sum_squares(ledger, x).sqrt();
    be.scale(x, (1.0 / (norm + NS_EPS)) as f32);
    let (a, b, c) = NS_COEFFS;
    let tall = rows > cols;
    let p = rows.min(cols);
    let mut gram = ledger.zeros::<f32>(Category::Workspace, p * p);
    let mut poly = ledger.zeros::<f32>(Category::Workspace, p * p);
    let mut step = ledger.zeros::<f32>(Category::Workspace, rows * cols);
    let square = LinearShape::new(p, p, p);
    for _ in 0..steps {
        if tall {
            // A = Xᵀ·X: the weight-gradient product over the rows of X.
            be.fill(&mut gram, 0.0);
            be.linear_backward_weight(
                &mut gram,
                Operand::F32(x),
                Operand::F32(x),
                LinearShape::new(rows, cols, cols),
            );
        } else {
            // A = X·Xᵀ.
            be.linear_forward(
                &mut gram,
                Operand::F32(x),
                Operand::F32(x),
                LinearShape::new(rows, cols, rows),
            );
        }
        // B = b·A + c·A·A (A is symmetric: A·Aᵀ = A·A).
        be.linear_forward(&mut poly, Operand::F32(&gram), Operand::F32(&gram), square);
        be.scale(&mut poly, c);
        be.scale(&mut gram, b);
        be.add_assign(&mut poly, &gram);
        if tall {
            // X·B = X·Bᵀ.
            be.linear_forward(
                &mut step,
                Operand::F32(x),
                Operand::F32(&poly),
                LinearShape::new(rows, cols, cols),
            );
        } else {
            // B·X.
            be.linear_backward_input(
                &mut step,
                Operand::F32(&poly),
                Operand::F32(x),
                LinearShape::new(rows, cols, rows),
                false,
            );
        }
        be.scale(x, a);
        be.add_assign(x, &step);
    }
}

pub mod reference;
#[cfg(test)]
mod tests;
