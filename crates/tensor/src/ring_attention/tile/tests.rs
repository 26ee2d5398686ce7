//! The tile kernel against an f64 reference on every instruction set this CPU has.

use super::*;

type Path = unsafe fn(Dst<'_>, Src<'_>, Src<'_>, usize, &mut Pack);

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
    let at =
        |s: Src<'_>, i: usize, j: usize| s.data[i * s.at.rs as usize + j * s.at.cs as usize] as f64;
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
                // Row-major right operands 16 apart beyond their width: read in place where
                // the width is whole vectors, as a key tile or a block of values is.
                let (a, b) = (data(m * k + 3, 0.37), data(k * (n + 16) + 5, 0.71));
                let la = if lt { Mat::transposed(m) } else { Mat::rows(k) };
                let ra = if rt {
                    Mat::transposed(k)
                } else {
                    Mat::rows(n + 16)
                };
                let (lhs, rhs) = (Src { data: &a, at: la }, Src { data: &b, at: ra });
                let want = reference(m, n, k, lhs, rhs);
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
                    unsafe { path(dst, lhs, rhs, k, &mut Pack::default()) };
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

#[test]
fn a_transposed_tile_is_scaled_zero_padded_and_read_in_place() {
    // 5 rows of d = 3 at a leading dimension of 7, into a tile 16 wide.
    let (d, ld, rows, width) = (3, 7, 5, 16);
    let src = data(rows * ld, 0.3);
    let mut t = Transposed::default();
    t.pack(&src, ld, rows, d, width, 0.5);
    let got = t.get();
    assert_eq!(got.data.len(), d * width);
    for c in 0..d {
        for j in 0..width {
            let want = if j < rows { 0.5 * src[j * ld + c] } else { 0.0 };
            assert_eq!(got.data[c * width + j], want, "({c}, {j})");
        }
    }
    // Packing a shorter tile into the same workspace leaves no stale column behind.
    t.pack(&src, ld, 2, d, width, 1.0);
    assert!((0..d).all(|c| t.get().data[c * width + 2..(c + 1) * width]
        .iter()
        .all(|&x| x == 0.0)));
    // As a right operand: [1 × d] · [d × width] is row 0 of (scale · src)ᵀ's columns.
    let a = [1.0f32, 2.0, 3.0];
    let mut out = vec![f32::NAN; width];
    product(
        Dst::new(&mut out, width, 1, width, false),
        Src::rows(&a, d),
        t.get(),
        d,
        &mut Pack::default(),
    );
    for (j, &o) in out.iter().enumerate() {
        let want: f32 = if j < 2 {
            (0..d).map(|c| a[c] * src[j * ld + c]).sum()
        } else {
            0.0
        };
        assert!((o - want).abs() < 1e-6, "column {j}: {o} vs {want}");
    }
}

#[test]
#[should_panic(expected = "rows in a tile of")]
fn a_tile_longer_than_its_width_is_refused() {
    Transposed::default().pack(&[0.0; 40], 2, 20, 2, 16, 1.0);
}
