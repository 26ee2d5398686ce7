//! FP8 rounding against the grids decoded from every bit pattern (an implementation sharing
//! nothing with [`Fp8Format::round`]), and the scales of each axis.

use super::*;

/// Every finite non-negative value of `format` with its bit pattern's mantissa, decoded.
fn grid(format: Fp8Format) -> Vec<(f32, u32)> {
    let (mbits, bias, top) = match format {
        Fp8Format::E4M3 => (3u32, 7i32, 15u32),
        Fp8Format::E5M2 => (2u32, 15i32, 31u32),
    };
    let mut out = Vec::new();
    for e in 0..=top {
        for m in 0..(1u32 << mbits) {
            // E4M3 (fn) spends only S.1111.111 on NaN; E5M2 its whole top exponent on
            // infinities and NaNs.
            let special = match format {
                Fp8Format::E4M3 => e == top && m == (1 << mbits) - 1,
                Fp8Format::E5M2 => e == top,
            };
            if special {
                continue;
            }
            let frac = m as f32 / (1u32 << mbits) as f32;
            let v = if e == 0 {
                frac * 2f32.powi(1 - bias)
            } else {
                (1.0 + frac) * 2f32.powi(e as i32 - bias)
            };
            out.push((v, m));
        }
    }
    out
}

/// Nearest grid value by search, ties to the even mantissa, saturated.
fn nearest(grid: &[(f32, u32)], x: f32) -> f32 {
    let a = x.abs();
    let mut best = grid[0];
    for &(v, m) in grid {
        let (d, db) = ((v - a).abs(), (best.0 - a).abs());
        if d < db || (d == db && m % 2 == 0 && best.1 % 2 == 1) {
            best = (v, m);
        }
    }
    best.0.copysign(x)
}

#[test]
fn rounding_matches_the_decoded_grids() {
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let g = grid(format);
        let max = g.iter().map(|v| v.0).fold(0.0, f32::max);
        assert_eq!(max, format.max());
        let mut xs: Vec<f32> = Vec::new();
        // Every grid value, every midpoint between neighbours (the ties), and a sweep.
        let mut vals: Vec<f32> = g.iter().map(|v| v.0).collect();
        vals.sort_by(f32::total_cmp);
        for w in vals.windows(2) {
            xs.extend([w[0], (w[0] + w[1]) / 2.0, w[0] * 0.999 + w[1] * 0.001]);
        }
        let mut s = 0x2545_F491u32;
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let e = (s % 40) as f32 - 24.0;
            xs.push(((s >> 8) as f32 / (1u32 << 24) as f32 + 0.5) * e.exp2());
        }
        xs.extend([max * 1.01, max * 100.0, 1e-30]);
        for &x in &xs {
            for x in [x, -x] {
                assert_eq!(format.round(x), nearest(&g, x), "{format:?} {x:e}");
            }
        }
    }
}

#[test]
fn each_axis_scales_its_own_groups() {
    // Rows of different magnitudes: rowwise keeps each row's relative precision, tensorwise
    // flushes the small row towards zero.
    let src = [1000.0f32, -250.0, 1e-3, 2e-3];
    let q = |axis| {
        let mut d = [0.0f32; 4];
        let quant = Fp8Quant {
            format: Fp8Format::E4M3,
            axis,
            rows: 2,
            cols: 2,
        };
        fake_quant(&mut d, &src, quant);
        d
    };
    // Tensorwise: scale 448/1000; 1e-3·0.448 is below E4M3's smallest subnormal (2⁻⁹) → 0.
    let close = |a: f32, b: f32| (a / b - 1.0).abs() <= 1e-6;
    let t = q(Fp8Axis::Tensor);
    assert!(close(t[0], 1000.0), "{}", t[0]);
    assert_eq!(t[2], 0.0);
    // Rowwise: row 2's scale is 448/2e-3, so 2e-3 is exact and 1e-3 within E4M3's 2⁻⁴.
    let r = q(Fp8Axis::Rows);
    assert!(close(r[3], 2e-3), "{}", r[3]);
    assert!((r[2] / 1e-3 - 1.0).abs() <= 1.0 / 16.0, "{}", r[2]);
    // Columnwise: column 0 holds 1000 and 1e-3 (one scale), column 1 −250 and 2e-3.
    let c = q(Fp8Axis::Cols);
    assert!(close(c[0], 1000.0) && close(c[1], -250.0), "{c:?}");
    assert_eq!(c[2], t[2]);
    // Every output is a grid value over its scale: re-emulating moves nothing by more than
    // the rounding of the recomputed scale.
    let again = {
        let mut d = [0.0f32; 4];
        let quant = Fp8Quant {
            format: Fp8Format::E4M3,
            axis: Fp8Axis::Rows,
            rows: 2,
            cols: 2,
        };
        fake_quant(&mut d, &r, quant);
        d
    };
    for (a, b) in again.iter().zip(&r) {
        assert!(close(*a, *b), "{again:?} vs {r:?}");
    }
}
