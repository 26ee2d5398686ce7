//! Dense matmuls on `gemm`, in the layouts a linear layer needs.
//!
//! Matrices are row-major. A linear layer's weight is `[out, in]` (Hugging Face layout) and
//! `y = x · Wᵀ`.

use std::sync::Arc;

use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use crate::backend::LinearShape;
use crate::blas::{BlasError, BlasOp, OpenBlas};
pub use crate::mat::{transpose, transposed, Mat};

mod operands;
pub use operands::HostOperand;

/// The library a backend runs the linear layers' products on (`train.matmul`): `gemm`, or a
/// loaded OpenBLAS. Attention's small tile products always use `gemm`.
#[derive(Debug, Clone, Default)]
pub enum HostMatmul {
    /// The `gemm` crate.
    #[default]
    Gemm,
    /// OpenBLAS's `cblas_sgemm` ([`crate::blas`]).
    OpenBlas(Arc<OpenBlas>),
    /// Products in bf16 with f32 sums on AVX-512 BF16 ([`crate::bf16_gemm`]).
    Bf16,
}

impl HostMatmul {
    /// The library `choice` names, loading OpenBLAS when asked for.
    pub fn load(choice: ferrotron_config::Matmul) -> Result<HostMatmul, BlasError> {
        Ok(match choice {
            ferrotron_config::Matmul::Gemm => HostMatmul::Gemm,
            ferrotron_config::Matmul::OpenBlas => HostMatmul::OpenBlas(OpenBlas::load()?),
            ferrotron_config::Matmul::Bf16 if crate::bf16_gemm::available() => HostMatmul::Bf16,
            ferrotron_config::Matmul::Bf16 => return Err(BlasError::NoBf16),
        })
    }

    /// What runs the products, for logs and reports.
    pub fn describe(&self) -> String {
        match self {
            HostMatmul::Gemm => "gemm 0.19".into(),
            HostMatmul::OpenBlas(b) => b.describe().into(),
            HostMatmul::Bf16 => "bf16 products, f32 sums (AVX-512 BF16)".into(),
        }
    }

    /// [`linear_forward`] on this library.
    pub fn linear_forward(
        &self,
        y: &mut [f32],
        x: &[f32],
        w: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    ) {
        match self {
            HostMatmul::Gemm => linear_forward(y, x, w, t, d_in, d_out),
            HostMatmul::Bf16 => {
                let (x, w) = (HostOperand::F32(x), HostOperand::F32(w));
                self.forward(y, x, w, LinearShape::new(t, d_in, d_out))
            }
            HostMatmul::OpenBlas(b) => {
                let op = BlasOp {
                    m: t,
                    n: d_out,
                    k: d_in,
                    ta: false,
                    tb: true,
                    lda: d_in,
                    ldb: d_in,
                    ldc: d_out,
                };
                b.gemm(op, x, w, 0.0, y, true)
            }
        }
    }

    /// [`linear_backward_input`] on this library.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward_input(
        &self,
        dx: &mut [f32],
        dy: &[f32],
        w: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
        accumulate: bool,
    ) {
        match self {
            HostMatmul::Gemm => linear_backward_input(dx, dy, w, t, d_in, d_out, accumulate),
            HostMatmul::Bf16 => {
                let (dy, w) = (HostOperand::F32(dy), HostOperand::F32(w));
                let sh = LinearShape::new(t, d_in, d_out);
                self.backward_input((dx, accumulate), dy, w, sh)
            }
            HostMatmul::OpenBlas(b) => {
                let op = BlasOp {
                    m: t,
                    n: d_in,
                    k: d_out,
                    ta: false,
                    tb: false,
                    lda: d_out,
                    ldb: d_in,
                    ldc: d_in,
                };
                b.gemm(op, dy, w, if accumulate { 1.0 } else { 0.0 }, dx, true)
            }
        }
    }

    /// [`linear_backward_weight`] on this library.
    pub fn linear_backward_weight(
        &self,
        dw: &mut [f32],
        dy: &[f32],
        x: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    ) {
        match self {
            HostMatmul::Gemm => linear_backward_weight(dw, dy, x, t, d_in, d_out),
            HostMatmul::Bf16 => {
                let (dy, x) = (HostOperand::F32(dy), HostOperand::F32(x));
                self.backward_weight(dw, dy, x, LinearShape::new(t, d_in, d_out))
            }
            HostMatmul::OpenBlas(b) => {
                let op = BlasOp {
                    m: d_out,
                    n: d_in,
                    k: t,
                    ta: true,
                    tb: false,
                    lda: d_out,
                    ldb: d_in,
                    ldc: d_in,
                };
                b.gemm(op, dy, x, 1.0, dw, true)
            }
        }
    }
}

/// How many threads a matmul may use: all of the current rayon pool, or one (inside an
/// already parallel region).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// Use the current rayon pool.
    Pool,
    /// Run on the calling thread.
    Single,
}

/// `dst[m×n] (+)= lhs[m×k] · rhs[k×n]` with arbitrary strides.
///
/// # Safety contract (checked in debug builds)
/// Every index reached through the strides lies inside its slice.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dl: Mat,
    accumulate: bool,
    lhs: &[f32],
    ll: Mat,
    rhs: &[f32],
    rl: Mat,
    threads: Threads,
) {
    if m == 0 || n == 0 {
        return;
    }
    debug_assert!(last_index(m, n, dl) < dst.len());
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst[(i as isize * dl.rs + j as isize * dl.cs) as usize] = 0.0;
                }
            }
        }
        return;
    }
    debug_assert!(last_index(m, k, ll) < lhs.len());
    debug_assert!(last_index(k, n, rl) < rhs.len());
    let par = match threads {
        Threads::Pool if m * n * k >= 32 * 32 * 32 => {
            Parallelism::Rayon(rayon::current_num_threads())
        }
        _ => Parallelism::None,
    };
    // SAFETY: the strides keep every access inside the slices (debug-asserted above), and
    // `dst` does not alias `lhs` or `rhs` (distinct borrows).
    unsafe {
        gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dl.cs,
            dl.rs,
            accumulate,
            lhs.as_ptr(),
            ll.cs,
            ll.rs,
            rhs.as_ptr(),
            rl.cs,
            rl.rs,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

fn last_index(r: usize, c: usize, l: Mat) -> usize {
    ((r as isize - 1) * l.rs + (c as isize - 1) * l.cs) as usize
}

/// `y[t×out] = x[t×in] · Wᵀ` with `w` as `[out, in]`. Where
/// [`ferrotron_config::forward_transposes_weight`] says so, the weight is first copied
/// transposed (`[in, out]`, for the call) and the product reads the copy: `gemm` runs
/// narrow outputs of a strided weight on fewer threads (counted by
/// [`ferrotron_config::linear_pack_bytes`]).
pub fn linear_forward(y: &mut [f32], x: &[f32], w: &[f32], t: usize, d_in: usize, d_out: usize) {
    if ferrotron_config::forward_transposes_weight(t, d_in, d_out) {
        assert_eq!(w.len(), d_in * d_out, "linear_forward: weight length");
        let wt = transposed(w, d_out, d_in);
        return matmul(
            t,
            d_out,
            d_in,
            y,
            Mat::rows(d_out),
            false,
            x,
            Mat::rows(d_in),
            &wt,
            Mat::rows(d_out),
            Threads::Pool,
        );
    }
    matmul(
        t,
        d_out,
        d_in,
        y,
        Mat::rows(d_out),
        false,
        x,
        Mat::rows(d_in),
        w,
        Mat::transposed(d_in),
        Threads::Pool,
    );
}

/// `dx[t×in] (+)= dy[t×out] · W`.
pub fn linear_backward_input(
    dx: &mut [f32],
    dy: &[f32],
    w: &[f32],
    t: usize,
    d_in: usize,
    d_out: usize,
    accumulate: bool,
) {
    matmul(
        t,
        d_in,
        d_out,
        dx,
        Mat::rows(d_in),
        accumulate,
        dy,
        Mat::rows(d_out),
        w,
        Mat::rows(d_in),
        Threads::Pool,
    );
}

/// `dW[out×in] += dyᵀ · x`.
pub fn linear_backward_weight(
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    t: usize,
    d_in: usize,
    d_out: usize,
) {
    matmul(
        d_out,
        d_in,
        t,
        dw,
        Mat::rows(d_in),
        true,
        dy,
        Mat::transposed(d_out),
        x,
        Mat::rows(d_in),
        Threads::Pool,
    );
}

/// `y[i, :] += b` for every row `i` of `y` (`[t, n]`, `b`: `[n]`): a linear layer's bias.
pub fn bias_forward(y: &mut [f32], b: &[f32]) {
    let n = b.len();
    assert!(
        n > 0 && y.len().is_multiple_of(n),
        "bias_forward: rows of {n}"
    );
    let rows = (ELEMS_PER_TASK / n).max(1);
    y.par_chunks_mut(rows * n).for_each(|rows| {
        for row in rows.chunks_exact_mut(n) {
            row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
        }
    });
}

/// `db += Σ_i dy[i, :]` (`dy`: `[t, n]`, `db`: `[n]`): a bias's gradient. Each column is
/// summed row by row in order, so the result does not depend on the thread count.
pub fn bias_backward(db: &mut [f32], dy: &[f32]) {
    let n = db.len();
    assert!(
        n > 0 && dy.len().is_multiple_of(n),
        "bias_backward: rows of {n}"
    );
    const COLS: usize = 64;
    db.par_chunks_mut(COLS).enumerate().for_each(|(c, out)| {
        let cols = c * COLS..c * COLS + out.len();
        for row in dy.chunks_exact(n) {
            out.iter_mut()
                .zip(&row[cols.clone()])
                .for_each(|(o, g)| *o += g);
        }
    });
}

/// Elements per task of [`bias_forward`] (about; whole rows).
const ELEMS_PER_TASK: usize = 1 << 14;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_forward_and_backward_match_loops() {
        let (t, n) = (37, 131);
        let dy: Vec<f32> = (0..t * n).map(|v| (v as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..n).map(|v| (v as f32 * 0.91).cos()).collect();
        let mut y = dy.clone();
        bias_forward(&mut y, &b);
        for i in 0..t {
            for j in 0..n {
                assert_eq!(y[i * n + j], dy[i * n + j] + b[j]);
            }
        }
        let mut db = b.clone();
        bias_backward(&mut db, &dy);
        for j in 0..n {
            let mut want = b[j];
            for i in 0..t {
                want += dy[i * n + j];
            }
            assert_eq!(db[j], want, "column {j}");
        }
    }

    fn naive(x: &[f32], w: &[f32], t: usize, i: usize, o: usize) -> Vec<f32> {
        let mut y = vec![0.0; t * o];
        for a in 0..t {
            for b in 0..o {
                y[a * o + b] = (0..i).map(|c| x[a * i + c] * w[b * i + c]).sum();
            }
        }
        y
    }

    #[test]
    fn forward_and_backward_match_naive() {
        let (t, i, o) = (7, 5, 3);
        let x: Vec<f32> = (0..t * i).map(|v| (v as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..o * i).map(|v| (v as f32 * 0.91).cos()).collect();
        let mut y = vec![0.0; t * o];
        linear_forward(&mut y, &x, &w, t, i, o);
        let want = naive(&x, &w, t, i, o);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5);
        }
        // dx = dy · W; dW = dyᵀ · x, checked against naive sums.
        let dy: Vec<f32> = (0..t * o).map(|v| (v as f32 * 0.13).sin()).collect();
        let mut dx = vec![0.0; t * i];
        linear_backward_input(&mut dx, &dy, &w, t, i, o, false);
        let mut dw = vec![0.0; o * i];
        linear_backward_weight(&mut dw, &dy, &x, t, i, o);
        for a in 0..t {
            for c in 0..i {
                let s: f32 = (0..o).map(|b| dy[a * o + b] * w[b * i + c]).sum();
                assert!((dx[a * i + c] - s).abs() < 1e-5);
            }
        }
        for b in 0..o {
            for c in 0..i {
                let s: f32 = (0..t).map(|a| dy[a * o + b] * x[a * i + c]).sum();
                assert!((dw[b * i + c] - s).abs() < 1e-5);
            }
        }
    }
}
