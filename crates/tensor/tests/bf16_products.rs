//! The bf16 products (`train.matmul = "bf16"`) against an f64 reference of the same
//! bf16-rounded operands: within the error bound of an f32 sum, which also shows that the
//! operands were rounded (f32 products would miss the reference by ~2⁻⁹ of each product).
//! On a CPU without AVX-512 BF16 the products cannot run, and the tests say so.

use ferrotron_tensor::bf16_gemm::{available, matmul_bf16, round_bits};
use ferrotron_tensor::linear::{HostMatmul, Mat};
use half::bf16;

fn skip() -> bool {
    if !available() {
        eprintln!("this CPU lacks AVX-512 BF16: the bf16 products cannot run here");
    }
    !available()
}

/// Values with mantissa bits past bf16's, of either sign and a few binades.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i as u32).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) as f32
                / u32::MAX as f32;
            (x - 0.5) * (1.0 + (i % 7) as f32) + 1e-3 * ((i * 13 % 17) as f32)
        })
        .collect()
}

fn rounded(x: f32) -> f64 {
    f32::from(bf16::from_bits(round_bits(x))) as f64
}

#[test]
fn rounding_matches_half_to_nearest_even() {
    let mut specials = vec![
        0.0f32,
        -0.0,
        1.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        f32::INFINITY,
    ];
    specials.extend([
        f32::NEG_INFINITY,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
    ]);
    let sweep = (0..2_000_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_147)));
    for x in specials.into_iter().chain(sweep) {
        let want = bf16::from_f32(x);
        if x.is_nan() {
            assert!(bf16::from_bits(round_bits(x)).is_nan(), "{x:e}");
        } else {
            assert_eq!(round_bits(x), want.to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
    }
}

/// Checks `dst` of `matmul_bf16` for one layout of the operands.
fn check(m: usize, n: usize, k: usize, lhs_t: bool, rhs_t: bool, accumulate: bool) {
    let (a, b) = (values(m * k, 1), values(k * n, 2));
    let (ll, rl) = (
        if lhs_t {
            Mat::transposed(m)
        } else {
            Mat::rows(k)
        },
        if rhs_t {
            Mat::transposed(k)
        } else {
            Mat::rows(n)
        },
    );
    let at = |i: usize, p: usize| a[(i as isize * ll.rs + p as isize * ll.cs) as usize];
    let bt = |p: usize, j: usize| b[(p as isize * rl.rs + j as isize * rl.cs) as usize];
    let ldc = n + 3;
    let init = values(m * ldc, 3);
    let mut dst = init.clone();
    matmul_bf16((m, n, k), &mut dst, ldc, accumulate, &a, ll, &b, rl);
    let mut worst = 0.0f64;
    for i in 0..m {
        for j in 0..n {
            let (mut sum, mut mag) = (0.0f64, 0.0f64);
            for p in 0..k {
                let prod = rounded(at(i, p)) * rounded(bt(p, j));
                sum += prod;
                mag += prod.abs();
            }
            let c0 = if accumulate {
                init[i * ldc + j] as f64
            } else {
                0.0
            };
            let got = dst[i * ldc + j] as f64;
            let bound = (k + 4) as f64 * 2f64.powi(-24) * (mag + c0.abs()) + 1e-30;
            let err = (got - (sum + c0)).abs();
            assert!(
                err <= bound,
                "{m}×{n}×{k} (lhs transposed {lhs_t}, rhs transposed {rhs_t}): ({i}, {j}) = {got} vs {}",
                sum + c0
            );
            worst = worst.max(err / bound);
        }
        // Past the n columns of a row, dst is untouched.
        assert_eq!(
            dst[i * ldc + n..i * ldc + ldc],
            init[i * ldc + n..i * ldc + ldc]
        );
    }
    assert!(
        worst > 0.0 || k < 4,
        "{m}×{n}×{k}: every element exact is implausible"
    );
}

#[test]
fn products_match_an_f64_reference_of_the_rounded_operands() {
    if skip() {
        return;
    }
    // Edges of the register tile (8 × 48), the row blocks (64), the packed depth (256, odd
    // depths) and the packed columns (1536).
    let shapes = [
        (1, 1, 1),
        (7, 5, 3),
        (8, 48, 2),
        (13, 50, 257),
        (70, 97, 513),
        (130, 1600, 300),
    ];
    for &(m, n, k) in &shapes {
        for (lhs_t, rhs_t) in [(false, false), (false, true), (true, false), (true, true)] {
            for accumulate in [false, true] {
                check(m, n, k, lhs_t, rhs_t, accumulate);
            }
        }
    }
}

#[test]
fn linear_products_on_bf16_match_the_reference() {
    if skip() {
        return;
    }
    let (t, d_in, d_out) = (67, 130, 99);
    let (x, w, dy) = (
        values(t * d_in, 4),
        values(d_out * d_in, 5),
        values(t * d_out, 6),
    );
    let mm = HostMatmul::Bf16;
    let (mut y, mut dx, mut dw) = (
        vec![0.0; t * d_out],
        values(t * d_in, 7),
        values(d_out * d_in, 8),
    );
    let (dx0, dw0) = (dx.clone(), dw.clone());
    mm.linear_forward(&mut y, &x, &w, t, d_in, d_out);
    mm.linear_backward_input(&mut dx, &dy, &w, t, d_in, d_out, true);
    mm.linear_backward_weight(&mut dw, &dy, &x, t, d_in, d_out);
    let close = |got: f32, want: f64, mag: f64, k: usize, what: &str| {
        let bound = (k + 4) as f64 * 2f64.powi(-24) * mag;
        assert!(
            (got as f64 - want).abs() <= bound,
            "{what}: {got} vs {want}"
        );
    };
    for i in 0..t {
        for o in 0..d_out {
            let terms = (0..d_in).map(|c| rounded(x[i * d_in + c]) * rounded(w[o * d_in + c]));
            let (s, mag) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
            close(y[i * d_out + o], s, mag, d_in, "y = x·Wᵀ");
        }
        for c in 0..d_in {
            let terms = (0..d_out).map(|o| rounded(dy[i * d_out + o]) * rounded(w[o * d_in + c]));
            let (s, mag) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
            let c0 = dx0[i * d_in + c] as f64;
            close(
                dx[i * d_in + c],
                s + c0,
                mag + c0.abs(),
                d_out,
                "dx += dy·W",
            );
        }
    }
    for o in 0..d_out {
        for c in 0..d_in {
            let terms = (0..t).map(|i| rounded(dy[i * d_out + o]) * rounded(x[i * d_in + c]));
            let (s, mag) = terms.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
            let c0 = dw0[o * d_in + c] as f64;
            close(dw[o * d_in + c], s + c0, mag + c0.abs(), t, "dW += dyᵀ·x");
        }
    }
}

/// The precision seam's host side: the linear products read bf16 operands as stored and give,
/// bit for bit, the products of their widened f32 copies (rounding them back at the packing
/// is exact), for every pairing of f32 and bf16 operands, in every layout the products pack
/// (odd shapes: partial tiles and an odd depth). On `gemm`, a bf16 operand is widened first:
/// the same bits as widening it by hand.
#[test]
fn bf16_operands_give_the_products_of_their_widened_values() {
    use ferrotron_tensor::linear::HostOperand;
    use ferrotron_tensor::LinearShape;
    if skip() {
        return;
    }
    let (t, d_in, d_out) = (37, 29, 53);
    let sh = LinearShape::new(t, d_in, d_out);
    let half = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let wide = |v: &[bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
    let (x, w, dy) = (
        half(&values(t * d_in, 1)),
        half(&values(d_out * d_in, 2)),
        half(&values(t * d_out, 3)),
    );
    let (xw, ww, dyw) = (wide(&x), wide(&w), wide(&dy));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for mm in [HostMatmul::Bf16, HostMatmul::Gemm] {
        let pairs = [
            (HostOperand::F32(&xw), HostOperand::Bf16(&w)),
            (HostOperand::Bf16(&x), HostOperand::F32(&ww)),
            (HostOperand::Bf16(&x), HostOperand::Bf16(&w)),
        ];
        let mut want = vec![0.0f32; t * d_out];
        mm.linear_forward(&mut want, &xw, &ww, t, d_in, d_out);
        for (a, b) in pairs {
            let mut y = vec![0.0f32; t * d_out];
            mm.forward(&mut y, a, b, sh);
            assert_eq!(bits(&y), bits(&want), "forward");
        }
        let mut want = vec![0.5f32; t * d_in];
        mm.linear_backward_input(&mut want, &dyw, &ww, t, d_in, d_out, true);
        let mut dx = vec![0.5f32; t * d_in];
        let (dyb, wb) = (HostOperand::Bf16(&dy), HostOperand::Bf16(&w));
        mm.backward_input((&mut dx, true), dyb, wb, sh);
        assert_eq!(bits(&dx), bits(&want), "backward input");
        let mut want = vec![0.25f32; d_out * d_in];
        mm.linear_backward_weight(&mut want, &dyw, &xw, t, d_in, d_out);
        let mut dw = vec![0.25f32; d_out * d_in];
        mm.backward_weight(&mut dw, dyb, HostOperand::Bf16(&x), sh);
        assert_eq!(bits(&dw), bits(&want), "backward weight");
    }
}
