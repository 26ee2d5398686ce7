//! OpenBLAS's `cblas_sgemm`, loaded at run time, for the linear layers' products on the host
//! (`train.matmul = "openblas"`).
//!
//! Nothing links against it: [`OpenBlas::load`] opens `libopenblas.so.0` when a run asks for
//! it, so the default build and its tests need no BLAS. The library must be a pthreads build
//! (`openblas_get_parallel() == 1`, Debian's `libopenblas0-pthread`) with 32-bit integers:
//! its allocator then takes a lock, so the compute threads may call it at once; single-threaded
//! and OpenMP builds give no such guarantee and are refused, as are 64-bit-integer builds. Its own threads are set to one, once, when it is loaded: the
//! engine splits each product over its rayon pool itself, so OpenBLAS never starts a second
//! set of threads next to the pool.
//!
//! Memory: OpenBLAS packs its operands into a buffer per calling thread that it keeps for the
//! life of the process. Every call the engine makes is at most [`BLAS_BLOCK`] rows, columns
//! and depth, so what a thread's buffer ever holds is bounded by
//! [`BLAS_SCRATCH_PER_THREAD`], which the ledger and the estimator count per compute thread
//! (measured in `crates/tensor/tests/openblas.rs`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

pub use ferrotron_config::{BLAS_BLOCK, BLAS_SCRATCH_PER_THREAD};
use rayon::prelude::*;

use crate::shared::Shared;

/// `cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`.
type Sgemm = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    f32,
    *const f32,
    c_int,
    *const f32,
    c_int,
    f32,
    *mut f32,
    c_int,
);

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

/// Where [`OpenBlas::load`] looks, in order: the dynamic loader's choice, then Debian's
/// threaded build by its path (when the loader's choice is another flavour).
const CANDIDATES: [&CStr; 3] = [
    c"libopenblas.so.0",
    c"/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    c"/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
];

/// Why OpenBLAS could not be used.
#[derive(Debug, thiserror::Error)]
pub enum BlasError {
    /// No candidate library could be opened.
    #[error("train.matmul = \"openblas\": no threaded OpenBLAS found ({0}); install it (Debian/Ubuntu: `apt-get install libopenblas0-pthread`) or set train.matmul = \"gemm\"")]
    NotFound(String),
    /// The library lacks a symbol the engine calls.
    #[error("train.matmul = \"openblas\": {0} has no `{1}`; install OpenBLAS ≥ 0.3 or set train.matmul = \"gemm\"")]
    Symbol(String, &'static str),
    /// `train.matmul = "bf16"` on a CPU without AVX-512 BF16.
    #[error("train.matmul = \"bf16\" needs a CPU with AVX-512 BF16 (`avx512_bf16` in /proc/cpuinfo), which this one lacks; set train.matmul = \"gemm\"")]
    NoBf16,
}

/// A loaded OpenBLAS: its `cblas_sgemm` and what it says of itself.
pub struct OpenBlas {
    sgemm: Sgemm,
    description: String,
}

impl std::fmt::Debug for OpenBlas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpenBlas({})", self.description)
    }
}

/// `dlsym(handle, name)`, or `None`.
fn symbol(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `handle` is a live handle from `dlopen` and `name` a NUL-terminated string.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// A C string returned by the library, copied.
fn c_string(handle: *mut c_void, name: &CStr) -> Option<String> {
    let f = symbol(handle, name)?;
    // SAFETY: OpenBLAS's `openblas_get_config` / `openblas_get_corename` take nothing and
    // return a static NUL-terminated string.
    let s = unsafe {
        let f: unsafe extern "C" fn() -> *const c_char = std::mem::transmute(f);
        f()
    };
    // SAFETY: non-null, NUL-terminated, static (checked for null first).
    (!s.is_null()).then(|| unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
}

impl OpenBlas {
    /// Opens the first threaded OpenBLAS found (`libopenblas.so.0` through the dynamic loader,
    /// then Debian's `openblas-pthread` directory) and sets its threads to one. The
    /// library stays loaded for the rest of the process (OpenBLAS does not support unloading).
    pub fn load() -> Result<Arc<OpenBlas>, BlasError> {
        let mut tried = Vec::new();
        for path in CANDIDATES {
            // SAFETY: `path` is NUL-terminated; loading runs the library's initialisers.
            let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            let name = path.to_string_lossy().into_owned();
            if handle.is_null() {
                tried.push(format!("{name}: not found"));
                continue;
            }
            let parallel = symbol(handle, c"openblas_get_parallel").map(|f| {
                // SAFETY: `int openblas_get_parallel(void)`.
                unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(f)() }
            });
            // 1: pthreads. 0 (single-threaded) and 2 (OpenMP) builds do not promise a locked
            // allocator for callers on several threads.
            if parallel != Some(1) {
                tried.push(format!("{name}: not a pthreads build ({parallel:?})"));
                continue;
            }
            let config = c_string(handle, c"openblas_get_config").unwrap_or_default();
            if config.contains("USE64BITINT") {
                tried.push(format!("{name}: built with 64-bit integers"));
                continue;
            }
            let sgemm = symbol(handle, c"cblas_sgemm")
                .ok_or_else(|| BlasError::Symbol(name.clone(), "cblas_sgemm"))?;
            let set_threads = symbol(handle, c"openblas_set_num_threads")
                .ok_or_else(|| BlasError::Symbol(name.clone(), "openblas_set_num_threads"))?;
            let get_threads = symbol(handle, c"openblas_get_num_threads")
                .ok_or_else(|| BlasError::Symbol(name.clone(), "openblas_get_num_threads"))?;
            // SAFETY: the symbols have these C signatures in every OpenBLAS. The thread count
            // is only set when it is not already one, so loading again (to describe the
            // library) never touches it while other threads multiply.
            let sgemm = unsafe {
                let get: unsafe extern "C" fn() -> c_int = std::mem::transmute(get_threads);
                if get() != 1 {
                    let set: unsafe extern "C" fn(c_int) = std::mem::transmute(set_threads);
                    set(1);
                }
                std::mem::transmute::<*mut c_void, Sgemm>(sgemm)
            };
            let core = c_string(handle, c"openblas_get_corename").unwrap_or_default();
            return Ok(Arc::new(OpenBlas {
                sgemm,
                description: format!("{config} (core {core}, {name})"),
            }));
        }
        Err(BlasError::NotFound(tried.join("; ")))
    }

    /// The library's configuration string, core and path.
    pub fn describe(&self) -> &str {
        &self.description
    }

    /// `c[m×n] = op(a)·op(b) + beta·c`, row-major, `op` transposing when `ta`/`tb`: `a` is
    /// `m×k` (`k×m` when transposed) with leading dimension `lda`, `b` is `k×n` (`n×k`), `c`
    /// has leading dimension `ldc`. Rows of `c` are split over the current rayon pool when
    /// `pool`, and every call into the library is at most [`BLAS_BLOCK`] in each dimension.
    pub fn gemm(&self, op: BlasOp, a: &[f32], b: &[f32], beta: f32, c: &mut [f32], pool: bool) {
        let BlasOp { m, n, k, .. } = op;
        if m == 0 || n == 0 {
            return;
        }
        op.check(a.len(), b.len(), c.len());
        if k == 0 {
            // No products: `c = beta·c`, without forming pointers into empty operands.
            if beta != 1.0 {
                for row in c.chunks_mut(op.ldc).take(m) {
                    row[..n]
                        .iter_mut()
                        .for_each(|x| *x = if beta == 0.0 { 0.0 } else { beta * *x });
                }
            }
            return;
        }
        let parts = if pool && m * n * k >= 32 * 32 * 32 {
            rayon::current_num_threads().min(m.div_ceil(16)).max(1)
        } else {
            1
        };
        let rows = m.div_ceil(parts).next_multiple_of(16).min(m);
        let c = Shared(c.as_mut_ptr());
        (0..m.div_ceil(rows)).into_par_iter().for_each(|part| {
            let m0 = part * rows;
            // Each part writes rows m0..m0 + rows of `c` only: disjoint between parts.
            self.blocked(op, m0..(m0 + rows).min(m), (a, b, c), beta);
        });
    }

    /// Rows `rows` of the product, in blocks of at most [`BLAS_BLOCK`] on every side.
    fn blocked(&self, op: BlasOp, rows: std::ops::Range<usize>, abc: Operands<'_>, beta: f32) {
        let (a, b, c) = abc;
        let c = c.0;
        for m0 in rows.clone().step_by(BLAS_BLOCK) {
            let mb = BLAS_BLOCK.min(rows.end - m0);
            for n0 in (0..op.n).step_by(BLAS_BLOCK) {
                let nb = BLAS_BLOCK.min(op.n - n0);
                for k0 in (0..op.k).step_by(BLAS_BLOCK) {
                    let kb = BLAS_BLOCK.min(op.k - k0);
                    let a_off = if op.ta {
                        k0 * op.lda + m0
                    } else {
                        m0 * op.lda + k0
                    };
                    let b_off = if op.tb {
                        n0 * op.ldb + k0
                    } else {
                        k0 * op.ldb + n0
                    };
                    let c_off = m0 * op.ldc + n0;
                    let beta = if k0 == 0 { beta } else { 1.0 };
                    // SAFETY: `check` proved every element of the whole product inside the
                    // slices, and this block is part of it.
                    unsafe {
                        (self.sgemm)(
                            ROW_MAJOR,
                            if op.ta { TRANS } else { NO_TRANS },
                            if op.tb { TRANS } else { NO_TRANS },
                            mb as c_int,
                            nb as c_int,
                            kb as c_int,
                            1.0,
                            a.as_ptr().add(a_off),
                            op.lda as c_int,
                            b.as_ptr().add(b_off),
                            op.ldb as c_int,
                            beta,
                            c.add(c_off),
                            op.ldc as c_int,
                        )
                    }
                }
            }
        }
    }
}

/// The three operands of one product (the result as a pointer shared by the row parts).
type Operands<'a> = (&'a [f32], &'a [f32], Shared);

/// The shape and layout of one product for [`OpenBlas::gemm`].
#[derive(Debug, Clone, Copy)]
pub struct BlasOp {
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// Depth.
    pub k: usize,
    /// `a` is stored `k×m` (the product uses its transpose).
    pub ta: bool,
    /// `b` is stored `n×k`.
    pub tb: bool,
    /// Leading dimension of `a`.
    pub lda: usize,
    /// Leading dimension of `b`.
    pub ldb: usize,
    /// Leading dimension of `c`.
    pub ldc: usize,
}

impl BlasOp {
    /// Every element the product reads or writes lies inside the slices, and every
    /// dimension fits the library's 32-bit integers: checked before any raw pointer is
    /// formed.
    fn check(&self, a: usize, b: usize, c: usize) {
        let (ar, ac) = if self.ta {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (br, bc) = if self.tb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        let last =
            |r: usize, cols: usize, ld: usize| (r > 0 && cols > 0).then(|| (r - 1) * ld + cols);
        assert!(
            ac <= self.lda && bc <= self.ldb && self.n <= self.ldc,
            "leading dimensions"
        );
        assert!(last(ar, ac, self.lda).is_none_or(|l| l <= a), "a too short");
        assert!(last(br, bc, self.ldb).is_none_or(|l| l <= b), "b too short");
        assert!(
            last(self.m, self.n, self.ldc).is_none_or(|l| l <= c),
            "c too short"
        );
        assert!(
            [self.lda, self.ldb, self.ldc]
                .iter()
                .all(|&d| d <= c_int::MAX as usize),
            "a leading dimension over 2³¹"
        );
    }
}
