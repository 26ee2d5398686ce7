//! GEMMs through cuBLASLt: the three products of a linear layer, row-major as the CPU
//! backend's `linear.rs` defines them, in cuBLASLt's column-major terms.
//!
//! A row-major `[r, c]` matrix is a column-major `[c, r]` one, so
//! - forward `y[t×out] = x[t×in]·Wᵀ` is `yᵀ = op(W_cm)ᵀ·x_cm`: `C[out×t] = Aᵀ·B` with
//!   `A = W` (`in×out`, transposed) and `B = x` (`in×t`);
//! - input gradient `dx[t×in] (+)= dy[t×out]·W` is `C[in×t] = A·B` with `A = W` (`in×out`)
//!   and `B = dy` (`out×t`);
//! - weight gradient `dW[out×in] += dyᵀ·x` is `C[in×out] = A·Bᵀ` with `A = x` (`in×t`) and
//!   `B = dy` (`out×t`, transposed).
//!
//! f32 everywhere with f32 accumulation; TF32 tensor cores only when the run allows them. With
//! bf16 products (`train.matmul = "bf16"`), `A` and `B` are bf16 copies the backend rounds
//! (to nearest even) into its scratch, `C` and the sums stay f32: the CPU's bf16 products.
//! Descriptors and the heuristic's algorithm are made once per shape and kept.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{result, sys};
use cudarc::driver::CudaStream;

use crate::gpu::{loaded, GpuError};
use crate::memory::{CudaMemory, DeviceVec};
use crate::score_attention::{ColumnLayout, ColumnMajor};

/// The cuBLASLt workspace of a rank, in bytes (what cuBLASLt recommends for Hopper).
pub const WORKSPACE: usize = 32 << 20;

/// One column-major product `C[m×n] = β·C + op(A)·op(B)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gemm {
    /// `A` is transposed.
    pub ta: bool,
    /// `B` is transposed.
    pub tb: bool,
    /// Rows of `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `A` and `B` are bf16 (rounded by the caller); `C` stays f32, the sums f32.
    pub bf16: bool,
}

impl Gemm {
    /// The forward product of a linear layer (see the module's docs).
    pub fn forward(t: usize, d_in: usize, d_out: usize) -> Gemm {
        Gemm {
            ta: true,
            tb: false,
            m: d_out,
            n: t,
            k: d_in,
            bf16: false,
        }
    }
    /// The input-gradient product.
    pub fn backward_input(t: usize, d_in: usize, d_out: usize) -> Gemm {
        Gemm {
            ta: false,
            tb: false,
            m: d_in,
            n: t,
            k: d_out,
            bf16: false,
        }
    }
    /// The weight-gradient product.
    pub fn backward_weight(t: usize, d_in: usize, d_out: usize) -> Gemm {
        Gemm {
            ta: false,
            tb: true,
            m: d_in,
            n: d_out,
            k: t,
            bf16: false,
        }
    }
    /// The same product on operands rounded to bf16.
    pub fn in_bf16(self) -> Gemm {
        Gemm { bf16: true, ..self }
    }
    /// (rows, columns) of `A` and `B` as stored (column-major, densely: `ld` = rows).
    fn stored(&self) -> [(usize, usize); 2] {
        let a = if self.ta {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let b = if self.tb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [a, b]
    }
}

/// What a plan is made for: the call's transposes and shape, each operand's stored layout
/// and batch, the operands' type, and the alignment (bytes) the algorithm may assume of
/// `A`, `B` and `C`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    call: ColumnMajor,
    bf16: bool,
    align: [u32; 3],
}

impl PlanKey {
    /// A single dense product at 256-byte aligned addresses (cuBLASLt's default assumption).
    fn dense(g: Gemm) -> PlanKey {
        let [a, b] = g.stored();
        let dense = |(rows, cols): (usize, usize)| ColumnLayout {
            rows,
            cols,
            ld: rows,
            stride: 0,
        };
        PlanKey {
            call: ColumnMajor {
                ta: g.ta,
                tb: g.tb,
                m: g.m,
                n: g.n,
                k: g.k,
                a: dense(a),
                b: dense(b),
                c: dense((g.m, g.n)),
                count: 1,
            },
            bf16: g.bf16,
            align: [256; 3],
        }
    }
}

/// The largest power of two (at most 256) that divides a device address.
fn alignment(address: u64) -> u32 {
    1u32 << address.trailing_zeros().min(8)
}

/// The alignment every matrix of a batched operand keeps: its first address, its column
/// pitch and (with more than one matrix) its batch stride, in bytes of f32.
fn operand_alignment(address: u64, l: ColumnLayout, count: usize) -> u32 {
    let pitch = alignment(4 * l.ld as u64);
    let stride = match count {
        0 | 1 => 256,
        _ => alignment(4 * l.stride as u64),
    };
    alignment(address).min(pitch).min(stride)
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// A rank's cuBLASLt handle, workspace and plans.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceVec,
    tf32: bool,
    plans: Mutex<HashMap<PlanKey, Plan>>,
}

// SAFETY: the handle and plans are used under the `plans` lock only, and cuBLASLt handles may
// be used from any thread.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

fn check_driver(r: Result<(), cudarc::driver::DriverError>) {
    r.unwrap_or_else(|e| panic!("CUDA context binding failed: {e}"))
}

fn check<T>(what: &str, r: Result<T, result::CublasError>) -> T {
    r.unwrap_or_else(|e| panic!("cuBLASLt {what} failed: {e:?}"))
}

impl Blas {
    /// A handle with its workspace in `memory`; `tf32` allows TF32 tensor cores.
    pub fn new(memory: &Arc<CudaMemory>, tf32: bool) -> Result<Blas, GpuError> {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::Blas(
                "libcublasLt.so is not on the loader's path".into(),
            ));
        }
        let handle = loaded(result::create_handle).map_err(GpuError::Blas)?;
        Ok(Blas {
            handle,
            workspace: DeviceVec::zeros(memory, WORKSPACE),
            tf32,
            plans: Mutex::new(HashMap::new()),
        })
    }

    fn plan(&self, key: PlanKey) -> Plan {
        let g = key.call;
        let compute = if self.tf32 && !key.bf16 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let f32t = sys::cudaDataType_t::CUDA_R_32F;
        let desc = check("descriptor", result::create_matmul_desc(compute, f32t));
        use sys::cublasLtMatmulDescAttributes_t as Desc;
        for (attr, t) in [
            (Desc::CUBLASLT_MATMUL_DESC_TRANSA, g.ta),
            (Desc::CUBLASLT_MATMUL_DESC_TRANSB, g.tb),
        ] {
            let op = t as i32;
            // SAFETY: a live descriptor and a 4-byte value.
            check("transpose", unsafe {
                result::set_matmul_desc_attribute(desc, attr, (&op as *const i32).cast(), 4)
            });
        }
        let operands = match key.bf16 {
            true => sys::cudaDataType_t::CUDA_R_16BF,
            false => f32t,
        };
        let layouts = [
            layout(operands, g.a, g.count),
            layout(operands, g.b, g.count),
            layout(f32t, g.c, g.count),
        ];
        let algo = self.heuristic(desc, layouts, key);
        Plan {
            desc,
            layouts,
            algo,
        }
    }

    /// cuBLASLt's first algorithm for the plan, within our workspace and at the alignments
    /// the key gives.
    fn heuristic(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        [la, lb, lc]: [sys::cublasLtMatrixLayout_t; 3],
        key: PlanKey,
    ) -> sys::cublasLtMatmulAlgo_t {
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let pref = check("preference", result::create_matmul_pref());
        let ws = WORKSPACE as u64;
        let [aa, ab, ac] = key.align;
        // SAFETY: live handles and descriptors made by the caller; each value has the size
        // the attribute takes (u64 workspace, u32 alignments).
        unsafe {
            let set = |attr, value: *const c_void, size| {
                check(
                    "preference",
                    result::set_matmul_pref_attribute(pref, attr, value, size),
                )
            };
            set(
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            );
            for (attr, v) in [
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac),
            ] {
                set(attr, (v as *const u32).cast(), 4);
            }
            let h = result::get_matmul_algo_heuristic(self.handle, desc, la, lb, lc, lc, pref);
            check("preference", result::destroy_matmul_pref(pref));
            h.unwrap_or_else(|e| panic!("cuBLASLt has no algorithm for {key:?}: {e:?}"))
                .algo
        }
    }

    /// `C = β·C + op(A)·op(B)` on `stream`, with `a`, `b`, `c` device addresses.
    pub fn run(&self, stream: &CudaStream, g: Gemm, a: u64, b: u64, c: u64, beta: f32) {
        if g.m == 0 || g.n == 0 {
            return;
        }
        self.call(stream, PlanKey::dense(g), [a, b, c], 1.0, beta);
    }

    /// The strided batch `g` (column-major, see [`ColumnMajor`]) on `stream`:
    /// `C_i = β·C_i + α·op(A_i)·op(B_i)` with `a`, `b`, `c` the device addresses of the first
    /// matrices. f32 operands (TF32 products where the run allows them).
    pub fn run_batched(
        &self,
        stream: &CudaStream,
        g: ColumnMajor,
        abc: [u64; 3],
        alpha: f32,
        beta: f32,
    ) {
        if g.m == 0 || g.n == 0 || g.count == 0 {
            return;
        }
        let key = PlanKey {
            call: g,
            bf16: false,
            align: [
                operand_alignment(abc[0], g.a, g.count),
                operand_alignment(abc[1], g.b, g.count),
                operand_alignment(abc[2], g.c, g.count),
            ],
        };
        self.call(stream, key, abc, alpha, beta);
    }

    fn call(&self, stream: &CudaStream, key: PlanKey, [a, b, c]: [u64; 3], alpha: f32, beta: f32) {
        check_driver(stream.context().bind_to_thread());
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let p = plans.entry(key).or_insert_with(|| self.plan(key));
        let [la, lb, lc] = p.layouts;
        let ptr = |x: u64| x as *const c_void;
        // SAFETY: the addresses hold the stored matrices (the backend's callers give slices
        // of the right lengths); the workspace is ours; the plan matches the shapes and the
        // addresses' alignment.
        check("matmul", unsafe {
            result::matmul(
                self.handle,
                p.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                ptr(a),
                la,
                ptr(b),
                lb,
                ptr(c),
                lc,
                c as *mut c_void,
                lc,
                &p.algo,
                self.workspace.ptr() as *mut c_void,
                WORKSPACE,
                stream.cu_stream() as sys::cudaStream_t,
            )
        });
    }
}

/// A column-major layout of `ty` elements; a batch of `count` with its stride when more
/// than one.
fn layout(ty: sys::cudaDataType_t, l: ColumnLayout, count: usize) -> sys::cublasLtMatrixLayout_t {
    let made = check(
        "layout",
        result::create_matrix_layout(ty, l.rows as u64, l.cols as u64, l.ld as i64),
    );
    if count > 1 {
        use sys::cublasLtMatrixLayoutAttribute_t as Attr;
        let (n, stride) = (count as i32, l.stride as i64);
        // SAFETY: a live layout; an i32 count and an i64 stride, as the attributes take.
        unsafe {
            check(
                "batch",
                result::set_matrix_layout_attribute(
                    made,
                    Attr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    (&n as *const i32).cast(),
                    4,
                ),
            );
            check(
                "batch",
                result::set_matrix_layout_attribute(
                    made,
                    Attr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&stride as *const i64).cast(),
                    8,
                ),
            );
        }
    }
    made
}

impl Drop for Blas {
    fn drop(&mut self) {
        let plans = self.plans.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: every handle was made here and is dropped once; the stream was drained by
        // the memory's drop order (the backend synchronises before dropping).
        unsafe {
            for (_, p) in plans.drain() {
                for l in p.layouts {
                    let _ = result::destroy_matrix_layout(l);
                }
                let _ = result::destroy_matmul_desc(p.desc);
            }
            let _ = result::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Gemm;

    #[test]
    fn the_three_products_have_the_shapes_of_their_row_major_operands() {
        // forward: A = W stored in×out, B = x stored in×t, C = out×t.
        let f = Gemm::forward(5, 3, 7);
        assert_eq!((f.m, f.n, f.k), (7, 5, 3));
        assert_eq!(f.stored(), [(3, 7), (3, 5)]);
        // input gradient: A = W in×out, B = dy out×t, C = in×t.
        let bi = Gemm::backward_input(5, 3, 7);
        assert_eq!((bi.m, bi.n, bi.k), (3, 5, 7));
        assert_eq!(bi.stored(), [(3, 7), (7, 5)]);
        // weight gradient: A = x in×t, B = dy out×t, C = in×out.
        let bw = Gemm::backward_weight(5, 3, 7);
        assert_eq!((bw.m, bw.n, bw.k), (3, 7, 5));
        assert_eq!(bw.stored(), [(3, 5), (7, 5)]);
    }

    #[test]
    fn a_batched_operand_is_as_aligned_as_its_start_pitch_and_stride() {
        use super::{operand_alignment, ColumnLayout};
        let l = |ld, stride| ColumnLayout {
            rows: ld,
            cols: 3,
            ld,
            stride,
        };
        assert_eq!(operand_alignment(1 << 20, l(64, 64 * 3), 2), 256);
        // An odd pitch (an odd chunk of keys) or an odd stride: 4 bytes, whatever the start.
        assert_eq!(operand_alignment(1 << 20, l(75, 64), 2), 4);
        assert_eq!(operand_alignment(1 << 20, l(64, 75), 2), 4);
        // The stride of a single matrix does not matter; its start does.
        assert_eq!(operand_alignment(1 << 20, l(64, 75), 1), 256);
        assert_eq!(operand_alignment((1 << 20) + 96, l(64, 64), 1), 32);
    }
}
