//! `exp` over slices, vectorised: softmax rows (attention, the cross-entropy) and SwiGLU's
//! sigmoid spend their time in `exp`, which the C library computes one element at a time.
//!
//! [`exp`] is Cody–Waite range reduction (`x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`) and a degree-7
//! Taylor polynomial of `eʳ` (truncation below 7e-9 relative), scaled by `2ⁿ` built in the
//! exponent bits: within 1 ulp over `[−87, 88]` (mean 0.27 ulp; the C library's is correctly
//! rounded, within 0.5; a test checks it against f64), branch-free, so loops over it vectorise. Below −87 it is 0 (the true value is
//! under 1.7e-38: a masked score, `−∞`, gives exactly 0), above 88 it is +∞ (the true value
//! is over 1.6e38), and NaN stays NaN.
//!
//! The slice kernels pick AVX2 at run time where the CPU has it (8 lanes instead of SSE2's
//! 4). Every element's operations are the same IEEE operations in the same order on either
//! path (no fused multiply-add), and sums use 8 accumulators in a fixed order, so the results
//! are bitwise the same on either path and do not depend on the thread count.

/// `eˣ` (see the module docs for its accuracy).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_145_75; // ln 2 in two parts: n·LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * std::f32::consts::LOG2_E + SHIFT;
    let n = t - SHIFT;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // eʳ = 1 + (r + r²·q(r)): the small part first, then one rounding of the sum.
    let q = 0.5
        + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))));
    let p = 1.0 + (r + (r * r) * q);
    // t's bits minus SHIFT's are n (both share an exponent); n + 127 in the exponent is 2ⁿ.
    let n_bits = t.to_bits().wrapping_sub(SHIFT.to_bits()) as i32;
    let e = p * f32::from_bits(((n_bits + 127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        e
    }
}

/// The logistic sigmoid `1 / (1 + e⁻ˣ)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[inline(always)]
fn max_body(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (m, &x) in acc.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    for a in acc {
        m = if a > m { a } else { m };
    }
    m
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn max_avx2(v: &[f32]) -> f32 {
    max_body(v)
}

/// The largest element of `v` (NaNs ignored; −∞ when empty), in 8 lanes.
pub fn max(v: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { max_avx2(v) };
    }
    max_body(v)
}

/// Sums `v` with 8 accumulators in a fixed order.
#[inline(always)]
fn sum8(v: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    let tail: f32 = chunks.remainder().iter().sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Sums `v` in f64 with 8 accumulators in a fixed order.
#[inline(always)]
fn sum8_f64(v: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += *x as f64;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&x| x as f64).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[inline(always)]
fn exp_shifted_sum_f64_body(v: &mut [f32], shift: f32) -> f64 {
    for x in v.iter_mut() {
        *x = exp(*x - shift);
    }
    sum8_f64(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_sum_f64_avx2(v: &mut [f32], shift: f32) -> f64 {
    exp_shifted_sum_f64_body(v, shift)
}

/// `v[i] = e^(v[i] − shift)` for every element; returns their sum, accumulated in f64 (a
/// vocabulary's worth of terms, for a log-sum-exp).
pub fn exp_shifted_sum_f64(v: &mut [f32], shift: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { exp_shifted_sum_f64_avx2(v, shift) };
    }
    exp_shifted_sum_f64_body(v, shift)
}

#[inline(always)]
fn exp_shifted_sum_body(v: &mut [f32], shift: f32) -> f32 {
    for x in v.iter_mut() {
        *x = exp(*x - shift);
    }
    sum8(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_sum_avx2(v: &mut [f32], shift: f32) -> f32 {
    exp_shifted_sum_body(v, shift)
}

#[inline(always)]
fn sum_exp_f64_body(v: &[f32], shift: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += exp(*x - shift) as f64;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&x| exp(x - shift) as f64)
        .sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_exp_f64_avx2(v: &[f32], shift: f32) -> f64 {
    sum_exp_f64_body(v, shift)
}

/// `Σ e^(v[i] − shift)`, accumulated in f64: the same value as [`exp_shifted_sum_f64`]
/// returns, without writing the exponentials.
pub fn sum_exp_f64(v: &[f32], shift: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { sum_exp_f64_avx2(v, shift) };
    }
    sum_exp_f64_body(v, shift)
}

#[inline(always)]
fn exp_shifted_body(v: &mut [f32], shift: f32) {
    for x in v.iter_mut() {
        *x = exp(*x - shift);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_avx2(v: &mut [f32], shift: f32) {
    exp_shifted_body(v, shift)
}

/// `v[i] = e^(v[i] − shift)` for every element.
pub fn exp_shifted(v: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { exp_shifted_avx2(v, shift) };
    }
    exp_shifted_body(v, shift)
}

/// `v[i] = e^(v[i] − shift)` for every element; returns their sum.
pub fn exp_shifted_sum(v: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { exp_shifted_sum_avx2(v, shift) };
    }
    exp_shifted_sum_body(v, shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_1_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let w = want as f32;
            let ulp = (f32::from_bits(w.to_bits() + 1) - w) as f64;
            worst = worst.max((exp(x) as f64 - want).abs() / ulp);
            x += 0.000_37;
        }
        assert!(worst < 1.0, "worst error {worst:.2} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn both_paths_give_the_same_bits() {
        let v: Vec<f32> = (0..1003)
            .map(|i| ((i * 37) % 211) as f32 * 0.1 - 10.0)
            .collect();
        let (mut a, mut b) = (v.clone(), v.clone());
        let sa = exp_shifted_sum(&mut a, 3.5);
        let sb = exp_shifted_sum_body(&mut b, 3.5);
        assert_eq!(sa.to_bits(), sb.to_bits());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        let want: f64 = v.iter().map(|x| ((x - 3.5) as f64).exp()).sum();
        assert!(((sa as f64 - want) / want).abs() < 1e-6);
        let mut c = v.clone();
        let s64 = exp_shifted_sum_f64(&mut c, 3.5);
        assert_eq!(s64.to_bits(), sum_exp_f64(&v, 3.5).to_bits());
        assert_eq!(s64.to_bits(), sum_exp_f64_body(&v, 3.5).to_bits());
        assert!(((s64 - want) / want).abs() < 3e-7);
        let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(
            (max(&v), max_body(&v), max(&v[..5])),
            (
                m,
                m,
                v[..5].iter().cloned().fold(f32::NEG_INFINITY, f32::max)
            )
        );
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(max(&[f32::NAN, 1.0, f32::NAN]), 1.0);
    }
}
