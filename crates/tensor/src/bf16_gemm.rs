//! Products in bf16 with f32 sums (`train.bf16_products`): AVX-512 BF16's `vdpbf16ps`, which
//! multiplies 32 bf16 pairs into 16 f32 lanes per instruction.
//!
//! `dst[m×n] (+)= lhs[m×k] · rhs[k×n]`: each operand is f32, rounded to bf16 (to nearest
//! even) while it is packed, or bf16, packed as it is stored ([`PackElem`]); rounding a
//! widened bf16 back is exact, so a bf16 tensor gives the same product either way. Each
//! product of two bf16 is exact in f32 and the sums are f32. The packing follows the usual blocking: a block of `rhs`
//! ([`BF16_GEMM_DEPTH`] × [`BF16_GEMM_COLS`]) is packed once, in panels of [`NR`] columns
//! whose depth runs in pairs (the two bf16 of one 32-bit lane); each task packs a block of
//! at most [`BF16_GEMM_ROWS`] rows of `lhs` in panels of [`MR`] rows and runs the `MR × NR`
//! register tile over them. The buffers are bounded by those constants and counted by the
//! engine ([`ferrotron_config::BF16_GEMM_SHARED_BYTES`], `…_PER_THREAD_BYTES`).

use ferrotron_config::{BF16_GEMM_COLS, BF16_GEMM_DEPTH, BF16_GEMM_ROWS};
use rayon::prelude::*;
use std::ops::Range;

use crate::mat::Mat;

/// Rows of the register tile.
pub const MR: usize = 8;
/// Columns of the register tile: three vectors of 16 f32 lanes.
pub const NR: usize = 48;

/// Whether this CPU runs [`matmul_bf16`] (AVX-512F and AVX-512 BF16).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The bf16 nearest to `x` (ties to even; NaN stays NaN), as its bits.
#[inline]
pub fn round_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// An element [`matmul_bf16`] packs: f32 (rounded to bf16 as it is packed) or bf16 (packed
/// as it is).
pub trait PackElem: Copy + Send + Sync + 'static {
    /// The element's bf16 bits (f32: rounded to nearest even, [`round_bits`]).
    fn bits(self) -> u16;
    /// `dst[j] = (lo[j], hi[j])` as bf16 in one lane (`hi` absent: 0), `dst.len()` lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16 ([`available`]).
    unsafe fn interleave(dst: &mut [u32], lo: &[Self], hi: Option<&[Self]>);
    /// `dst[p] = (src[2p], src[2p + 1])` as bf16 (past the end: 0).
    ///
    /// # Safety
    /// As [`PackElem::interleave`].
    unsafe fn pairs(dst: &mut [u32], src: &[Self]);
}

impl PackElem for f32 {
    #[inline]
    fn bits(self) -> u16 {
        round_bits(self)
    }
    unsafe fn interleave(dst: &mut [u32], lo: &[f32], hi: Option<&[f32]>) {
        // SAFETY: the caller's.
        unsafe { x86::round_interleave(dst, lo, hi) }
    }
    unsafe fn pairs(dst: &mut [u32], src: &[f32]) {
        // SAFETY: the caller's.
        unsafe { x86::round_pairs(dst, src) }
    }
}

impl PackElem for half::bf16 {
    #[inline]
    fn bits(self) -> u16 {
        self.to_bits()
    }
    unsafe fn interleave(dst: &mut [u32], lo: &[half::bf16], hi: Option<&[half::bf16]>) {
        let n = dst.len();
        assert!(lo.len() >= n && hi.is_none_or(|h| h.len() >= n));
        let whole = n / 16 * 16;
        let bits = |s: &[half::bf16]| -> *const u16 { s.as_ptr().cast() };
        // SAFETY: the caller's (AVX-512F); `lo` and `hi` hold `whole ≤ n` values.
        unsafe { x86::interleave_bits(&mut dst[..whole], bits(lo), hi.map(bits)) };
        for j in whole..n {
            dst[j] = lane(lo[j].bits(), hi.map_or(0, |h| h[j].bits()));
        }
    }
    unsafe fn pairs(dst: &mut [u32], src: &[half::bf16]) {
        assert_eq!(dst.len(), src.len().div_ceil(2));
        // Two bf16 in memory are the 32-bit lane `lo | hi << 16` (x86-64 is little-endian).
        let whole = src.len() / 2;
        for (d, two) in dst[..whole].iter_mut().zip(src.chunks_exact(2)) {
            *d = lane(two[0].bits(), two[1].bits());
        }
        if src.len() % 2 == 1 {
            dst[whole] = lane(src[src.len() - 1].bits(), 0);
        }
    }
}

/// Two bf16 in one 32-bit lane: `lo` in the low half (the even depth index).
#[inline]
fn lane(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// A read-only strided operand: element `(r, c)` at `r · rs + c · cs`.
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    data: &'a [T],
    at: Mat,
}

impl<T: PackElem> Operand<'_, T> {
    #[inline]
    fn get(&self, r: usize, c: usize) -> T {
        self.data[(r as isize * self.at.rs + c as isize * self.at.cs) as usize]
    }

    /// `len` contiguous elements from `(r, c)` along the unit stride: along a row, or
    /// (`down`) along a column, where `fixed` names the other index.
    fn run(&self, fixed: usize, from: usize, len: usize, down: bool) -> &[T] {
        let start = if down {
            from as isize * self.at.rs + fixed as isize * self.at.cs
        } else {
            fixed as isize * self.at.rs + from as isize * self.at.cs
        } as usize;
        &self.data[start..start + len]
    }
}

/// Packs rows `rows` of `a` over depth `depth` into panels of `MR` rows: for each depth pair
/// `p`, the `MR` lanes `(a[i, 2p], a[i, 2p + 1])`. Missing rows and an odd depth's last
/// element are zero.
fn pack_lhs<T: PackElem>(out: &mut [u32], a: Operand<T>, rows: Range<usize>, depth: Range<usize>) {
    let kp = depth.len().div_ceil(2);
    let panels = rows.len().div_ceil(MR);
    for (panel, out) in out[..panels * MR * kp].chunks_mut(MR * kp).enumerate() {
        let i0 = rows.start + panel * MR;
        let live = (rows.end - i0).min(MR);
        if a.at.rs == 1 {
            // Rows contiguous for a fixed depth (a transposed matrix): interleave two depths.
            for p in 0..kp {
                let k = depth.start + 2 * p;
                let lo = a.run(k, i0, live, true);
                let hi = (k + 1 < depth.end).then(|| a.run(k + 1, i0, live, true));
                let o = &mut out[p * MR..(p + 1) * MR];
                // SAFETY: the CPU has AVX-512 BF16 (`matmul_bf16` asserts it).
                unsafe { T::interleave(&mut o[..live], lo, hi) };
                o[live..].fill(0);
            }
            continue;
        }
        for ii in 0..MR {
            if ii >= live {
                (0..kp).for_each(|p| out[p * MR + ii] = 0);
            } else if a.at.cs == 1 {
                // Depth contiguous: round the row's run in pairs, then spread it.
                let mut lanes = [0u32; BF16_GEMM_DEPTH / 2];
                // SAFETY: as above.
                unsafe {
                    T::pairs(
                        &mut lanes[..kp],
                        a.run(i0 + ii, depth.start, depth.len(), false),
                    )
                };
                (0..kp).for_each(|p| out[p * MR + ii] = lanes[p]);
            } else {
                for p in 0..kp {
                    let (i, k) = (i0 + ii, depth.start + 2 * p);
                    let hi = if k + 1 < depth.end {
                        a.get(i, k + 1).bits()
                    } else {
                        0
                    };
                    out[p * MR + ii] = lane(a.get(i, k).bits(), hi);
                }
            }
        }
    }
}

/// Packs one panel of `NR` columns of `b` from column `col` over depth `depth`: for each
/// depth pair `p`, the `NR` lanes `(b[2p, j], b[2p + 1, j])`; columns past `cols` are zero.
fn pack_rhs_panel<T: PackElem>(
    out: &mut [u32],
    b: Operand<T>,
    col: usize,
    cols: usize,
    depth: Range<usize>,
) {
    let kp = depth.len().div_ceil(2);
    let live = (cols - col).min(NR);
    if b.at.cs == 1 {
        // Rows contiguous: interleave two rows of the depth.
        for p in 0..kp {
            let k = depth.start + 2 * p;
            let hi = (k + 1 < depth.end).then(|| b.run(k + 1, col, live, false));
            let o = &mut out[p * NR..(p + 1) * NR];
            // SAFETY: the CPU has AVX-512 BF16 (`matmul_bf16` asserts it).
            unsafe { T::interleave(&mut o[..live], b.run(k, col, live, false), hi) };
            o[live..].fill(0);
        }
        return;
    }
    for jj in 0..NR {
        let j = col + jj;
        if jj >= live {
            (0..kp).for_each(|p| out[p * NR + jj] = 0);
        } else if b.at.rs == 1 {
            // Depth contiguous (a transposed matrix): round the column's run in pairs.
            let mut lanes = [0u32; BF16_GEMM_DEPTH / 2];
            // SAFETY: as above.
            unsafe { T::pairs(&mut lanes[..kp], b.run(j, depth.start, depth.len(), true)) };
            (0..kp).for_each(|p| out[p * NR + jj] = lanes[p]);
        } else {
            for p in 0..kp {
                let k = depth.start + 2 * p;
                let hi = if k + 1 < depth.end {
                    b.get(k + 1, j).bits()
                } else {
                    0
                };
                out[p * NR + jj] = lane(b.get(k, j).bits(), hi);
            }
        }
    }
}

/// A `dst` shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct Dst {
    ptr: *mut f32,
    ld: usize,
}
const _: () = assert!(BF16_GEMM_COLS.is_multiple_of(NR) && BF16_GEMM_DEPTH.is_multiple_of(2));

// SAFETY: tasks write disjoint row blocks of `dst`, whose borrow outlives them.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    /// The address of element `(i, j)`.
    fn at(&self, i: usize, j: usize) -> *mut f32 {
        self.ptr.wrapping_add(i * self.ld + j)
    }
}

/// `dst[m×n] (+)= lhs[m×k] · rhs[k×n]` with bf16 products and f32 sums, on the current rayon
/// pool. `dst` is row-major with leading dimension `ldc ≥ n`; `lhs` and `rhs` are read
/// through any strides.
///
/// # Panics
/// If the CPU lacks AVX-512 BF16 ([`available`]; the engine checks before any work), or a
/// stride reaches past a slice.
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16<A: PackElem, B: PackElem>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    ldc: usize,
    accumulate: bool,
    lhs: &[A],
    ll: Mat,
    rhs: &[B],
    rl: Mat,
) {
    assert!(available(), "matmul_bf16 needs AVX-512 BF16");
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        ldc >= n && dst.len() >= (m - 1) * ldc + n,
        "matmul_bf16: dst too short"
    );
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(ldc).take(m).for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    let (a, b) = (Operand { data: lhs, at: ll }, Operand { data: rhs, at: rl });
    let threads = rayon::current_num_threads().max(1);
    let mc = m
        .div_ceil(threads)
        .next_multiple_of(MR)
        .min(BF16_GEMM_ROWS / MR * MR);
    let out = Dst {
        ptr: dst.as_mut_ptr(),
        ld: ldc,
    };
    let mut packed_b = vec![0u32; BF16_GEMM_DEPTH / 2 * BF16_GEMM_COLS.next_multiple_of(NR)];
    // Blocks of equal size (the depth's even, the columns' whole tiles), at most the bounds.
    let cols = n.div_ceil(n.div_ceil(BF16_GEMM_COLS)).next_multiple_of(NR);
    let deep = k.div_ceil(k.div_ceil(BF16_GEMM_DEPTH)).next_multiple_of(2);
    for jc in (0..n).step_by(cols) {
        let nc = cols.min(n - jc);
        for pc in (0..k).step_by(deep) {
            let depth = pc..(pc + deep).min(k);
            let kp = depth.len().div_ceil(2);
            let panels = nc.div_ceil(NR);
            packed_b[..panels * kp * NR]
                .par_chunks_mut(kp * NR)
                .enumerate()
                .for_each(|(q, o)| pack_rhs_panel(o, b, jc + q * NR, jc + nc, depth.clone()));
            let add = accumulate || pc > 0;
            let packed_b = &packed_b[..panels * kp * NR];
            (0..m.div_ceil(mc)).into_par_iter().for_each_init(
                || vec![0u32; BF16_GEMM_ROWS * BF16_GEMM_DEPTH / 2],
                |packed_a, blk| {
                    let rows = blk * mc..(blk * mc + mc).min(m);
                    pack_lhs(packed_a, a, rows.clone(), depth.clone());
                    for q in 0..panels {
                        let cols = (nc - q * NR).min(NR);
                        for (r, i0) in rows.clone().step_by(MR).enumerate() {
                            let tile_rows = (rows.end - i0).min(MR);
                            // SAFETY: the CPU has AVX-512 BF16 (asserted); the panels hold
                            // `kp` pairs of `MR` and `NR` lanes; the tile lies inside `dst`
                            // (`tile_rows` rows from `i0 < m`, `cols` columns from
                            // `jc + q·NR < n`) in rows only this task writes.
                            unsafe {
                                x86::tile(
                                    kp,
                                    packed_a[r * MR * kp..].as_ptr(),
                                    packed_b[q * NR * kp..].as_ptr(),
                                    out.at(i0, jc + q * NR),
                                    (ldc, tile_rows, cols),
                                    add,
                                );
                            }
                        }
                    }
                },
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// The `MR × NR` register tile: `c[rows × cols] (+)= Σ_p a[p] ⊗ b[p]` over `kp` depth
    /// pairs, `c` at leading dimension `ld`.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16; `a` holds `kp · MR` and `b` `kp · NR` lanes;
    /// `c` is valid for `rows ≤ MR` rows of `cols ≤ NR` elements at stride `ld`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn tile(
        kp: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        (ld, rows, cols): (usize, usize, usize),
        add: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 3]; MR];
        for p in 0..kp {
            let bp = b.add(p * NR) as *const __m512i;
            let bv: [__m512bh; 3] = [
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.add(1))),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.add(2))),
            ];
            let ap = a.add(p * MR);
            for (i, row) in acc.iter_mut().enumerate() {
                let av =
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*ap.add(i) as i32));
                for (c, bv) in row.iter_mut().zip(&bv) {
                    *c = _mm512_dpbf16_ps(*c, av, *bv);
                }
            }
        }
        store(&acc, c, (ld, rows, cols), add);
    }

    /// Writes (or adds) the tile's sums to `c`.
    #[target_feature(enable = "avx512f")]
    unsafe fn store(
        acc: &[[__m512; 3]; MR],
        c: *mut f32,
        (ld, rows, cols): (usize, usize, usize),
        add: bool,
    ) {
        for (i, row) in acc.iter().enumerate().take(rows) {
            for (v, sum) in row.iter().enumerate() {
                let lo = v * 16;
                if lo >= cols {
                    break;
                }
                let mask: __mmask16 = if cols - lo >= 16 {
                    0xffff
                } else {
                    (1u16 << (cols - lo)) - 1
                };
                let ptr = c.add(i * ld + lo);
                let sum = if add {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(mask, ptr), *sum)
                } else {
                    *sum
                };
                _mm512_mask_storeu_ps(ptr, mask, sum);
            }
        }
    }

    /// The mask of the first `n ≤ 16` lanes.
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            (1u16 << n) - 1
        }
    }

    /// `dst[j] = (lo[j], hi[j])` rounded to bf16 (`hi` absent: 0), `dst.len()` lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16; `lo` and `hi` hold at least `dst.len()` values.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn round_interleave(dst: &mut [u32], lo: &[f32], hi: Option<&[f32]>) {
        let n = dst.len();
        assert!(lo.len() >= n && hi.is_none_or(|h| h.len() >= n));
        for j in (0..n).step_by(16) {
            let m = lanes(n - j);
            let l = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, lo.as_ptr().add(j)));
            let h = hi.map_or(_mm512_setzero_ps(), |h| {
                _mm512_maskz_loadu_ps(m, h.as_ptr().add(j))
            });
            let h = _mm512_cvtneps_pbh(h);
            let l = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(l));
            let h = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(h));
            let v = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
            _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(j) as *mut i32, m, v);
        }
    }

    /// `dst[j] = lo[j] | hi[j] << 16` for bf16 bits (`hi` absent: 0), `dst.len()` a multiple
    /// of 16 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `lo` and `hi` point to at least `dst.len()` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn interleave_bits(dst: &mut [u32], lo: *const u16, hi: Option<*const u16>) {
        debug_assert!(dst.len().is_multiple_of(16));
        for j in (0..dst.len()).step_by(16) {
            let l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(lo.add(j).cast()));
            let h = hi.map_or(_mm512_setzero_si512(), |h| {
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(h.add(j).cast()))
            });
            let v = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
            _mm512_storeu_si512(dst.as_mut_ptr().add(j).cast(), v);
        }
    }

    /// `dst[p] = (src[2p], src[2p + 1])` rounded to bf16 (past the end: 0);
    /// `dst.len() = src.len().div_ceil(2)`.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX-512 BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn round_pairs(dst: &mut [u32], src: &[f32]) {
        let n = src.len();
        assert_eq!(dst.len(), n.div_ceil(2));
        for i in (0..n).step_by(32) {
            let a = _mm512_maskz_loadu_ps(lanes(n - i), src.as_ptr().add(i));
            let b = if n - i > 16 {
                _mm512_maskz_loadu_ps(lanes(n - i - 16), src.as_ptr().add(i + 16))
            } else {
                _mm512_setzero_ps()
            };
            let v = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a));
            let m = lanes((n - i).div_ceil(2));
            _mm512_mask_storeu_epi32(dst.as_mut_ptr().add(i / 2) as *mut i32, m, v);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    /// Never called: [`super::available`] is false off x86-64.
    pub unsafe fn tile(
        _: usize,
        _: *const u32,
        _: *const u32,
        _: *mut f32,
        _: (usize, usize, usize),
        _: bool,
    ) {
        unreachable!("matmul_bf16 needs AVX-512 BF16")
    }
    /// Never called.
    pub unsafe fn round_interleave(_: &mut [u32], _: &[f32], _: Option<&[f32]>) {
        unreachable!("matmul_bf16 needs AVX-512 BF16")
    }
    /// Never called.
    pub unsafe fn round_pairs(_: &mut [u32], _: &[f32]) {
        unreachable!("matmul_bf16 needs AVX-512 BF16")
    }
    /// Never called.
    pub unsafe fn interleave_bits(_: &mut [u32], _: *const u16, _: Option<*const u16>) {
        unreachable!("matmul_bf16 needs AVX-512 BF16")
    }
}
