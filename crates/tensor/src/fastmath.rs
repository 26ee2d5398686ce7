//! `exp` over slices, vectorised: softmax rows (attention, the cross-entropy) and SwiGLU's
//! sigmoid spend their time in `exp`, which the C library computes one element at a time.
//!
//! Both exponentials are Cody–Waite range reduction (`x = n·ln 2 + r`, `|r| ≤ ln 2 / 2`) and a
//! polynomial of `eʳ`, scaled by `2ⁿ` built in the exponent bits; branch-free, so loops over
//! them vectorise.
//! - [`exp_f64`] (the cross-entropy's log-sum-exp and probabilities): a degree-10 Taylor
//!   polynomial (truncation below 3e-13 relative).
//! - [`exp`] (f32: attention's softmax, SwiGLU's sigmoid) is computed in f32, 8 lanes per AVX2
//!   register, with Cephes' degree-7 polynomial: **faithfully rounded** (at most 1 ulp from
//!   the exact value; about 9% of arguments 1 ulp off the correctly rounded f32, as the
//!   exponentials PyTorch vectorises, SLEEF's `u10`). Until December 2026 it was rounded
//!   from [`exp_f64`] (correctly rounded but for ~1e-13), 2.5× slower on AVX2. Below the f32
//!   range the result is 0 or a subnormal, above it +∞, and NaN stays NaN.
//!
//! The slice kernels pick AVX-512 or AVX2 at run time where the CPU has them (wider lanes
//! than SSE2's).
//! Every element's operations are the same IEEE operations in the same order on either path
//! (no fused multiply-add), and sums run in a fixed order (8 accumulators), so
//! the results are bitwise the same on either path and do not depend on the thread count.

/// `eˣ` in f64 for `x` in `[−708, 709]` (0 below, +∞ above, NaN stays NaN); relative error
/// about 1e-13.
#[inline(always)]
pub fn exp_f64(x: f64) -> f64 {
    const SHIFT: f64 = 6_755_399_441_055_744.0; // 1.5·2⁵²: adding it rounds to an integer
    const LN2_HI: f64 = 6.931_471_803_691_238e-1; // ln 2 in two parts (fdlibm's split)
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let xc = x.clamp(-708.0, 709.0);
    let t = xc * std::f64::consts::LOG2_E + SHIFT;
    let n = t - SHIFT;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // eʳ = 1 + (r + r²·q(r)): the small part first, then one rounding of the sum.
    let q = 0.5
        + r * (1.0 / 6.0
            + r * (1.0 / 24.0
                + r * (1.0 / 120.0
                    + r * (1.0 / 720.0
                        + r * (1.0 / 5040.0
                            + r * (1.0 / 40320.0
                                + r * (1.0 / 362_880.0 + r * (1.0 / 3_628_800.0))))))));
    let p = 1.0 + (r + (r * r) * q);
    // t's bits minus SHIFT's are n (both share an exponent); n + 1023 in the exponent is 2ⁿ.
    let n_bits = t.to_bits().wrapping_sub(SHIFT.to_bits()) as i64;
    let e = p * f64::from_bits(((n_bits + 1023) << 52) as u64);
    if x < -708.0 {
        0.0
    } else if x > 709.0 {
        f64::INFINITY
    } else {
        e
    }
}

/// `eˣ` in f32, faithfully rounded (at most 1 ulp from the exact value): 0 below the
/// subnormals, +∞ above `f32::MAX`, NaN stays NaN. Branch-free: loops over it vectorise.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer
    const LN2_HI: f32 = 355.0 / 512.0; // ln 2 in two parts (Cephes' split): n·LN2_HI is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Past both ends the result is already 0 (e⁻¹⁰⁴ is below half the least subnormal) or
    // +∞; clamping keeps n's exponent bits in range. `clamp` keeps NaN.
    let xc = x.clamp(-104.0, 89.0);
    let t = xc * std::f32::consts::LOG2_E + SHIFT;
    let n = t - SHIFT;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // eʳ = 1 + (r + r²·q(r)), q Cephes' `expf` coefficients (relative error ≤ 1e-7).
    let q = 0.5
        + r * (1.666_666_5e-1
            + r * (4.166_579_6e-2 + r * (8.333_452e-3 + r * (1.398_2e-3 + r * 1.987_569_1e-4))));
    let p = 1.0 + (r + (r * r) * q);
    // 2ⁿ as two normal factors 2^⌊n/2⌋·2^⌈n/2⌉ (n ∈ [−150, 129]), so subnormal results
    // round once from a normal product and n = 128, 129 overflow to +∞.
    let n_bits = t.to_bits().wrapping_sub(SHIFT.to_bits()) as i32;
    let (n1, n2) = (n_bits >> 1, n_bits - (n_bits >> 1));
    let scale = |k: i32| f32::from_bits(((k + 127) << 23) as u32);
    p * scale(n1) * scale(n2)
}

/// The logistic sigmoid `1 / (1 + e⁻ˣ)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// The widest vector instructions this CPU has among those the slice kernels are compiled
/// for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    /// AVX-512 (`avx512f`): 16 f32 or 8 f64 per register.
    Avx512,
    /// AVX2: 8 f32 or 4 f64.
    Avx2,
    /// As built (SSE2 on x86-64): 4 f32 or 2 f64.
    Base,
}

/// [`Lanes`] of this CPU, detected at run time (the standard library caches the answer).
pub fn lanes() -> Lanes {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Lanes::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Lanes::Avx2;
        }
    }
    Lanes::Base
}

/// Defines `fn $name` (with the visibility given) running `$body` compiled for AVX-512 or
/// AVX2 where the CPU has them ([`lanes`]), else as built (SSE2): the same code, so the same
/// results (Rust never fuses a multiply and an add by itself, so no path rounds differently).
macro_rules! dispatched {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),*) -> $r:ty = $body:ident;) => {
        $(#[$doc])*
        $vis fn $name($($a: $t),*) -> $r {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn widest($($a: $t),*) -> $r {
                    $body($($a),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn wide($($a: $t),*) -> $r {
                    $body($($a),*)
                }
                match $crate::fastmath::lanes() {
                    // SAFETY: the CPU has AVX-512 (avx512f).
                    $crate::fastmath::Lanes::Avx512 => return unsafe { widest($($a),*) },
                    // SAFETY: the CPU has AVX2.
                    $crate::fastmath::Lanes::Avx2 => return unsafe { wide($($a),*) },
                    $crate::fastmath::Lanes::Base => {}
                }
            }
            $body($($a),*)
        }
    };
}
pub(crate) use dispatched;

/// Folds `v` into 8 lanes with `f` (lane `i` takes elements `i`, `i + 8`, …), then the tail
/// and the lanes in a fixed order.
#[inline(always)]
fn fold8<A: Copy>(v: &[f32], zero: A, f: impl Fn(A, f32) -> A, join: impl Fn(A, A) -> A) -> A {
    let mut acc = [zero; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = f(*a, x);
        }
    }
    let tail = chunks.remainder().iter().fold(zero, |a, &x| f(a, x));
    join8(acc, tail, join)
}

/// The 8 lanes of a fold and its tail in the fixed order every 8-lane sum here uses:
/// `((l0·l4 · l1·l5) · (l2·l6 · l3·l7)) · tail` with `·` = `join`.
#[inline(always)]
pub(crate) fn join8<A: Copy>(acc: [A; 8], tail: A, join: impl Fn(A, A) -> A) -> A {
    let pairs = [
        join(acc[0], acc[4]),
        join(acc[1], acc[5]),
        join(acc[2], acc[6]),
        join(acc[3], acc[7]),
    ];
    join(
        join(join(pairs[0], pairs[1]), join(pairs[2], pairs[3])),
        tail,
    )
}

#[inline(always)]
fn bigger(m: f32, x: f32) -> f32 {
    if x > m {
        x
    } else {
        m
    }
}

#[inline(always)]
fn max_body(v: &[f32]) -> f32 {
    fold8(v, f32::NEG_INFINITY, bigger, bigger)
}

#[inline(always)]
fn exp_scaled_body(v: &mut [f32], scale: f32, shift: f32) {
    for x in v.iter_mut() {
        *x = exp(*x * scale - shift);
    }
}

#[inline(always)]
fn exp_scaled_sum_body(v: &mut [f32], scale: f32, shift: f32) -> f32 {
    exp_scaled_body(v, scale, shift);
    // In 8 lanes, a fixed order, rather than one chain of dependent adds per row.
    fold8(v, 0.0, |a, x| a + x, |a, b| a + b)
}

#[inline(always)]
fn softmax_grad_body(p: &mut [f32], dp: &[f32], delta: f32, scale: f32) {
    for (p, &g) in p.iter_mut().zip(dp) {
        *p = scale * *p * (g - delta);
    }
}

#[inline(always)]
fn sum_exp_f64_body(v: &[f32], shift: f32) -> f64 {
    // `fold8(v, 0, |a, x| a + e^(x − shift), +)`, the same additions in the same order, but
    // with the exponentials of 64 elements at a time computed first in a loop of their own:
    // folded one at a time, the exponential stayed scalar (6.5× slower than vectorised).
    const BLOCK: usize = 64;
    let term = |x: f32| exp_f64((x - shift) as f64);
    let whole = v.len() / 8 * 8;
    let (mut acc, mut e) = ([0.0f64; 8], [0.0f64; BLOCK]);
    for block in v[..whole].chunks(BLOCK) {
        let e = &mut e[..block.len()];
        for (e, &x) in e.iter_mut().zip(block) {
            *e = term(x);
        }
        for c in e.chunks_exact(8) {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a += x;
            }
        }
    }
    let tail = v[whole..].iter().fold(0.0, |a, &x| a + term(x));
    join8(acc, tail, |a, b| a + b)
}

#[inline(always)]
fn exp_minus_f64_body(v: &mut [f32], c: f64, scale: f32) {
    for x in v.iter_mut() {
        *x = (exp_f64(*x as f64 - c) as f32) * scale;
    }
}

dispatched! {
    /// The largest element of `v` (NaNs ignored; −∞ when empty), in 8 lanes.
    pub fn max(v: &[f32]) -> f32 = max_body;
}

dispatched! {
    /// `v[i] = e^(v[i]·scale − shift)` for every element (the product and the difference in
    /// f32, rounded each): attention's probabilities from raw scores.
    pub fn exp_scaled(v: &mut [f32], scale: f32, shift: f32) -> () = exp_scaled_body;
}

dispatched! {
    /// `v[i] = e^(v[i]·scale − shift)` for every element, as [`exp_scaled`]; returns their
    /// sum, added in 8 lanes.
    pub fn exp_scaled_sum(v: &mut [f32], scale: f32, shift: f32) -> f32 = exp_scaled_sum_body;
}

dispatched! {
    /// `p[i] = scale · p[i] · (dp[i] − delta)` over the common length (f32, left to right):
    /// the softmax backward of one attention row, `dS = scale · P ⊙ (dP − Δ)`.
    pub fn softmax_grad(p: &mut [f32], dp: &[f32], delta: f32, scale: f32) -> () = softmax_grad_body;
}

dispatched! {
    /// `Σ e^(v[i] − shift)` (the difference in f32, the exponentials and the sum in f64): a
    /// vocabulary's worth of terms, for a log-sum-exp.
    pub fn sum_exp_f64(v: &[f32], shift: f32) -> f64 = sum_exp_f64_body;
}

dispatched! {
    /// `v[i] = scale · e^(v[i] − c)`, the difference and the exponential in f64, rounded
    /// once to f32 before the (f32) product: scaled softmax probabilities from an f64
    /// log-sum-exp, in one pass.
    pub fn exp_minus_f64(v: &mut [f32], c: f64, scale: f32) -> () = exp_minus_f64_body;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_faithfully_rounded_over_the_whole_f32_range() {
        // Against f64's exp (exact but for f64's own 1e-16): our f32 is the correctly rounded
        // value or its neighbour on the exact value's other side, never further.
        let (mut off, mut n) = (0, 0);
        let mut x = -110.0f32;
        while x <= 90.0 {
            let exact = (x as f64).exp();
            let (got, nearest) = (exp(x), exact as f32);
            if got.to_bits() != nearest.to_bits() {
                off += 1;
                let (g, w) = (got as f64 - exact, nearest as f64 - exact);
                let gap = got.to_bits().abs_diff(nearest.to_bits());
                assert!(
                    gap == 1 && g * w < 0.0,
                    "exp({x}) = {got:e}, exact {exact:e}"
                );
            }
            n += 1;
            x += 0.000_17;
        }
        eprintln!("exp: {off} of {n} arguments 1 ulp off the correctly rounded f32");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-103.0), f32::from_bits(1), "the least subnormal");
        assert_eq!(exp(-104.5), 0.0);
        let mut worst = 0.0f64;
        let mut y = -700.0f64;
        while y <= 700.0 {
            worst = worst.max(((exp_f64(y) - y.exp()) / y.exp()).abs());
            y += 0.013;
        }
        assert!(worst < 1e-12, "exp_f64: worst relative error {worst:.1e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan() && exp_f64(f64::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
    }

    /// Bodies compiled for AVX2, as `dispatched!` does, to test that path on a CPU whose
    /// widest is AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn sums_on_avx2(v: &mut [f32], w: &[f32], shift: f32) -> (f32, f64) {
        (
            exp_scaled_sum_body(v, 0.75, shift),
            sum_exp_f64_body(w, shift),
        )
    }

    #[test]
    fn avx2_gives_the_baselines_bits() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            let v: Vec<f32> = (0..1003)
                .map(|i| ((i * 37) % 211) as f32 * 0.1 - 10.0)
                .collect();
            let (mut a, mut b) = (v.clone(), v.clone());
            // SAFETY: the CPU has AVX2.
            let (sa, s64) = unsafe { sums_on_avx2(&mut a, &v, 3.5) };
            assert_eq!(
                sa.to_bits(),
                exp_scaled_sum_body(&mut b, 0.75, 3.5).to_bits()
            );
            assert_eq!(s64.to_bits(), sum_exp_f64_body(&v, 3.5).to_bits());
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }

    #[test]
    fn blocked_sum_of_exponentials_adds_as_the_eight_lane_fold() {
        for len in [0, 5, 8, 63, 64, 65, 130, 1003, 8192] {
            let v: Vec<f32> = (0..len)
                .map(|i| ((i * 37) % 211) as f32 * 0.1 - 10.0)
                .collect();
            let folded = fold8(
                &v,
                0.0f64,
                |a, x| a + exp_f64((x - 3.5) as f64),
                |a, b| a + b,
            );
            assert_eq!(
                sum_exp_f64(&v, 3.5).to_bits(),
                folded.to_bits(),
                "len {len}"
            );
        }
    }

    #[test]
    fn widest_path_gives_the_baselines_bits() {
        let v: Vec<f32> = (0..1003)
            .map(|i| ((i * 37) % 211) as f32 * 0.1 - 10.0)
            .collect();
        let (mut a, mut b) = (v.clone(), v.clone());
        let sa = exp_scaled_sum(&mut a, 1.0, 3.5);
        let sb = exp_scaled_sum_body(&mut b, 1.0, 3.5);
        assert_eq!(sa.to_bits(), sb.to_bits());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        let want: f64 = v.iter().map(|x| ((x - 3.5) as f64).exp()).sum();
        assert!(((sa as f64 - want) / want).abs() < 1e-6);
        // Scaled: each element is the exponential of the rounded f32 product minus the shift.
        let (mut e, mut f) = (v.clone(), v.clone());
        exp_scaled(&mut e, 0.176_776_7, 0.5);
        exp_scaled_body(&mut f, 0.176_776_7, 0.5);
        for ((x, &e), &f) in v.iter().zip(&e).zip(&f) {
            assert_eq!(
                (e.to_bits(), f.to_bits()),
                (f.to_bits(), exp(x * 0.176_776_7 - 0.5).to_bits())
            );
        }
        // The softmax gradient: scale · p · (dp − delta) in that order, on either path.
        let dp: Vec<f32> = v.iter().map(|x| x * 0.3 + 1.0).collect();
        let (mut g, mut h) = (e.clone(), e.clone());
        softmax_grad(&mut g, &dp, 0.7, 0.125);
        softmax_grad_body(&mut h, &dp, 0.7, 0.125);
        for ((p, d), (g, h)) in e.iter().zip(&dp).zip(g.iter().zip(&h)) {
            assert_eq!(
                (g.to_bits(), h.to_bits()),
                ((0.125 * p * (d - 0.7)).to_bits(), g.to_bits())
            );
        }
        let s64 = sum_exp_f64(&v, 3.5);
        assert_eq!(s64.to_bits(), sum_exp_f64_body(&v, 3.5).to_bits());
        assert!(((s64 - want) / want).abs() < 1e-12);
        let (mut c, mut d) = (v.clone(), v.clone());
        exp_minus_f64(&mut c, 4.25, 0.37);
        exp_minus_f64_body(&mut d, 4.25, 0.37);
        assert!(c.iter().zip(&d).all(|(x, y)| x.to_bits() == y.to_bits()));
        // The scale is the f32 product after rounding (the separate pass it replaced).
        for (x, &c) in v.iter().zip(&c) {
            let want = (((*x as f64) - 4.25).exp() as f32) * 0.37;
            assert!((c - want).abs() <= 1e-6 * want, "{x}: {c} vs {want}");
        }
        let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!((max(&v), max_body(&v)), (m, m));
        assert_eq!(
            max(&v[..5]),
            v[..5].iter().cloned().fold(f32::NEG_INFINITY, f32::max)
        );
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        assert_eq!(max(&[f32::NAN, 1.0, f32::NAN]), 1.0);
    }
}
