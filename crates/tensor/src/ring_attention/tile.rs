//! The matrix products of one attention tile — at most 64 × 64 outputs, an inner dimension of
//! a head or a tile — on the calling thread, with a register-blocked kernel.
//!
//! The right operand is read in place where its rows are whole vectors a short stride apart
//! (a [`Transposed`] tile, a block of `V`), and otherwise copied into zero-padded rows of whole
//! vectors; then the output is computed `R` rows × `V` vectors at a time in registers: per
//! inner index, `V` vector loads and `R` broadcasts of the left operand
//! (read through its strides, so a transposed left operand costs nothing) feed `R·V`
//! multiply-adds. Every output element sums its inner index in order, so the result does not
//! depend on the thread count or the layout; with `accumulate`, the finished sum is added to
//! the destination.
//!
//! The kernel is compiled for AVX-512 (16 lanes), AVX2 with FMA (8 lanes) and, elsewhere, a
//! portable 4-lane version without fused multiply-adds; each call takes the widest the CPU has.

use crate::linear::Mat;

/// A strided operand of [`product`].
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    /// The elements; every index reached through `at` must lie inside.
    pub data: &'a [f32],
    /// Row and column strides.
    pub at: Mat,
}

impl<'a> Src<'a> {
    /// Row-major with leading dimension `ld`.
    pub fn rows(data: &'a [f32], ld: usize) -> Self {
        Src {
            data,
            at: Mat::rows(ld),
        }
    }
    /// The transpose of a row-major matrix with leading dimension `ld`.
    pub fn transposed(data: &'a [f32], ld: usize) -> Self {
        Src {
            data,
            at: Mat::transposed(ld),
        }
    }
}

/// The row-major destination of [`product`].
pub(crate) struct Dst<'a> {
    /// The elements; row `i` starts at `i · ld`.
    pub data: &'a mut [f32],
    /// Leading dimension.
    pub ld: usize,
    /// Rows written.
    pub rows: usize,
    /// Columns written.
    pub cols: usize,
    /// Add the product to what is there instead of overwriting it.
    pub accumulate: bool,
}

impl<'a> Dst<'a> {
    /// Rows × cols of `data` with leading dimension `ld`.
    pub fn new(data: &'a mut [f32], ld: usize, rows: usize, cols: usize, accumulate: bool) -> Self {
        Dst {
            data,
            ld,
            rows,
            cols,
            accumulate,
        }
    }
}

/// A task's workspace: the right operand packed into zero-padded rows of whole vectors.
#[derive(Default)]
pub(crate) struct Pack(Vec<f32>);

/// The transpose of one key or value tile, scaled: `[d × width]` with element
/// `(c, j) = scale · src[j·ld + c]` for the tile's `rows ≤ width` rows, zero past them (the
/// scores' `1/√d` folded into `Kᵀ` costs no pass of its own). A right operand through
/// [`Transposed::get`], read in place when `rows` is a whole number of vectors; at most
/// `d × width` floats whatever the sequence.
#[derive(Default)]
pub(crate) struct Transposed {
    data: Vec<f32>,
    width: usize,
}

impl Transposed {
    /// Packs `rows` rows of `d` elements from `src` (row `j` at `j · ld`).
    pub fn pack(
        &mut self,
        src: &[f32],
        ld: usize,
        rows: usize,
        d: usize,
        width: usize,
        scale: f32,
    ) {
        assert!(rows <= width, "{rows} rows in a tile of {width}");
        self.width = width;
        self.data.clear();
        self.data.resize(d * width, 0.0);
        for j in 0..rows {
            for (c, &x) in src[j * ld..j * ld + d].iter().enumerate() {
                self.data[c * width + j] = scale * x;
            }
        }
    }

    /// The packed tile as a right operand of `d` rows.
    pub fn get(&self) -> Src<'_> {
        Src::rows(&self.data, self.width)
    }
}

/// Largest index reached by `rows × cols` through `at` (0 for an empty matrix); `None` if
/// it overflows or a stride is negative.
fn last(rows: usize, cols: usize, at: Mat) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    let (rs, cs) = (usize::try_from(at.rs).ok()?, usize::try_from(at.cs).ok()?);
    (rows - 1)
        .checked_mul(rs)?
        .checked_add((cols - 1).checked_mul(cs)?)
}

/// `dst (+)= lhs[rows × k] · rhs[k × cols]`.
///
/// # Panics
/// If the destination or (for `k > 0`) an operand reaches outside its slice through its
/// strides, or a stride is negative or overflows.
pub(crate) fn product(dst: Dst<'_>, lhs: Src<'_>, rhs: Src<'_>, k: usize, pack: &mut Pack) {
    let (m, n) = (dst.rows, dst.cols);
    if m == 0 || n == 0 {
        return;
    }
    let inside = |last: Option<usize>, len: usize| last.is_some_and(|i| i < len);
    if k > 0 {
        assert!(inside(last(m, k, lhs.at), lhs.data.len()), "lhs");
        assert!(inside(last(k, n, rhs.at), rhs.data.len()), "rhs");
    }
    let dst_end = (m - 1).checked_mul(dst.ld).and_then(|x| x.checked_add(n));
    assert!(
        dst.ld >= n && dst_end.is_some_and(|e| e <= dst.data.len()),
        "dst"
    );
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA; bounds were checked above.
            return unsafe { on_avx512(dst, lhs, rhs, k, pack) };
        }
        if has!("avx2") && has!("fma") {
            // SAFETY: the CPU has AVX2 and FMA; bounds were checked above.
            return unsafe { on_avx2(dst, lhs, rhs, k, pack) };
        }
    }
    // SAFETY: bounds were checked above.
    unsafe { run::<Portable>(dst, lhs, rhs, k, pack) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn on_avx512(dst: Dst<'_>, lhs: Src<'_>, rhs: Src<'_>, k: usize, pack: &mut Pack) {
    run::<x86::Avx512>(dst, lhs, rhs, k, pack)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn on_avx2(dst: Dst<'_>, lhs: Src<'_>, rhs: Src<'_>, k: usize, pack: &mut Pack) {
    run::<x86::Avx2>(dst, lhs, rhs, k, pack)
}

/// One vector register type and the few operations the kernel needs.
trait Lane {
    /// The register.
    type V: Copy;
    /// f32 lanes per register.
    const W: usize;
    /// Most vectors per panel (the widest register block).
    const PANEL: usize;
    /// Computes every row of the panel `v0..v0 + vn` vectors with the
    /// register block of this instruction set.
    unsafe fn panel(t: &Task, vn: usize, v0: usize);
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn splat(x: f32) -> Self::V;
    /// `a · b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
}

/// One product, as raw pointers after the bounds checks.
struct Task {
    dst: *mut f32,
    ld: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
    lhs: *const f32,
    lhs_at: (usize, usize),
    /// The right operand as rows of whole vectors (packed, or in place).
    packed: *const f32,
    /// Distance between those rows.
    npad: usize,
    k: usize,
}

#[inline(always)]
unsafe fn run<L: Lane>(dst: Dst<'_>, lhs: Src<'_>, rhs: Src<'_>, k: usize, pack: &mut Pack) {
    let n = dst.cols;
    let nv = n.div_ceil(L::W);
    let (rs, cs) = (rhs.at.rs as usize, rhs.at.cs as usize);
    // Rows of whole vectors already: read in place. Otherwise copy into zero-padded rows.
    let (packed, npad) = if cs == 1 && n.is_multiple_of(L::W) && rs <= 2 * n {
        (rhs.data.as_ptr(), rs)
    } else {
        let npad = nv * L::W;
        let buf = &mut pack.0;
        buf.resize(k * npad, 0.0);
        let src = rhs.data;
        if cs == 1 {
            for (p, row) in buf.chunks_exact_mut(npad).take(k).enumerate() {
                row[..n].copy_from_slice(&src[p * rs..p * rs + n]);
                row[n..].fill(0.0);
            }
        } else {
            // Transposed: read each column of the packed rows contiguously (none when k = 0).
            for j in (0..n).take_while(|_| k > 0) {
                let col = &src[j * cs..];
                for p in 0..k {
                    buf[p * npad + j] = col[p * rs];
                }
            }
            for row in buf.chunks_exact_mut(npad).take(k) {
                row[n..].fill(0.0);
            }
        }
        (buf.as_ptr(), npad)
    };
    let t = Task {
        dst: dst.data.as_mut_ptr(),
        ld: dst.ld,
        rows: dst.rows,
        cols: n,
        accumulate: dst.accumulate,
        lhs: lhs.data.as_ptr(),
        lhs_at: (lhs.at.rs as usize, lhs.at.cs as usize),
        packed,
        npad,
        k,
    };
    let mut v0 = 0;
    while v0 < nv {
        let vn = L::PANEL.min(nv - v0);
        L::panel(&t, vn, v0);
        v0 += vn;
    }
}

/// Every row of the panel: blocks of `R` rows, then of `R2`, then the rest one at a time.
#[inline(always)]
unsafe fn rows<L: Lane, const V: usize, const R: usize, const R2: usize>(t: &Task, v0: usize) {
    let mut i0 = 0;
    while i0 + R <= t.rows {
        block::<L, V, R>(t, i0, v0);
        i0 += R;
    }
    while i0 + R2 <= t.rows {
        block::<L, V, R2>(t, i0, v0);
        i0 += R2;
    }
    while i0 < t.rows {
        block::<L, V, 1>(t, i0, v0);
        i0 += 1;
    }
}

/// Rows `i0..i0 + R`, vectors `v0..v0 + V` of the output, summed in registers.
#[inline(always)]
unsafe fn block<L: Lane, const V: usize, const R: usize>(t: &Task, i0: usize, v0: usize) {
    let mut acc = [[L::zero(); V]; R];
    let (ars, acs) = t.lhs_at;
    for p in 0..t.k {
        let brow = t.packed.add(p * t.npad + v0 * L::W);
        let mut b = [L::zero(); V];
        for (v, x) in b.iter_mut().enumerate() {
            *x = L::load(brow.add(v * L::W));
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let a = L::splat(*t.lhs.add((i0 + r) * ars + p * acs));
            for v in 0..V {
                acc_r[v] = L::fma(a, b[v], acc_r[v]);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (v, &x) in acc_r.iter().enumerate() {
            let col = (v0 + v) * L::W;
            let out = t.dst.add((i0 + r) * t.ld + col);
            let count = L::W.min(t.cols - col);
            if count == L::W {
                let y = if t.accumulate {
                    L::add(L::load(out), x)
                } else {
                    x
                };
                L::store(out, y);
            } else {
                let mut tail = [0.0f32; 16];
                L::store(tail.as_mut_ptr(), x);
                for (j, &s) in tail[..count].iter().enumerate() {
                    *out.add(j) = if t.accumulate { *out.add(j) + s } else { s };
                }
            }
        }
    }
}

/// Four lanes in plain arithmetic (multiply, then add): the fallback of CPUs without AVX2.
struct Portable;

impl Lane for Portable {
    type V = [f32; 4];
    const W: usize = 4;
    const PANEL: usize = 4;
    unsafe fn panel(t: &Task, vn: usize, v0: usize) {
        match vn {
            1 => rows::<Self, 1, 4, 2>(t, v0),
            2 => rows::<Self, 2, 4, 2>(t, v0),
            3 => rows::<Self, 3, 4, 2>(t, v0),
            _ => rows::<Self, 4, 4, 2>(t, v0),
        }
    }
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 4]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::ptr::read_unaligned(p as *const [f32; 4])
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::ptr::write_unaligned(p as *mut [f32; 4], v)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; 4]
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{rows, Lane, Task};
    use std::arch::x86_64::*;

    /// 16 lanes; 32 registers hold a block of 6 rows × 4 vectors (or 12 × 2) with their loads.
    pub(super) struct Avx512;

    impl Lane for Avx512 {
        type V = __m512;
        const W: usize = 16;
        const PANEL: usize = 4;
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn panel(t: &Task, vn: usize, v0: usize) {
            match vn {
                1 => rows::<Self, 1, 8, 4>(t, v0),
                2 => rows::<Self, 2, 12, 8>(t, v0),
                3 => rows::<Self, 3, 8, 4>(t, v0),
                _ => rows::<Self, 4, 6, 4>(t, v0),
            }
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
    }

    /// 8 lanes; 16 registers hold a block of 5 rows × 2 vectors with their loads.
    pub(super) struct Avx2;

    impl Lane for Avx2 {
        type V = __m256;
        const W: usize = 8;
        const PANEL: usize = 2;
        #[target_feature(enable = "avx2,fma")]
        unsafe fn panel(t: &Task, vn: usize, v0: usize) {
            match vn {
                1 => rows::<Self, 1, 6, 4>(t, v0),
                _ => rows::<Self, 2, 5, 4>(t, v0),
            }
        }
        #[inline]
        #[target_feature(enable = "avx")]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx")]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline]
        #[target_feature(enable = "avx")]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline]
        #[target_feature(enable = "avx")]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline]
        #[target_feature(enable = "fma")]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx")]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
    }
}

#[cfg(test)]
mod tests;
