//! The forward product of a linear layer through a transposed copy of its weight
//! (`ferrotron_config::forward_transposes_weight`), against an f64 reference and against
//! the same product reading the weight as stored: shapes on both sides of the rule, odd
//! sizes past the copy's tiles and stripes.

use ferrotron_config::forward_transposes_weight;
use ferrotron_tensor::linear::{linear_forward, matmul, transpose, transposed, Mat, Threads};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            ((i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[test]
fn forward_through_the_transposed_weight_matches_the_reference() {
    // (t, in, out, whether the copy is taken)
    let shapes = [
        (1024, 512, 256, true),
        (600, 129, 77, true),
        (512, 33, 1024, true),
        (511, 64, 64, false),
        (600, 64, 1025, false),
    ];
    for (t, d_in, d_out, copies) in shapes {
        assert_eq!(
            forward_transposes_weight(t, d_in, d_out),
            copies,
            "{t} {d_in} {d_out}"
        );
        let (x, w) = (values(t * d_in, 1), values(d_out * d_in, 2));
        let mut y = vec![f32::NAN; t * d_out];
        linear_forward(&mut y, &x, &w, t, d_in, d_out);
        let mut stored = vec![f32::NAN; t * d_out];
        let (rows, strided) = (Mat::rows(d_in), Mat::transposed(d_in));
        matmul(
            t,
            d_out,
            d_in,
            &mut stored,
            Mat::rows(d_out),
            false,
            &x,
            rows,
            &w,
            strided,
            Threads::Pool,
        );
        for i in 0..t {
            for j in 0..d_out {
                let (mut sum, mut abs) = (0.0f64, 0.0f64);
                for l in 0..d_in {
                    let p = x[i * d_in + l] as f64 * w[j * d_in + l] as f64;
                    sum += p;
                    abs += p.abs();
                }
                // An f32 sum of d_in products: within (k + 4)·2⁻²⁴·Σ|a·b| of the exact one.
                let bound = (d_in + 4) as f64 * 2f64.powi(-24) * abs;
                let got = y[i * d_out + j] as f64;
                assert!(
                    (got - sum).abs() <= bound,
                    "t={t} in={d_in} out={d_out} [{i},{j}]: {got} vs {sum} (bound {bound:e})"
                );
                let other = stored[i * d_out + j] as f64;
                assert!(
                    (got - other).abs() <= 2.0 * bound,
                    "[{i},{j}]: {got} vs as stored {other}"
                );
            }
        }
    }
}

#[test]
fn transpose_moves_every_element_once() {
    for (rows, cols) in [(1, 1), (1, 70), (70, 1), (33, 47), (64, 32), (129, 257)] {
        let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut dst = vec![f32::NAN; rows * cols];
        transpose(&mut dst, &src, rows, cols);
        let fresh = transposed(&src, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(
                    dst[c * rows + r],
                    src[r * cols + c],
                    "{rows}×{cols} [{r},{c}]"
                );
            }
        }
        assert_eq!(dst, fresh);
    }
}
