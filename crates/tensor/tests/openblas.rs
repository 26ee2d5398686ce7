//! The linear layers' products on OpenBLAS against an f64 reference, across the blocks the
//! engine cuts them into, with and without accumulation and thread splits. Needs a threaded
//! `libopenblas.so.0`: built with `--features openblas` (CI installs `libopenblas0-pthread`).

#![cfg(feature = "openblas")]

use ferrotron_tensor::blas::{OpenBlas, BLAS_BLOCK};
use ferrotron_tensor::linear::HostMatmul;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// `c[i][j] (+)= Σ_l a(i, l)·b(l, j)` in f64 with `Σ|a||b|` per element (the scale of its
/// rounding error).
fn reference(
    (m, n, k): (usize, usize, usize),
    a: impl Fn(usize, usize) -> f32,
    b: impl Fn(usize, usize) -> f32,
    c0: Option<&[f32]>,
) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut scale = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (c0.map_or(0.0, |c| c[i * n + j] as f64), 0.0);
            for l in 0..k {
                let p = a(i, l) as f64 * b(l, j) as f64;
                s += p;
                abs += p.abs();
            }
            c[i * n + j] = s;
            scale[i * n + j] = abs + c0.map_or(0.0, |c| c[i * n + j].abs() as f64);
        }
    }
    (c, scale)
}

/// Every element within the worst-case bound of an f32 sum of `k + 1` terms.
fn check(what: &str, got: &[f32], (want, scale): &(Vec<f64>, Vec<f64>), k: usize) {
    let gamma = (k + 1) as f64 * f32::EPSILON as f64;
    for (i, (g, (w, s))) in got.iter().zip(want.iter().zip(scale)).enumerate() {
        let err = (*g as f64 - w).abs();
        assert!(
            err <= gamma * s + 1e-30,
            "{what}: element {i}: {g} vs {w} (scale {s})"
        );
    }
}

fn products(mm: &HostMatmul, (t, d_in, d_out): (usize, usize, usize)) {
    let what = format!("t={t} in={d_in} out={d_out}");
    let (x, w) = (values(t * d_in, 1), values(d_out * d_in, 2));
    let mut y = vec![f32::NAN; t * d_out];
    mm.linear_forward(&mut y, &x, &w, t, d_in, d_out);
    let want = reference(
        (t, d_out, d_in),
        |i, l| x[i * d_in + l],
        |l, j| w[j * d_in + l],
        None,
    );
    check(&format!("forward {what}"), &y, &want, d_in);

    let dy = values(t * d_out, 3);
    for accumulate in [false, true] {
        let dx0 = values(t * d_in, 4);
        let mut dx = if accumulate {
            dx0.clone()
        } else {
            vec![f32::NAN; t * d_in]
        };
        mm.linear_backward_input(&mut dx, &dy, &w, t, d_in, d_out, accumulate);
        let c0 = accumulate.then_some(dx0.as_slice());
        let want = reference(
            (t, d_in, d_out),
            |i, l| dy[i * d_out + l],
            |l, j| w[l * d_in + j],
            c0,
        );
        check(
            &format!("backward input {what} accumulate={accumulate}"),
            &dx,
            &want,
            d_out,
        );
    }

    let dw0 = values(d_out * d_in, 5);
    let mut dw = dw0.clone();
    mm.linear_backward_weight(&mut dw, &dy, &x, t, d_in, d_out);
    let want = reference(
        (d_out, d_in, t),
        |i, l| dy[l * d_out + i],
        |l, j| x[l * d_in + j],
        Some(&dw0),
    );
    check(&format!("backward weight {what}"), &dw, &want, t);
}

#[test]
fn linear_products_match_an_f64_reference_on_openblas() {
    let mm = HostMatmul::OpenBlas(OpenBlas::load().unwrap_or_else(|e| panic!("{e}")));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| {
        // Small and odd; one split over threads; and every dimension past one block.
        for shape in [(1, 1, 1), (7, 5, 3), (37, 19, 53), (96, 64, 80)] {
            products(&mm, shape);
        }
        // Past one block in every dimension of every product, two at a time (an f64
        // reference of all three at once would take half a minute).
        let big = BLAS_BLOCK + 37;
        for shape in [(big, big + 5, 8), (8, big, big + 11), (big + 3, 9, big)] {
            products(&mm, shape);
        }
        // No depth (the products only scale the result), and no rows.
        for shape in [(big, 0, big + 1), (0, 5, big), (9, big, 0)] {
            products(&mm, shape);
        }
    });
    // Row parts of several blocks, one of them starting inside the rows: 2 threads over
    // 2,100 rows are parts 0..1056 and 1056..2100; one thread is one part of three blocks.
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| products(&mm, (2 * BLAS_BLOCK + 52, 9, 2 * BLAS_BLOCK + 52)));
    }
}

#[test]
fn a_loaded_openblas_describes_itself() {
    let b = OpenBlas::load().unwrap_or_else(|e| panic!("{e}"));
    assert!(b.describe().contains("OpenBLAS"), "{}", b.describe());
    let mm = HostMatmul::OpenBlas(b);
    assert!(mm.describe().contains("libopenblas"), "{}", mm.describe());
}
