//! The products inside the attention tiles (32 query rows against up to 128 keys, depth the
//! head dimension or the tile's rows).
//!
//! At these sizes the `gemm` crate packs both operands on every call, so a product of
//! 0.5 MFLOP spent about a fifth of its time packing. Where the CPU has AVX2 and FMA,
//! [`product`] runs instead on a kernel written for these shapes: 6 × 16 blocks of `C` held in
//! 12 registers over the whole depth, `A` broadcast straight from its rows or columns, `B`
//! read by rows; where it also has AVX-512, the same kernel 12 × 32 in 24 `zmm` registers
//! ([`avx512`]; on a Zen 4, the median of 8 alternating runs of `attention_time`: tiny's
//! attention 8% faster than on `gemm`, small's and medium's 2–5%). The tiles lay each head
//! out once per task rather than once per product: [`Head::gather`] copies the rows a product
//! reads as `B` next to each other (in place, rows 2ⁿ floats apart fell into a few L1 sets and
//! evicted each other), and [`Head::transpose`] lays out `Kᵀ` and `Vᵀ`.

use crate::fastmath::{self, Lanes};
use crate::linear::{matmul, Mat, Threads};
use crate::transpose::{transpose_block, Block};

/// A matrix operand: element `(r, c)` at `data[r·rs + c·cs]`.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    /// The elements, starting at `(0, 0)`.
    pub data: &'a [f32],
    /// Element stride between rows.
    pub rs: usize,
    /// Element stride between columns.
    pub cs: usize,
}

impl<'a> Operand<'a> {
    /// Row-major with leading dimension `ld`.
    pub fn rows(data: &'a [f32], ld: usize) -> Self {
        Operand {
            data,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose of a row-major matrix with leading dimension `ld`.
    pub fn transposed(data: &'a [f32], ld: usize) -> Self {
        Operand {
            data,
            rs: 1,
            cs: ld,
        }
    }
    /// Whether every element of a `rows × cols` view lies inside `data`.
    fn holds(&self, rows: usize, cols: usize) -> bool {
        if rows == 0 || cols == 0 {
            return true;
        }
        let last = (rows - 1)
            .checked_mul(self.rs)
            .zip((cols - 1).checked_mul(self.cs))
            .and_then(|(r, c)| r.checked_add(c));
        last.is_some_and(|l| l < self.data.len())
    }
}

/// The output of a product: row-major with leading dimension `ld`, overwritten or added to.
pub(super) struct Out<'a> {
    /// The elements, starting at `(0, 0)`.
    pub data: &'a mut [f32],
    /// Leading dimension.
    pub ld: usize,
    /// Add the product to what is there (`true`) or overwrite it.
    pub accumulate: bool,
}

impl<'a> Out<'a> {
    /// Overwritten by the product.
    pub fn write(data: &'a mut [f32], ld: usize) -> Self {
        Out {
            data,
            ld,
            accumulate: false,
        }
    }
    /// Added to by the product.
    pub fn add(data: &'a mut [f32], ld: usize) -> Self {
        Out {
            data,
            ld,
            accumulate: true,
        }
    }
}

/// Which kernel runs a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kernel {
    /// The `gemm` crate.
    Gemm,
    /// The register-blocked AVX2 + FMA kernel of this file.
    Fma,
    /// Its AVX-512 form ([`avx512`]): blocks twice as wide in twice the registers.
    Fma512,
}

impl Kernel {
    /// The kernel for this CPU: [`Kernel::Fma512`] where it has AVX-512 (and AVX2 and FMA),
    /// [`Kernel::Fma`] where it has AVX2 and FMA, else [`Kernel::Gemm`].
    pub fn detect() -> Kernel {
        match fastmath::lanes() {
            Lanes::Avx512 if fma_available() => Kernel::Fma512,
            _ if fma_available() => Kernel::Fma,
            _ => Kernel::Gemm,
        }
    }
}

/// Whether this CPU can run [`Kernel::Fma`] at all (AVX2 and FMA, with or without AVX-512).
pub(super) fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `C[m × n] (+)= A[m × k] · B[k × n]` on `kernel`. [`Kernel::Fma`] takes products whose `B`
/// is row-major, whose `n` is a multiple of 8 and whose `m`, `k` are not 0, on a CPU with AVX2
/// and FMA; any other goes to the `gemm` crate.
///
/// Panics when a view reaches past its slice.
pub(super) fn product(
    kernel: Kernel,
    (m, n, k): (usize, usize, usize),
    c: Out,
    a: Operand,
    b: Operand,
) {
    assert!(
        a.holds(m, k) && b.holds(k, n) && Operand::rows(c.data, c.ld).holds(m, n),
        "attention tile product {m}×{n}×{k} reaches past an operand"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let fits = b.cs == 1 && n.is_multiple_of(8) && m > 0 && k > 0;
        let wide = kernel == Kernel::Fma512 && fastmath::lanes() == Lanes::Avx512;
        if kernel != Kernel::Gemm && fits && fma_available() {
            let raw = fma::Raw {
                c: c.data.as_mut_ptr(),
                ldc: c.ld,
                accumulate: c.accumulate,
                a: a.data.as_ptr(),
                ars: a.rs,
                acs: a.cs,
                b: b.data.as_ptr(),
                ldb: b.rs,
                k,
            };
            // SAFETY: the CPU has AVX2 and FMA (detected above), and AVX-512F for `wide`;
            // every element the kernel reads or writes lies inside its slice (asserted
            // above), and `c` is a distinct `&mut` borrow.
            unsafe {
                if wide {
                    avx512::product(m, n, &raw)
                } else {
                    fma::product(m, n, &raw)
                }
            };
            return;
        }
    }
    let mat = |o: Operand| Mat {
        rs: o.rs as isize,
        cs: o.cs as isize,
    };
    let (ll, rl) = (mat(a), mat(b));
    matmul(
        m,
        n,
        k,
        c.data,
        Mat::rows(c.ld),
        c.accumulate,
        a.data,
        ll,
        b.data,
        rl,
        Threads::Single,
    );
}

/// Row-major rows with leading dimension `ld`: a [`Head`]'s, or a head's rows in place.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    data: &'a [f32],
    ld: usize,
}

impl<'a> Rows<'a> {
    /// Row `r` at `data[r·ld..]`.
    pub fn new(data: &'a [f32], ld: usize) -> Self {
        Rows { data, ld }
    }
    /// Rows from `r0` on.
    pub fn row(&self, r0: usize) -> Operand<'a> {
        Operand::rows(&self.data[r0 * self.ld..], self.ld)
    }
}

/// One head's rows (or their transpose) copied out of a strided activation into a buffer of
/// their own, so that the rows a kernel block reads lie close together. The leading
/// dimension is padded 16 past a multiple of 16, and 16 more where that is a power of two:
/// rows 2ⁿ floats apart would share a handful of L1 sets and evict each other.
pub(super) struct Head {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    ld: usize,
}

impl Head {
    /// `rows × cols` zeros, the leading dimension padded.
    pub fn zeros(rows: usize, cols: usize) -> Head {
        let ld = ferrotron_config::attention_head_ld(cols);
        Head {
            data: vec![0.0f32; rows * ld],
            rows,
            cols,
            ld,
        }
    }

    /// Overwrites every row with `src`'s: row `r` from `src[r·ld..]`.
    pub fn gather(&mut self, src: &[f32], ld: usize) {
        let c = self.cols;
        debug_assert!(
            self.rows == 0 || (self.rows - 1) * ld + c <= src.len(),
            "gather source"
        );
        let rows = self.data.chunks_exact_mut(self.ld).zip(src.chunks(ld));
        for (dst, row) in rows.take(self.rows) {
            dst[..c].copy_from_slice(&row[..c]);
        }
    }

    /// Overwrites the matrix with the transpose of `src`'s first `cols` rows (`rows` columns
    /// each, row `j` from `src[j·ld..]`). The columns past `cols` stay zero, so a product may
    /// round its columns up to 16.
    pub fn transpose(&mut self, src: &[f32], ld: usize) {
        let b = Block {
            rows: self.cols,
            cols: self.rows,
            sld: ld,
            dld: self.ld,
        };
        transpose_block(&mut self.data, src, b);
    }

    /// Rows from `r0` on.
    pub fn row(&self, r0: usize) -> Operand<'_> {
        self.rows().row(r0)
    }

    /// Columns (of a gathered head: its head dimension).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of its buffer.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        4 * self.data.len()
    }

    /// Every row.
    pub fn rows(&self) -> Rows<'_> {
        Rows::new(&self.data, self.ld)
    }

    /// Columns from `c0` on (of a transposed head: the keys from `c0` on).
    pub fn col(&self, c0: usize) -> Operand<'_> {
        Operand::rows(&self.data[c0..], self.ld)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    /// A product's operands as raw pointers (see [`super::product`] for the layouts).
    pub(super) struct Raw {
        /// `C`'s first element.
        pub c: *mut f32,
        /// `C`'s leading dimension.
        pub ldc: usize,
        /// Add to `C` rather than overwrite it.
        pub accumulate: bool,
        /// `A`'s first element.
        pub a: *const f32,
        /// `A`'s stride between rows.
        pub ars: usize,
        /// `A`'s stride between columns (depth).
        pub acs: usize,
        /// `B`'s first element (row-major).
        pub b: *const f32,
        /// `B`'s leading dimension.
        pub ldb: usize,
        /// Depth.
        pub k: usize,
    }

    /// Column panels of 16 (then one of 8), each over every block of 6 rows (then the rest).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `n` is a multiple of 8; every `m × n`, `m × k`, `k × n`
    /// element addressed through `r` is valid, and `c` aliases neither input.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn product(m: usize, n: usize, r: &Raw) {
        let mut j = 0;
        while j + 16 <= n {
            panel::<2>(m, j, r);
            j += 16;
        }
        if j < n {
            panel::<1>(m, j, r);
        }
    }

    /// [`panel`] of one register: the 8 columns of `C` from `j` on.
    ///
    /// # Safety
    /// As [`product`], for those columns.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panel8(m: usize, j: usize, r: &Raw) {
        panel::<1>(m, j, r)
    }

    /// The `8·NV` columns of `C` from `j` on, over all `m` rows: blocks of 6, then the rest.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn panel<const NV: usize>(m: usize, j: usize, r: &Raw) {
        let mut i = 0;
        while i + 6 <= m {
            block::<6, NV>(i, j, r);
            i += 6;
        }
        match m - i {
            5 => block::<5, NV>(i, j, r),
            4 => block::<4, NV>(i, j, r),
            3 => block::<3, NV>(i, j, r),
            2 => block::<2, NV>(i, j, r),
            1 => block::<1, NV>(i, j, r),
            _ => {}
        }
    }

    /// `C[i.., j..][MR × 8·NV] (+)= A[i.., ..] · B[.., j..]`, the block of `C` in registers
    /// over the whole depth.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn block<const MR: usize, const NV: usize>(i: usize, j: usize, r: &Raw) {
        let c = r.c.add(i * r.ldc + j);
        let mut t = [[_mm256_setzero_ps(); NV]; MR];
        if r.accumulate {
            for (x, row) in t.iter_mut().enumerate() {
                for (v, reg) in row.iter_mut().enumerate() {
                    *reg = _mm256_loadu_ps(c.add(x * r.ldc + v * 8));
                }
            }
        }
        let (mut a, mut b) = (r.a.add(i * r.ars), r.b.add(j));
        for _ in 0..r.k {
            let mut bv = [_mm256_setzero_ps(); NV];
            for (v, reg) in bv.iter_mut().enumerate() {
                *reg = _mm256_loadu_ps(b.add(v * 8));
            }
            for (x, row) in t.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*a.add(x * r.ars));
                for (reg, &bq) in row.iter_mut().zip(&bv) {
                    *reg = _mm256_fmadd_ps(av, bq, *reg);
                }
            }
            // Wrapping: past the last step these point beyond the operands, never read.
            a = a.wrapping_add(r.acs);
            b = b.wrapping_add(r.ldb);
        }
        for (x, row) in t.iter().enumerate() {
            for (v, reg) in row.iter().enumerate() {
                _mm256_storeu_ps(c.add(x * r.ldc + v * 8), *reg);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, f: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * f).sin()).collect()
    }

    /// Every shape class the tiles use (row-major and transposed `A`, block and tail rows,
    /// panels of 16 and 8, overwrite and accumulate) against a plain triple loop.
    #[test]
    fn products_match_a_plain_loop_on_both_kernels() {
        let (ld_a, ld_b, ld_c) = (150, 140, 136);
        let (a, b) = (data(150 * 150, 0.37), data(140 * 140, 0.71));
        for kernel in [Kernel::Gemm, Kernel::Fma, Kernel::Fma512] {
            // Every row tail of both kernels' blocks (m = 1..=13) over panels of 32, 16 and 8.
            let tails = (1..=13).map(|m| (m, 56, 9));
            let shapes = [
                (32, 128, 64),
                (13, 40, 7),
                (1, 8, 1),
                (6, 16, 33),
                (128, 64, 32),
                (12, 32, 5),
            ];
            for (m, n, k) in shapes.into_iter().chain(tails) {
                for transposed in [false, true] {
                    for accumulate in [false, true] {
                        let lhs = if transposed {
                            Operand::transposed(&a, ld_a)
                        } else {
                            Operand::rows(&a, ld_a)
                        };
                        let mut c = data(m * ld_c, 0.13);
                        let mut want = c.clone();
                        for i in 0..m {
                            for j in 0..n {
                                let dot: f64 = (0..k)
                                    .map(|p| {
                                        (lhs.data[i * lhs.rs + p * lhs.cs] * b[p * ld_b + j]) as f64
                                    })
                                    .sum();
                                let base = if accumulate {
                                    want[i * ld_c + j] as f64
                                } else {
                                    0.0
                                };
                                want[i * ld_c + j] = (base + dot) as f32;
                            }
                        }
                        let out = Out {
                            data: &mut c,
                            ld: ld_c,
                            accumulate,
                        };
                        product(kernel, (m, n, k), out, lhs, Operand::rows(&b, ld_b));
                        let err = c
                            .iter()
                            .zip(&want)
                            .map(|(x, y)| (x - y).abs())
                            .fold(0.0, f32::max);
                        let what = format!("{kernel:?} {m}×{n}×{k} transposed {transposed}");
                        assert!(err < 2e-5, "{what} accumulate {accumulate}: {err}");
                    }
                }
            }
        }
    }

    #[test]
    fn heads_gather_and_transpose() {
        let (len, ld, d) = (21, 12, 3);
        let src = data(len * ld, 0.5);
        let (mut t, mut g) = (Head::zeros(d, len), Head::zeros(len, d));
        t.transpose(&src[2..], ld);
        g.gather(&src[2..], ld);
        assert_eq!((t.ld, g.ld), (48, 48)); // 32 would be a power of two
        for p in 0..d {
            for j in 0..32 {
                let want = if j < len { src[2 + j * ld + p] } else { 0.0 };
                assert_eq!(t.data[p * t.ld + j], want, "transposed ({p}, {j})");
                if j < len {
                    assert_eq!(g.data[j * g.ld + p], want, "gathered ({j}, {p})");
                }
            }
        }
    }

    #[test]
    fn a_view_past_its_slice_is_refused() {
        let (a, b) = (vec![1.0f32; 63], vec![1.0f32; 64]);
        let mut c = vec![0.0f32; 64];
        let out = Out {
            data: &mut c,
            ld: 8,
            accumulate: false,
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            product(
                Kernel::Fma,
                (8, 8, 8),
                out,
                Operand::rows(&a, 8),
                Operand::rows(&b, 8),
            )
        }));
        assert!(r.is_err());
    }
}
