//! The reference implementation's Newton–Schulz steps on the host in f64, line by line
//! (a tall matrix transposed first, as `zeropower_via_newtonschulz5` does): an oracle for
//! tests and checks, sharing no code with [`super::newton_schulz`].

use super::{NS_COEFFS, NS_EPS};

/// `[r, k] · [k, c]` in f64, row-major.
pub fn matmul(a: &[f64], b: &[f64], r: usize, k: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            out[i * c + j] = (0..k).map(|l| a[i * k + l] * b[l * c + j]).sum();
        }
    }
    out
}

/// `aᵀ` of `a` (`[r, c]`), row-major.
pub fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = a[i * c + j];
        }
    }
    out
}

/// The orthogonalised iterate of `g` (`[rows, cols]`) after `steps` iterations, in f64.
pub fn newton_schulz_f64(g: &[f64], rows: usize, cols: usize, steps: usize) -> Vec<f64> {
    let (a, b, c) = (NS_COEFFS.0 as f64, NS_COEFFS.1 as f64, NS_COEFFS.2 as f64);
    let tall = rows > cols;
    let (mut x, r, k) = if tall {
        (transpose(g, rows, cols), cols, rows)
    } else {
        (g.to_vec(), rows, cols)
    };
    let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
    x.iter_mut().for_each(|v| *v /= norm + NS_EPS);
    for _ in 0..steps {
        let am = matmul(&x, &transpose(&x, r, k), r, k, r);
        let aa = matmul(&am, &am, r, r, r);
        let bm: Vec<f64> = am.iter().zip(&aa).map(|(p, q)| b * p + c * q).collect();
        let bx = matmul(&bm, &x, r, r, k);
        x = x.iter().zip(&bx).map(|(p, q)| a * p + q).collect();
    }
    if tall {
        transpose(&x, r, k)
    } else {
        x
    }
}
