//! Layout-independent initialisation: every full parameter is drawn from its own stream,
//! seeded by (run seed, parameter name). A parallel layout draws the full tensor the same way
//! and slices it, so every layout starts from identical weights.

use crate::ParamLayout;

/// FNV-1a of the name mixed with the seed: a stable per-parameter seed.
pub fn param_seed(seed: u64, name: &str) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in name.bytes() {
        hash ^= b as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01B3);
    }
    hash
}

struct Stream(u64);

impl Stream {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// Fills `out` (one whole parameter) with N(0, std²) drawn by Box–Muller from `seed`.
pub fn fill_normal(out: &mut [f32], seed: u64, std: f64) {
    let mut s = Stream(seed);
    for pair in out.chunks_mut(2) {
        let (u1, u2) = (s.unit(), s.unit());
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let th = std::f64::consts::TAU * u2;
        pair[0] = (r * th.cos()) as f32;
        if pair.len() > 1 {
            pair[1] = (r * th.sin()) as f32;
        }
    }
}

/// Initialises the flat buffer `out` (this rank's `layout.total` elements): each full
/// parameter is drawn from its own stream, then this rank's slice is kept, so every
/// tensor-parallel layout starts from the same full weights.
pub fn init_params(layout: &ParamLayout, seed: u64, out: &mut [f32]) {
    for spec in &layout.params {
        let dst = &mut out[spec.range()];
        match spec.init_std {
            Some(std) => {
                let mut full = vec![0.0f32; spec.full_shape.iter().product()];
                fill_normal(&mut full, param_seed(seed, &spec.name), std);
                layout.slice_into(spec, &full, dst);
            }
            None => dst.fill(1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_draw_has_the_requested_moments() {
        let mut x = vec![0.0f32; 100_000];
        fill_normal(&mut x, 3, 0.02);
        let mean = x.iter().map(|v| *v as f64).sum::<f64>() / x.len() as f64;
        let var = x.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / x.len() as f64;
        assert!(mean.abs() < 3e-4, "{mean}");
        assert!((var.sqrt() - 0.02).abs() < 3e-4, "{}", var.sqrt());
    }

    #[test]
    fn seed_depends_on_name_only_through_the_name() {
        assert_eq!(param_seed(1, "a"), param_seed(1, "a"));
        assert_ne!(param_seed(1, "a"), param_seed(1, "b"));
        assert_ne!(param_seed(1, "a"), param_seed(2, "a"));
    }
}
