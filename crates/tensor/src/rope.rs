//! Rotary position embedding in the Hugging Face "rotate_half" convention: dimension `i` of a
//! head is paired with `i + d/2`, both rotated by `pos · θ^(−2i/d)`. HF Llama weights load
//! unchanged because their q/k projections are laid out for this pairing.

use ferrotron_config::RopeScaling;
use rayon::prelude::*;

/// Rows per rayon task at least (a row of one token's heads is a few hundred floats).
const ROWS: usize = 16;

/// Cosines and sines of every (position, frequency), `[positions, d/2]` each.
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Table for positions `0..positions` and head dimension `head_dim` (even).
    pub fn new(positions: usize, head_dim: usize, theta: f64) -> Self {
        RopeTable::scaled(positions, head_dim, theta, RopeScaling::None)
    }

    /// Table with each inverse frequency scaled as `scaling` says (Llama 3.1's long-context
    /// scaling, or linear).
    pub fn scaled(positions: usize, head_dim: usize, theta: f64, scaling: RopeScaling) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                // HF computes inv_freq in fp32 then the angle in fp32; f64 here is closer to
                // the exact value and within fp32 rounding of theirs.
                let inv_freq = scaling.apply(1.0 / theta.powf((2 * i) as f64 / head_dim as f64));
                let angle = p as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Head dimension the table was built for.
    pub fn head_dim(&self) -> usize {
        2 * self.half
    }

    /// The cosines, `[positions, d/2]`: for a backend that keeps the table in device memory.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// The sines, `[positions, d/2]`.
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

/// Rotates `x` in place: `x` is `[t, heads, d]` where row `r` sits at position
/// `positions[r]`. With `inverse` the transposed rotation is applied, which is the backward.
pub fn rope_apply(
    x: &mut [f32],
    positions: &[usize],
    heads: usize,
    table: &RopeTable,
    inverse: bool,
) {
    let half = table.half;
    let d = 2 * half;
    let sign = if inverse { -1.0 } else { 1.0 };
    x.par_chunks_mut(heads * d)
        .zip(positions.par_iter())
        .with_min_len(ROWS)
        .for_each(|(row, &pos)| {
            let cos = &table.cos[pos * half..(pos + 1) * half];
            let sin = &table.sin[pos * half..(pos + 1) * half];
            for head in row.chunks_exact_mut(d) {
                let (a, b) = head.split_at_mut(half);
                for (((a, b), &c), &s) in a.iter_mut().zip(b).zip(cos).zip(sin) {
                    let (x1, x2) = (*a, *b);
                    let s = sign * s;
                    *a = x1 * c - x2 * s;
                    *b = x2 * c + x1 * s;
                }
            }
        });
}
