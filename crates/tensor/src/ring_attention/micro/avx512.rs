//! The tiles' register-blocked product on AVX-512: 12 × 32 blocks of `C` held in 24 of the
//! 32 `zmm` registers over the whole depth, `A` broadcast from its rows or columns, `B` read
//! by rows; a last panel of 16 columns in one register per row, and one of 8 on the AVX2
//! kernel.

use std::arch::x86_64::*;

use super::fma::{self, Raw};

/// Column panels of 32, then one of 16, then one of 8, each over every block of 12 rows
/// (then the rest).
///
/// # Safety
/// The CPU has AVX-512F, AVX2 and FMA; `n` is a multiple of 8; every `m × n`, `m × k`,
/// `k × n` element addressed through `r` is valid, and `c` aliases neither input.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn product(m: usize, n: usize, r: &Raw) {
    let mut j = 0;
    while j + 32 <= n {
        panel::<2>(m, j, r);
        j += 32;
    }
    if j + 16 <= n {
        panel::<1>(m, j, r);
        j += 16;
    }
    if j < n {
        fma::panel8(m, j, r);
    }
}

/// The `16·NV` columns of `C` from `j` on, over all `m` rows: blocks of 12, then the rest.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn panel<const NV: usize>(m: usize, j: usize, r: &Raw) {
    let mut i = 0;
    while i + 12 <= m {
        block::<12, NV>(i, j, r);
        i += 12;
    }
    match m - i {
        11 => block::<11, NV>(i, j, r),
        10 => block::<10, NV>(i, j, r),
        9 => block::<9, NV>(i, j, r),
        8 => block::<8, NV>(i, j, r),
        7 => block::<7, NV>(i, j, r),
        6 => block::<6, NV>(i, j, r),
        5 => block::<5, NV>(i, j, r),
        4 => block::<4, NV>(i, j, r),
        3 => block::<3, NV>(i, j, r),
        2 => block::<2, NV>(i, j, r),
        1 => block::<1, NV>(i, j, r),
        _ => {}
    }
}

/// `C[i.., j..][MR × 16·NV] (+)= A[i.., ..] · B[.., j..]`, the block of `C` in registers
/// over the whole depth.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block<const MR: usize, const NV: usize>(i: usize, j: usize, r: &Raw) {
    let c = r.c.add(i * r.ldc + j);
    let mut t = [[_mm512_setzero_ps(); NV]; MR];
    if r.accumulate {
        for (x, row) in t.iter_mut().enumerate() {
            for (v, reg) in row.iter_mut().enumerate() {
                *reg = _mm512_loadu_ps(c.add(x * r.ldc + v * 16));
            }
        }
    }
    let (mut a, mut b) = (r.a.add(i * r.ars), r.b.add(j));
    for _ in 0..r.k {
        let mut bv = [_mm512_setzero_ps(); NV];
        for (v, reg) in bv.iter_mut().enumerate() {
            *reg = _mm512_loadu_ps(b.add(v * 16));
        }
        for (x, row) in t.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a.add(x * r.ars));
            for (reg, &bq) in row.iter_mut().zip(&bv) {
                *reg = _mm512_fmadd_ps(av, bq, *reg);
            }
        }
        // Wrapping: past the last step these point beyond the operands, never read.
        a = a.wrapping_add(r.acs);
        b = b.wrapping_add(r.ldb);
    }
    for (x, row) in t.iter().enumerate() {
        for (v, reg) in row.iter().enumerate() {
            _mm512_storeu_ps(c.add(x * r.ldc + v * 16), *reg);
        }
    }
}
