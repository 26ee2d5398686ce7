//! The CUDA backend of one rank: every kernel of [`Backend`](ferrotron_tensor::Backend) on the rank's stream of a
//! [`Gpu`], GEMMs through cuBLASLt, buffers in the rank's [`CudaMemory`].
//!
//! What is still host code, and moves through the rank's memory each call: RoPE positions and
//! attention positions (a few KB), the mixture of experts' routing (the router's softmax and
//! top-k, its backward and the load-balancing gradient run on the host from downloaded
//! logits, as on the CPU backend) and the dispatch tables.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;
use ferrotron_tensor::adamw::AdamW;
use ferrotron_tensor::attention::AttnShape;
use ferrotron_tensor::memory::DeviceMemory;
use ferrotron_tensor::moe::{Dispatch, Routing};
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::rope::RopeTable;
use ferrotron_tensor::{DeviceSlice, Ledger, Operand};

use crate::blas::{Blas, Gemm};
use crate::gpu::{loaded, Gpu, GpuError};
use crate::launch::{at, at_mut, elementwise, launch, per_row, Shape};
use crate::memory::{CudaMemory, DeviceVec};
use crate::score_attention::ColumnMajor;

/// Settings of the CUDA backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaOptions {
    /// Let f32 GEMMs use TF32 tensor cores (10-bit mantissa products; off by default, so the
    /// f32 regime matches the CPU backend to f32 rounding).
    pub tf32: bool,
    /// bf16 products (`train.matmul = "bf16"`): the linear layers' and the LM head's GEMMs
    /// round both operands to bf16 into a scratch of this many bytes
    /// ([`ferrotron_config::device_bf16_operand_bytes`] of the run, which the ledger counts
    /// as workspace) and multiply them on tensor cores with f32 sums. `None`: f32 products.
    pub bf16_products: Option<usize>,
    /// Attention as batched products (`train.attention = "products"`): the bytes of the
    /// score scratch ([`ferrotron_config::device_attention_score_bytes`] of the run, which
    /// the ledger counts as workspace). `None`: the tiled kernels.
    pub attention_scores: Option<usize>,
}

impl CudaOptions {
    /// The settings a run's configuration asks for: TF32 (`train.tf32`), and bf16 products
    /// (`train.matmul = "bf16"`) with the scratch the run's largest product needs.
    pub fn of(config: &ferrotron_config::Config) -> CudaOptions {
        let t = &config.train;
        let bf16 = t.matmul == ferrotron_config::Matmul::Bf16;
        CudaOptions {
            tf32: t.tf32,
            bf16_products: bf16.then(|| {
                ferrotron_config::device_bf16_operand_bytes(
                    &config.model,
                    &config.parallel,
                    (t.micro_batch, t.loss_chunk),
                ) as usize
            }),
            attention_scores: Some(ferrotron_config::device_attention_score_bytes(
                &config.model,
                &config.parallel,
                t.attention,
            ) as usize)
            .filter(|&b| b > 0),
        }
    }
}

struct RopeEntry {
    key: (usize, usize, u32, u32),
    cos: DeviceVec,
    sin: DeviceVec,
}

/// One rank's kernels on a GPU.
pub struct CudaBackend {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) memory: Arc<CudaMemory>,
    blas: Blas,
    ropes: Mutex<Vec<RopeEntry>>,
    /// The rounded operands of a bf16 product (see [`CudaOptions::bf16_products`]).
    pub(crate) bf16: Option<DeviceVec>,
    /// The score buffers of attention as products (see [`CudaOptions::attention_scores`]).
    pub(crate) scores: Option<DeviceVec>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({:?})", self.gpu)
    }
}

impl CudaBackend {
    /// A rank on `gpu`: its own stream, memory and cuBLASLt handle.
    pub fn new(gpu: Arc<Gpu>, options: CudaOptions) -> Result<CudaBackend, GpuError> {
        let stream = loaded(|| gpu.context().new_stream()).map_err(|message| GpuError::Call {
            what: "stream creation",
            ordinal: gpu.ordinal(),
            message,
        })?;
        let memory = Arc::new(CudaMemory::new(stream.clone(), gpu.total_memory()));
        loaded(|| gpu.context().bind_to_thread()).map_err(|message| GpuError::Call {
            what: "context binding",
            ordinal: gpu.ordinal(),
            message,
        })?;
        let blas = Blas::new(&memory, options.tf32)?;
        let bf16 = options
            .bf16_products
            .map(|bytes| DeviceVec::zeros(&memory, bytes));
        let scores = options
            .attention_scores
            .map(|bytes| DeviceVec::zeros(&memory, bytes));
        Ok(CudaBackend {
            gpu,
            stream,
            memory,
            blas,
            ropes: Mutex::new(Vec::new()),
            bf16,
            scores,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The rank's caching allocator.
    pub fn cuda_memory(&self) -> &Arc<CudaMemory> {
        &self.memory
    }

    /// Positions (or token tables) as the `u32` the kernels read, in the rank's memory.
    pub(crate) fn upload_u32(&self, xs: &[usize]) -> DeviceVec {
        let v: Vec<u32> = xs.iter().map(|&x| x as u32).collect();
        DeviceVec::upload(&self.memory, &v)
    }

    /// The device copy of a RoPE table, uploaded on first use.
    fn rope_table(&self, table: &RopeTable) -> (u64, u64) {
        let (cos, sin) = (table.cos(), table.sin());
        let last = |s: &[f32]| s.last().map_or(0, |x| x.to_bits());
        let key = (cos.as_ptr() as usize, cos.len(), last(cos), last(sin));
        let mut ropes = self.ropes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = ropes.iter().find(|e| e.key == key) {
            return (e.cos.ptr(), e.sin.ptr());
        }
        let entry = RopeEntry {
            key,
            cos: DeviceVec::upload(&self.memory, cos),
            sin: DeviceVec::upload(&self.memory, sin),
        };
        let ptrs = (entry.cos.ptr(), entry.sin.ptr());
        ropes.push(entry);
        ptrs
    }

    pub(crate) fn gemm(&self, g: Gemm, a: u64, b: u64, c: u64, beta: f32) {
        self.blas.run(&self.stream, g, a, b, c, beta)
    }

    /// A strided batch of f32 products (column-major) at `abc`.
    pub(crate) fn batched_gemm(&self, g: ColumnMajor, abc: [u64; 3], alpha: f32, beta: f32) {
        self.blas.run_batched(&self.stream, g, abc, alpha, beta)
    }

    /// `C = β·C + op(A)·op(B)` in f32, or, with bf16 products, on bf16 operands: a bf16
    /// operand is read where it is stored, an f32 one rounded into its part of the scratch
    /// first. f32 products widen a bf16 operand into a temporary block (the engine passes
    /// none: [`Products::reads_bf16`](ferrotron_tensor::kernels::Products::reads_bf16)).
    pub(crate) fn product(&self, g: Gemm, a: Operand<'_>, b: Operand<'_>, c: u64, beta: f32) {
        let Some(scratch) = &self.bf16 else {
            let (wa, wb) = (self.widened(a), self.widened(b));
            let (pa, pb) = (
                wa.as_ref().map_or(f32_at(a), DeviceVec::ptr),
                wb.as_ref().map_or(f32_at(b), DeviceVec::ptr),
            );
            return self.gemm(g, pa, pb, c, beta);
        };
        let second = ferrotron_config::device_bf16_second_operand(a.len());
        assert!(
            second + 2 * b.len() <= scratch.bytes(),
            "bf16 products: operands of {} and {} elements exceed the scratch of {} bytes the \
             configuration sized (ferrotron_config::device_bf16_operand_bytes)",
            a.len(),
            b.len(),
            scratch.bytes()
        );
        let sa = self.in_bf16(a, scratch.ptr());
        let sb = self.in_bf16(b, scratch.ptr() + second as u64);
        self.gemm(g.in_bf16(), sa, sb, c, beta)
    }

    /// The address of `x` as bf16: where it is stored, or `scratch` after rounding it there.
    fn in_bf16(&self, x: Operand<'_>, scratch: u64) -> u64 {
        match x {
            Operand::Bf16(s) => at(s),
            Operand::F32(s) => {
                let n = s.len();
                launch!(self, "round_bf16", elementwise(n); scratch, at(s), n as u64);
                scratch
            }
        }
    }

    /// A bf16 operand widened into a temporary block (freed in stream order); `None` for f32.
    fn widened(&self, x: Operand<'_>) -> Option<DeviceVec> {
        let Operand::Bf16(s) = x else {
            return None;
        };
        let n = s.len();
        let out = DeviceVec::zeros(&self.memory, 4 * n.max(1));
        launch!(self, "widen_bf16", elementwise(n); out.ptr(), at(s), n as u64);
        Some(out)
    }

    /// A host copy of device data, for the kernels that still run on the host.
    pub(crate) fn fetch<T: Copy + Default>(&self, s: &DeviceSlice<T>) -> Vec<T> {
        let mut out = vec![T::default(); s.len()];
        if let Some(ptr) = std::ptr::NonNull::new(at(s) as *mut u8) {
            // SAFETY: `s` is device memory of this rank holding `out.len()` elements.
            unsafe {
                self.memory.read(
                    out.as_mut_ptr().cast(),
                    ptr,
                    std::mem::size_of_val(&out[..]),
                )
            };
        }
        out
    }

    /// Writes host data over device data of the same length.
    pub(crate) fn store<T: Copy>(&self, dst: &mut DeviceSlice<T>, src: &[T]) {
        assert_eq!(dst.len(), src.len(), "store: lengths differ");
        if let Some(ptr) = std::ptr::NonNull::new(at_mut(dst) as *mut u8) {
            // SAFETY: `dst` is device memory of this rank holding `src.len()` elements.
            unsafe {
                self.memory
                    .write(ptr, src.as_ptr().cast(), std::mem::size_of_val(src))
            };
        }
    }

    /// `out[0] = Σ x` (f64, one block, fixed order) and its host value, counted on `ledger`.
    pub(crate) fn sum_to_host(&self, ledger: &Ledger, what: &'static str, x: u64, n: usize) -> f64 {
        let out = DeviceVec::zeros(&self.memory, 8);
        launch!(self, "sum_f64", per_row(1); out.ptr(), x, n as u32);
        ledger.count_to_host(what, 8);
        out.download::<f64>(1)[0]
    }

    pub(crate) fn rope_launch(
        &self,
        x: &mut DeviceSlice<f32>,
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    ) {
        let half = table.head_dim() / 2;
        let rows = positions.len();
        assert_eq!(
            x.len(),
            rows * heads * 2 * half,
            "rope: x is not [t, heads, d]"
        );
        let (cos, sin) = self.rope_table(table);
        let pos = self.upload_u32(positions);
        let n = rows * heads * half;
        launch!(self, "rope", elementwise(n);
            at_mut(x), pos.ptr(), rows as u32, heads as u32, half as u32, cos, sin, inverse as i32);
    }

    pub(crate) fn adamw_launch(
        &self,
        param: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        v: &mut DeviceSlice<f32>,
        grad_scale: f32,
        h: AdamW,
    ) {
        let k = h.constants();
        let n = param.len();
        launch!(self, "adamw", elementwise(n);
            at_mut(param), at(grad), at_mut(m), at_mut(v), n as u64, grad_scale, h.beta1,
            h.beta2, h.eps, k.decay, k.step_size, k.bc2_sqrt);
    }
}

/// The kernels' `Shape` of a ring block.
pub(crate) fn block_shape(sh: BlockShape) -> Shape {
    assert!(
        sh.head_dim <= 256,
        "the CUDA attention kernels take head_dim ≤ 256, not {}",
        sh.head_dim
    );
    Shape {
        batch: sh.batch as u32,
        sq: sh.q_len as u32,
        skv: sh.kv_len as u32,
        heads: sh.heads as u32,
        kv_heads: sh.kv_heads as u32,
        d: sh.head_dim as u32,
    }
}

/// Whole sequences as one ring block.
pub(crate) fn full_block(sh: AttnShape) -> BlockShape {
    BlockShape {
        batch: sh.batch,
        q_len: sh.seq,
        kv_len: sh.seq,
        heads: sh.heads,
        kv_heads: sh.kv_heads,
        head_dim: sh.head_dim,
    }
}

/// Host copies of the routing tables the MoE kernels read.
pub(crate) struct MoeTables {
    pub token: DeviceVec,
    pub row: DeviceVec,
    pub gates: Option<DeviceVec>,
}

impl CudaBackend {
    pub(crate) fn moe_tables(&self, dispatch: &Dispatch, routing: Option<&Routing>) -> MoeTables {
        MoeTables {
            token: self.upload_u32(dispatch.token_table()),
            row: self.upload_u32(dispatch.row_table()),
            gates: routing.map(|r| DeviceVec::upload(&self.memory, &r.gates)),
        }
    }
}

/// The address of an f32 operand (0 for a bf16 one, whose widened copy is used instead).
fn f32_at(x: Operand<'_>) -> u64 {
    match x {
        Operand::F32(s) => at(s),
        Operand::Bf16(_) => 0,
    }
}
