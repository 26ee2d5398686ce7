//! The transposition of a strided block of `f32`, eight by eight in AVX registers where the
//! CPU has AVX (eight loads, twenty-four shuffles, eight stores), element by element
//! elsewhere and at the block's edges. A copy: the same bits either way.

/// A block to transpose: `dst[c·dld + r] = src[r·sld + c]` for `r < rows`, `c < cols`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Block {
    /// Rows of the source (columns of the destination).
    pub rows: usize,
    /// Columns of the source (rows of the destination).
    pub cols: usize,
    /// Element stride between the source's rows.
    pub sld: usize,
    /// Element stride between the destination's rows.
    pub dld: usize,
}

impl Block {
    /// Whether a slice of `len` elements holds every source element (`sld`, `rows`, `cols`)
    /// or, with `ld = dld` and the sides swapped, every destination element.
    fn fits(len: usize, ld: usize, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1).saturating_mul(ld).saturating_add(cols) <= len
    }
}

/// Transposes `b` from `src` into `dst` (see [`Block`]).
///
/// Panics when either slice is too short for the block.
pub(crate) fn transpose_block(dst: &mut [f32], src: &[f32], b: Block) {
    assert!(
        Block::fits(src.len(), b.sld, b.rows, b.cols)
            && Block::fits(dst.len(), b.dld, b.cols, b.rows),
        "transpose of a {} × {} block past its slices",
        b.rows,
        b.cols
    );
    // SAFETY: both slices hold the block (asserted above); `dst` is a distinct `&mut`.
    unsafe { transpose_raw(dst.as_mut_ptr(), src.as_ptr(), b) }
}

/// [`transpose_block`] through raw pointers, for destinations not yet initialised.
///
/// # Safety
/// `src` must be readable at every `r·sld + c` and `dst` writable at every `c·dld + r`
/// (`r < rows`, `c < cols`), and the two must not overlap.
pub(crate) unsafe fn transpose_raw(dst: *mut f32, src: *const f32, b: Block) {
    let (full_r, full_c) = (b.rows / 8 * 8, b.cols / 8 * 8);
    #[cfg(target_arch = "x86_64")]
    let tiles = std::arch::is_x86_feature_detected!("avx");
    #[cfg(not(target_arch = "x86_64"))]
    let tiles = false;
    let (tr, tc) = if tiles { (full_r, full_c) } else { (0, 0) };
    #[cfg(target_arch = "x86_64")]
    for r0 in (0..tr).step_by(8) {
        for c0 in (0..tc).step_by(8) {
            // SAFETY: the 8 × 8 tile at (r0, c0) lies inside the block; AVX detected above.
            unsafe {
                avx::tile(
                    dst.add(c0 * b.dld + r0),
                    b.dld,
                    src.add(r0 * b.sld + c0),
                    b.sld,
                )
            };
        }
    }
    // Everything outside the tiles: the columns past `tc` of the tiled rows, then the rows
    // past `tr`.
    let scalar = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>| {
        for r in rows {
            for c in cols.clone() {
                // SAFETY: (r, c) lies inside the block (the caller's contract).
                unsafe { *dst.add(c * b.dld + r) = *src.add(r * b.sld + c) };
            }
        }
    };
    scalar(0..tr, tc..b.cols);
    scalar(tr..b.rows, 0..b.cols);
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    /// One 8 × 8 tile: rows of `src` (stride `sld`) to columns of `dst` (stride `dld`).
    ///
    /// # Safety
    /// The CPU has AVX; eight rows of eight floats are readable from `src` and writable at
    /// `dst` with those strides.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn tile(dst: *mut f32, dld: usize, src: *const f32, sld: usize) {
        unsafe {
            let r = |i: usize| _mm256_loadu_ps(src.add(i * sld));
            let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
            let (r4, r5, r6, r7) = (r(4), r(5), r(6), r(7));
            // Pairs of rows interleaved, then pairs of pairs: each 128-bit lane then holds
            // four rows of one column.
            let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
            let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
            let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
            let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
            let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let w = |i: usize, x: __m256| _mm256_storeu_ps(dst.add(i * dld), x);
            w(0, _mm256_permute2f128_ps::<0x20>(s0, s4));
            w(1, _mm256_permute2f128_ps::<0x20>(s1, s5));
            w(2, _mm256_permute2f128_ps::<0x20>(s2, s6));
            w(3, _mm256_permute2f128_ps::<0x20>(s3, s7));
            w(4, _mm256_permute2f128_ps::<0x31>(s0, s4));
            w(5, _mm256_permute2f128_ps::<0x31>(s1, s5));
            w(6, _mm256_permute2f128_ps::<0x31>(s2, s6));
            w(7, _mm256_permute2f128_ps::<0x31>(s3, s7));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape from 1 × 1 to 19 × 19 (tiles, edges and both together) with padded
    /// strides: each destination element is its source element, and the padding untouched.
    #[test]
    fn blocks_match_element_by_element() {
        for rows in 1..20 {
            for cols in 1..20 {
                let (sld, dld) = (cols + 3, rows + 5);
                let src: Vec<f32> = (0..rows * sld).map(|i| i as f32 * 0.5 - 7.0).collect();
                let mut dst = vec![f32::NAN; cols * dld];
                let b = Block {
                    rows,
                    cols,
                    sld,
                    dld,
                };
                transpose_block(&mut dst, &src, b);
                for c in 0..cols {
                    for r in 0..dld {
                        let got = dst[c * dld + r];
                        if r < rows {
                            assert_eq!(got, src[r * sld + c], "{rows}×{cols} at ({r}, {c})");
                        } else {
                            assert!(got.is_nan(), "{rows}×{cols}: padding ({r}, {c}) written");
                        }
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "past its slices")]
    fn short_destination_refused() {
        let b = Block {
            rows: 8,
            cols: 8,
            sld: 8,
            dld: 8,
        };
        transpose_block(&mut [0.0; 63], &[0.0; 64], b);
    }
}
