//! The matrix products of one attention tile — at most 64 × 64 outputs, an inner dimension of
//! a head or a tile — on the calling thread, with a register-blocked kernel.
//!
//! The right operand is read in place where its rows are whole vectors, and otherwise copied
//! once into zero-padded rows of whole vectors (a transposed one, `Kᵀ` or `Vᵀ`); then the output is computed `R` rows × `V` vectors at a
//! time in registers: per inner index, `V` vector loads and `R` broadcasts of the left operand
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
/// `(c, j) = scale · src[j·ld + c]` for the tile's `rows ≤ width` rows, zero past them. Packed
/// once and read in place by every product with it ([`Transposed::get`]); at most `d × width`
/// floats whatever the sequence.
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

/// Largest index reached by `rows × cols` through `at` (0 for an empty matrix).
fn last(rows: usize, cols: usize, at: Mat) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    ((rows - 1) as isize * at.rs + (cols - 1) as isize * at.cs) as usize
}

/// `dst (+)= lhs[rows × k] · rhs[k × cols]`.
///
/// # Panics
/// If an operand's strides reach outside its slice, or a stride is negative.
pub(crate) fn product(dst: Dst<'_>, lhs: Src<'_>, rhs: Src<'_>, k: usize, pack: &mut Pack) {
    product_scaled(dst, lhs, rhs, 1.0, k, pack)
}

/// `dst (+)= lhs[rows × k] · (scale · rhs[k × cols])`, `rhs` scaled as it is packed: the
/// attention scores' `1/√d` at no extra pass. `scale = 1` is [`product`].
///
/// # Panics
/// As [`product`].
pub(crate) fn product_scaled(
    dst: Dst<'_>,
    lhs: Src<'_>,
    rhs: Src<'_>,
    scale: f32,
    k: usize,
    pack: &mut Pack,
) {
    let (m, n) = (dst.rows, dst.cols);
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        [lhs.at.rs, lhs.at.cs, rhs.at.rs, rhs.at.cs]
            .iter()
            .all(|&s| s >= 0),
        "negative stride"
    );
    assert!(dst.ld >= n && (m - 1) * dst.ld + n <= dst.data.len(), "dst");
    if k > 0 {
        assert!(last(m, k, lhs.at) < lhs.data.len(), "lhs");
        assert!(last(k, n, rhs.at) < rhs.data.len(), "rhs");
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("fma") {
            // SAFETY: the CPU has AVX-512F and FMA; bounds were checked above.
            return unsafe { on_avx512(dst, lhs, rhs, scale, k, pack) };
        }
        if has!("avx2") && has!("fma") {
            // SAFETY: the CPU has AVX2 and FMA; bounds were checked above.
            return unsafe { on_avx2(dst, lhs, rhs, scale, k, pack) };
        }
    }
    // SAFETY: bounds were checked above.
    unsafe { run::<Portable>(dst, lhs, rhs, scale, k, pack) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn on_avx512(
    dst: Dst<'_>,
    lhs: Src<'_>,
    rhs: Src<'_>,
    scale: f32,
    k: usize,
    pack: &mut Pack,
) {
    run::<x86::Avx512>(dst, lhs, rhs, scale, k, pack)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn on_avx2(dst: Dst<'_>, lhs: Src<'_>, rhs: Src<'_>, scale: f32, k: usize, pack: &mut Pack) {
    run::<x86::Avx2>(dst, lhs, rhs, scale, k, pack)
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
unsafe fn run<L: Lane>(
    dst: Dst<'_>,
    lhs: Src<'_>,
    rhs: Src<'_>,
    scale: f32,
    k: usize,
    pack: &mut Pack,
) {
    let n = dst.cols;
    let nv = n.div_ceil(L::W);
    let (rs, cs) = (rhs.at.rs as usize, rhs.at.cs as usize);
    // Rows of whole vectors already: read in place. Otherwise copy into zero-padded rows.
    let (packed, npad) = if cs == 1 && n.is_multiple_of(L::W) && rs <= 2 * n && scale == 1.0 {
        (rhs.data.as_ptr(), rs)
    } else {
        let npad = nv * L::W;
        let buf = &mut pack.0;
        buf.resize(k * npad, 0.0);
        let src = rhs.data;
        if cs == 1 {
            for (p, row) in buf.chunks_exact_mut(npad).take(k).enumerate() {
                let from = &src[p * rs..p * rs + n];
                if scale == 1.0 {
                    row[..n].copy_from_slice(from);
                } else {
                    row[..n]
                        .iter_mut()
                        .zip(from)
                        .for_each(|(x, y)| *x = scale * y);
                }
                row[n..].fill(0.0);
            }
        } else {
            // Transposed (`Kᵀ`, `Vᵀ`): read each column of the packed rows contiguously.
            for j in 0..n {
                let col = &src[j * cs..];
                for p in 0..k {
                    buf[p * npad + j] = scale * col[p * rs];
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
mod tests {
    use super::*;

    type Path = unsafe fn(Dst<'_>, Src<'_>, Src<'_>, f32, usize, &mut Pack);

    /// Every instruction set this CPU runs, by name.
    fn paths() -> Vec<(&'static str, Path)> {
        let mut p: Vec<(&'static str, Path)> = vec![("portable", run::<Portable>)];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") {
                p.push(("avx2", on_avx2));
            }
            if has!("avx512f") && has!("fma") {
                p.push(("avx512", on_avx512));
            }
        }
        p
    }

    /// `lhs[m×k] · rhs[k×n]` in f64 through the strides.
    fn reference(m: usize, n: usize, k: usize, lhs: Src<'_>, rhs: Src<'_>) -> Vec<f64> {
        let at = |s: Src<'_>, i: usize, j: usize| {
            s.data[i * s.at.rs as usize + j * s.at.cs as usize] as f64
        };
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| at(lhs, i, p) * at(rhs, p, j)).sum();
            }
        }
        c
    }

    fn data(n: usize, f: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * f).sin()).collect()
    }

    #[test]
    fn products_match_a_reference_on_every_path_shape_and_stride() {
        for (name, path) in paths() {
            for &(m, n, k) in &[
                (64, 64, 32),
                (64, 32, 64),
                (64, 128, 64),
                (37, 80, 13),
                (5, 17, 3),
                (1, 8, 1),
                (64, 8, 64),
                (9, 48, 0),
            ] {
                for (lt, rt) in [(false, false), (true, false), (false, true), (true, true)] {
                    let (a, b) = (data(m * k + 3, 0.37), data(k * n + 5, 0.71));
                    let la = if lt { Mat::transposed(m) } else { Mat::rows(k) };
                    let ra = if rt { Mat::transposed(k) } else { Mat::rows(n) };
                    let (lhs, rhs) = (Src { data: &a, at: la }, Src { data: &b, at: ra });
                    let scale = if rt { 0.125 } else { 1.0 };
                    let want: Vec<f64> = reference(m, n, k, lhs, rhs)
                        .iter()
                        .map(|x| x * scale as f64)
                        .collect();
                    let ld = n + 3;
                    for accumulate in [false, true] {
                        let init = data(m * ld, 0.13);
                        let mut c = init.clone();
                        let dst = Dst {
                            data: &mut c,
                            ld,
                            rows: m,
                            cols: n,
                            accumulate,
                        };
                        // SAFETY: `paths` lists only instruction sets this CPU has.
                        unsafe { path(dst, lhs, rhs, scale, k, &mut Pack::default()) };
                        for i in 0..m {
                            for j in 0..ld {
                                let (got, old) = (c[i * ld + j], init[i * ld + j]);
                                if j >= n {
                                    assert_eq!(got, old, "{name}: padding column {j} written");
                                    continue;
                                }
                                let w = want[i * n + j] + if accumulate { old as f64 } else { 0.0 };
                                let err = (got as f64 - w).abs();
                                assert!(
                                    err <= 1e-5 * (1.0 + w.abs()),
                                    "{name} {m}x{n}x{k} lt {lt} rt {rt} acc {accumulate}: \
                                     [{i},{j}] {got} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_dirty_workspace_and_a_short_dst_are_handled() {
        let (a, b) = (data(4 * 6, 0.5), data(6 * 20, 0.25));
        let (lhs, rhs) = (
            Src {
                data: &a,
                at: Mat::rows(6),
            },
            Src {
                data: &b,
                at: Mat::rows(20),
            },
        );
        let mut pack = Pack(vec![f32::NAN; 1000]);
        let mut c = vec![0.0; 4 * 20];
        let dst = Dst {
            data: &mut c,
            ld: 20,
            rows: 4,
            cols: 20,
            accumulate: false,
        };
        product(dst, lhs, rhs, 6, &mut pack);
        let want = reference(4, 20, 6, lhs, rhs);
        for (g, w) in c.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 1e-5, "{g} vs {w}");
        }
        let mut short = vec![0.0; 4 * 20 - 1];
        let caught = std::panic::catch_unwind(move || {
            let dst = Dst {
                data: &mut short,
                ld: 20,
                rows: 4,
                cols: 20,
                accumulate: false,
            };
            product(dst, lhs, rhs, 6, &mut Pack::default())
        });
        assert!(
            caught.is_err(),
            "a destination one element short must be refused"
        );
    }
}
