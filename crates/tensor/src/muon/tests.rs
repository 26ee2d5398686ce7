//! Newton–Schulz against two implementations it does not share: the reference's steps in
//! f64 (transposing a tall matrix, as `zeropower_via_newtonschulz5` does), and the scalar
//! polynomial acting on the singular values of a matrix built from its SVD.

use super::reference::{matmul, newton_schulz_f64 as reference, transpose};
use super::*;
use crate::{CpuBackend, Ledger};

/// A deterministic matrix with entries in (−1, 1).
fn draw(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

fn on_cpu(g: &[f64], rows: usize, cols: usize, steps: usize) -> Vec<f64> {
    let (be, ledger) = (CpuBackend::default(), Ledger::new());
    let host: Vec<f32> = g.iter().map(|&v| v as f32).collect();
    let mut x = ledger.upload(Category::Workspace, "test", &host);
    newton_schulz(
        Device {
            ledger: &ledger,
            backend: &be,
        },
        &mut x,
        rows,
        cols,
        steps,
    );
    let snap = ledger.snapshot();
    assert_eq!(
        snap.current(Category::Workspace),
        4 * rows * cols,
        "scratch freed"
    );
    let scratch = 4 * newton_schulz_scratch_elems(rows, cols);
    assert_eq!(
        snap.peak(Category::Workspace),
        4 * rows * cols + scratch,
        "scratch counted"
    );
    ledger
        .download("test", &x)
        .iter()
        .map(|&v| v as f64)
        .collect()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0, f64::max)
}

#[test]
fn newton_schulz_matches_the_reference_steps_wide_tall_and_square() {
    for (rows, cols, seed) in [(24, 40, 1), (40, 24, 2), (32, 32, 3), (1, 17, 4)] {
        let g = draw(rows * cols, seed);
        let want = reference(&g, rows, cols, 5);
        let got = on_cpu(&g, rows, cols, 5);
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = max_abs_diff(&got, &want);
        // f32 products over at most 40 terms, five iterations whose gain is below 4.
        assert!(err <= 2e-5 * scale, "{rows}×{cols}: {err} (scale {scale})");
    }
}

fn identity(n: usize) -> Vec<f64> {
    let mut r = vec![0.0; n * n];
    (0..n).for_each(|k| r[k * n + k] = 1.0);
    r
}

/// A rotation in the plane of coordinates `i`, `j` (`i ≠ j`) of an `n × n` identity.
fn givens(n: usize, i: usize, j: usize, theta: f64) -> Vec<f64> {
    let mut r = identity(n);
    let (c, s) = (theta.cos(), theta.sin());
    (r[i * n + i], r[j * n + j], r[i * n + j], r[j * n + i]) = (c, c, -s, s);
    r
}

/// An orthogonal `n × n` matrix: a product of rotations.
fn orthogonal(n: usize, seed: u64) -> Vec<f64> {
    let angles = draw(n * n, seed);
    let mut q = identity(n);
    for i in 0..n {
        for j in i + 1..n {
            q = matmul(&q, &givens(n, i, j, 3.0 * angles[i * n + j]), n, n, n);
        }
    }
    q
}

#[test]
fn newton_schulz_acts_on_singular_values_as_the_quintic() {
    let (a, b, c) = (NS_COEFFS.0 as f64, NS_COEFFS.1 as f64, NS_COEFFS.2 as f64);
    for (rows, cols) in [(6, 9), (9, 6)] {
        let p = rows.min(cols);
        let sigma: Vec<f64> = (0..p).map(|i| 0.05 + i as f64).collect();
        let (u, v) = (orthogonal(rows, 7), orthogonal(cols, 8));
        let with = |s: &[f64]| {
            let mut d = vec![0.0; rows * cols];
            (0..p).for_each(|i| d[i * cols + i] = s[i]);
            let ud = matmul(&u, &d, rows, rows, cols);
            matmul(&ud, &transpose(&v, cols, cols), rows, cols, cols)
        };
        let norm = sigma.iter().map(|s| s * s).sum::<f64>().sqrt();
        let phi: Vec<f64> = sigma
            .iter()
            .map(|&s| {
                let mut x = s / (norm + NS_EPS);
                for _ in 0..5 {
                    x = a * x + b * x.powi(3) + c * x.powi(5);
                }
                x
            })
            .collect();
        let got = on_cpu(&with(&sigma), rows, cols, 5);
        let err = max_abs_diff(&got, &with(&phi));
        assert!(err < 1e-5, "{rows}×{cols}: {err}");
        // The small singular values grew from 0.05/‖Σ‖ towards 1: orthogonalisation.
        assert!(phi[0] > 0.5 && phi[p - 1] < 1.3, "{phi:?}");
    }
}

#[test]
fn momentum_is_an_exponential_average_and_nesterov_looks_ahead() {
    let g = [2.0f32, -4.0];
    let (mut m, mut u) = ([1.0f32, 1.0], [0.0f32; 2]);
    let h = MuonMomentum {
        beta: 0.75,
        nesterov: false,
    };
    muon_momentum(&mut u, &mut m, &g, 0.5, h);
    // g' = (1, −2); m = 0.75·1 + 0.25·g'.
    assert_eq!(m, [1.0, 0.25]);
    assert_eq!(u, m);
    let nesterov = MuonMomentum {
        nesterov: true,
        ..h
    };
    muon_momentum(&mut u, &mut m, &g, 0.5, nesterov);
    // m = 0.75·(1, 0.25) + 0.25·(1, −2) = (1, −0.3125); u = 0.25·g' + 0.75·m.
    assert_eq!(m, [1.0, -0.3125]);
    assert_eq!(u, [1.0, 0.25 * -2.0 + 0.75 * -0.3125]);
}
