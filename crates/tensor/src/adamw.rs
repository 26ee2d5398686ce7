//! AdamW with decoupled weight decay and bias correction.

use rayon::prelude::*;

use crate::PAR_CHUNK;

/// Hyper-parameters of one AdamW update.
#[derive(Debug, Clone, Copy)]
pub struct AdamW {
    /// Learning rate of this step.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator guard.
    pub eps: f32,
    /// Decoupled weight decay (0 for parameters excluded from decay).
    pub weight_decay: f32,
    /// 1-based step number, for bias correction.
    pub step: u64,
}

/// The per-step constants of the update: the bias-corrected step size `lr / (1 − β₁ᵗ)`,
/// `√(1 − β₂ᵗ)`, and the decay factor `1 − lr·weight_decay` (every backend's AdamW uses them).
#[derive(Debug, Clone, Copy)]
pub struct StepConstants {
    /// `lr / (1 − β₁ᵗ)`.
    pub step_size: f32,
    /// `√(1 − β₂ᵗ)`.
    pub bc2_sqrt: f32,
    /// `1 − lr·weight_decay`.
    pub decay: f32,
}

impl AdamW {
    /// This step's constants (bias corrections in f64, then rounded once).
    pub fn constants(&self) -> StepConstants {
        let bc1 = 1.0 - (self.beta1 as f64).powi(self.step as i32);
        let bc2 = 1.0 - (self.beta2 as f64).powi(self.step as i32);
        StepConstants {
            step_size: (self.lr as f64 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            decay: 1.0 - self.lr * self.weight_decay,
        }
    }
}

/// Updates `param` in place from `grad` (already clipped/scaled by `grad_scale`), with the
/// moments `m`, `v`.
pub fn adamw_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    grad_scale: f32,
    h: AdamW,
) {
    let StepConstants {
        step_size,
        bc2_sqrt,
        decay,
    } = h.constants();
    param
        .par_chunks_mut(PAR_CHUNK)
        .zip(grad.par_chunks(PAR_CHUNK))
        .zip(m.par_chunks_mut(PAR_CHUNK).zip(v.par_chunks_mut(PAR_CHUNK)))
        .for_each(|((p, g), (m, v))| {
            for i in 0..p.len() {
                let g = g[i] * grad_scale;
                m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g;
                v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
                let denom = v[i].sqrt() / bc2_sqrt + h.eps;
                p[i] = p[i] * decay - step_size * m[i] / denom;
            }
        });
}

/// The label of the transfer that brings the clipping's squared norms to the host, once a
/// step ([`crate::kernels::OptimizerKernels::sum_squares_ranges`]).
pub const SQUARED_NORMS: &str = "squared norms";

/// Sum of squares of `x` in f64 (for the global gradient norm).
pub fn sum_squares(x: &[f32]) -> f64 {
    sum_squares_of(x, |v| v as f64)
}

/// Sum of squares of `x` (bf16) in f64: [`sum_squares`] of its widened values, bit for bit.
pub fn sum_squares_bf16(x: &[half::bf16]) -> f64 {
    sum_squares_of(x, |v| v.to_f32() as f64)
}

/// `Σ f(x)²` in f64. Within a chunk, 8 lanes (lane `l` takes the indices `≡ l mod 8`) joined
/// in a fixed order: a sum in order is one chain of dependent adds (a gradient norm at
/// 3 GB/s). Per-chunk partial sums in chunk order, then added in order: the same value
/// whatever the threads (a parallel `sum` adds in the order work was stolen).
fn sum_squares_of<T: Copy + Sync>(x: &[T], f: impl Fn(T) -> f64 + Sync) -> f64 {
    let partial: Vec<f64> = x
        .par_chunks(PAR_CHUNK)
        .map(|c| sum_squares_chunk(c, &f))
        .collect();
    partial.iter().sum()
}

/// `Σ f(x)²` in f64 over 8 lanes, joined in a fixed order.
fn sum_squares_chunk<T: Copy>(x: &[T], f: &impl Fn(T) -> f64) -> f64 {
    let x8 = x.chunks_exact(8);
    let tail = x8.remainder().iter().fold(0.0, |s, &v| s + f(v) * f(v));
    let mut acc = [0.0f64; 8];
    for c in x8 {
        for l in 0..8 {
            acc[l] += f(c[l]) * f(c[l]);
        }
    }
    crate::fastmath::join8(acc, tail, |a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_by_lr_times_sign() {
        // With bias correction, step 1 moves each parameter by lr·g/(|g|+ε') ≈ lr·sign(g).
        let mut p = vec![1.0f32, -2.0];
        let g = vec![0.5f32, -3.0];
        let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
        let h = AdamW {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
        };
        adamw_update(&mut p, &g, &mut m, &mut v, 1.0, h);
        assert!((p[0] - 0.99).abs() < 1e-6, "{}", p[0]);
        assert!((p[1] + 1.99).abs() < 1e-6, "{}", p[1]);
    }

    /// The backend's ranges kernel: each range's squared norm as `sum_squares` gives it (for
    /// bf16, of the widened values) against an f64 sum in order, all in one transfer.
    #[test]
    fn squared_norms_of_ranges_come_back_in_one_transfer() {
        use crate::kernels::OptimizerKernels;
        use crate::{Category, CpuBackend, Ledger, Operand};
        let n = 3 * PAR_CHUNK + 13;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let wide: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let ranges = [0..n, 5..PAR_CHUNK + 9, n - 3..n, 7..7];
        let ledger = Ledger::new();
        let (xd, bd) = (
            ledger.upload(Category::Workspace, "x", &x),
            ledger.upload(Category::Workspace, "x", &xb),
        );
        ledger.reset_transfers();
        let be = CpuBackend::default();
        let f = be.sum_squares_ranges(&ledger, Operand::F32(&xd), &ranges);
        let b = be.sum_squares_ranges(&ledger, Operand::Bf16(&bd), &ranges);
        for (i, r) in ranges.iter().enumerate() {
            assert_eq!(
                f[i].to_bits(),
                sum_squares(&x[r.clone()]).to_bits(),
                "{r:?}"
            );
            assert_eq!(
                b[i].to_bits(),
                sum_squares(&wide[r.clone()]).to_bits(),
                "{r:?}"
            );
            let exact: f64 = x[r.clone()].iter().map(|&v| (v as f64) * (v as f64)).sum();
            assert!((f[i] - exact).abs() <= 1e-12 * exact.max(1.0), "{r:?}");
        }
        assert_eq!(f[3], 0.0);
        let t = ledger.transfers()[SQUARED_NORMS];
        assert_eq!((t.to_host, t.to_host_bytes), (2, 2 * 8 * ranges.len()));
    }
}
