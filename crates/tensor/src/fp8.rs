//! FP8 linear layers emulated exactly on f32 (`train.fp8`): an operand is scaled, rounded to
//! the FP8 grid (round to nearest, ties to even, saturated at the format's largest finite
//! value), and divided by its scale again, so an f32 product of such operands sums the FP8
//! values' products in f32 — what an FP8 GEMM with f32 accumulation computes, up to where the
//! scales are applied.
//!
//! Formats (OCP 8-bit floating point): E4M3 (3 mantissa bits, largest 448, normals from
//! 2⁻⁶, subnormals to 2⁻⁹) for the forward operands, E5M2 (2 mantissa bits, largest 57344,
//! normals from 2⁻¹⁴, subnormals to 2⁻¹⁶) for gradients, as TransformerEngine's hybrid
//! recipe. Scales as torchao's dynamic scaling computes them, `scale = max / max(amax,
//! 1e-12)`, over the whole tensor (tensorwise) or over each row or column along which the
//! product does not sum (rowwise). Unlike torchao's own rowwise recipe, gradients stay E5M2
//! and scales are not rounded to powers of two.

use rayon::prelude::*;

use crate::PAR_CHUNK;

/// An FP8 format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits (forward operands).
    E4M3,
    /// 5 exponent bits, 2 mantissa bits (gradients).
    E5M2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// (mantissa bits, exponent of the smallest normal).
    fn grid(self) -> (i32, i32) {
        match self {
            Fp8Format::E4M3 => (3, -6),
            Fp8Format::E5M2 => (2, -14),
        }
    }

    /// `x` rounded to this format's grid (nearest, ties to even), saturated at
    /// ±[`Fp8Format::max`]; NaN stays NaN.
    pub fn round(self, x: f32) -> f32 {
        let a = x.abs();
        if a.is_nan() || a == 0.0 {
            return x;
        }
        if a >= self.max() {
            return self.max().copysign(x);
        }
        let (mantissa, min_exp) = self.grid();
        let exp = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        // Below the smallest normal the spacing stays that of the subnormals. The spacing is
        // a normal f32 power of two (2⁻¹⁶ at the least), built from its exponent bits.
        let step = f32::from_bits(((exp.max(min_exp) - mantissa + 127) as u32) << 23);
        // a / step < 2⁴ is exact; adding and removing 1.5·2²³ rounds it to the nearest
        // integer, ties to even (the default rounding), without a library call.
        const MAGIC: f32 = 12_582_912.0;
        let units = (a / step + MAGIC) - MAGIC;
        (units * step).min(self.max()).copysign(x)
    }
}

/// Along which groups of an operand `[rows, cols]` one scale is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Axis {
    /// One scale for the whole tensor (tensorwise).
    Tensor,
    /// One scale per row.
    Rows,
    /// One scale per column.
    Cols,
}

/// How to emulate one operand `[rows, cols]` (row-major) in FP8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Quant {
    /// The format.
    pub format: Fp8Format,
    /// The groups that share a scale.
    pub axis: Fp8Axis,
    /// Rows of the operand.
    pub rows: usize,
    /// Columns of the operand.
    pub cols: usize,
}

/// The scale of a group whose largest magnitude is `amax`.
pub fn fp8_scale(format: Fp8Format, amax: f32) -> f32 {
    format.max() / amax.max(1e-12)
}

/// `x` through FP8 at `scale`: `round(x·scale) / scale`.
pub fn fp8_emulate(format: Fp8Format, x: f32, scale: f32) -> f32 {
    format.round(x * scale) / scale
}

/// The largest magnitude in `xs` (0 for none).
fn amax(xs: &[f32]) -> f32 {
    xs.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// How many scales an operand under `q` has: 1, one per row, or one per column.
pub fn groups(q: Fp8Quant) -> usize {
    match q.axis {
        Fp8Axis::Tensor => 1,
        Fp8Axis::Rows => q.rows,
        Fp8Axis::Cols => q.cols,
    }
}

/// The largest magnitude of every group of `src` (`[rows, cols]`) under `q.axis` into `out`
/// ([`groups`] long).
pub fn group_amax(out: &mut [f32], src: &[f32], q: Fp8Quant) {
    let cols = q.cols.max(1);
    assert_eq!(src.len(), q.rows * q.cols, "fp8: operand length");
    assert_eq!(out.len(), groups(q), "fp8: one maximum per group");
    match q.axis {
        Fp8Axis::Tensor => out[0] = src.par_chunks(PAR_CHUNK).map(amax).reduce(|| 0.0, f32::max),
        Fp8Axis::Rows => out
            .par_iter_mut()
            .zip(src.par_chunks(cols))
            .with_min_len(crate::moe::rows_per_task(cols))
            .for_each(|(m, row)| *m = amax(row)),
        Fp8Axis::Cols => {
            // Row by row: contiguous reads.
            out.fill(0.0);
            for row in src.chunks(cols) {
                out.iter_mut()
                    .zip(row)
                    .for_each(|(m, x)| *m = m.max(x.abs()));
            }
        }
    }
}

/// Writes `src` (`[rows, cols]`) through FP8 into `dst`, every group at the scale of its
/// largest magnitude `amax[group]` ([`group_amax`], or its maximum over the ranks that hold
/// parts of the group).
pub fn apply_scales(dst: &mut [f32], src: &[f32], amax: &[f32], q: Fp8Quant) {
    let (cols, f) = (q.cols.max(1), q.format);
    assert_eq!(dst.len(), src.len(), "fp8: output length");
    assert_eq!(amax.len(), groups(q), "fp8: one maximum per group");
    let scales: Vec<f32> = amax.iter().map(|&a| fp8_scale(f, a)).collect();
    dst.par_chunks_mut(cols)
        .zip(src.par_chunks(cols))
        .enumerate()
        .with_min_len(crate::moe::rows_per_task(cols))
        .for_each(|(r, (d, x))| {
            for (c, (d, &x)) in d.iter_mut().zip(x).enumerate() {
                let s = match q.axis {
                    Fp8Axis::Tensor => scales[0],
                    Fp8Axis::Rows => scales[r],
                    Fp8Axis::Cols => scales[c],
                };
                *d = fp8_emulate(f, x, s);
            }
        });
}

/// Writes `src` (`[rows, cols]`) emulated in FP8 into `dst`, each group of `q.axis` with the
/// scale of its own largest magnitude.
pub fn fake_quant(dst: &mut [f32], src: &[f32], q: Fp8Quant) {
    let mut amax = vec![0.0f32; groups(q)];
    group_amax(&mut amax, src, q);
    apply_scales(dst, src, &amax, q);
}

#[cfg(test)]
mod tests;
