//! Launching the NVRTC-compiled kernels: grid shapes, device addresses of slices, and the
//! `launch!` macro that pushes each argument by value.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use ferrotron_tensor::DeviceSlice;

/// Threads per block of every kernel (a multiple of 32; the block reductions allow ≤ 1024).
pub const BLOCK: u32 = 256;

/// Blocks of a grid-stride loop over `n` elements (enough to fill any current GPU).
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
pub fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A block of 32 warps per 32 columns (`rmsnorm_backward_weight`: the warps split the rows).
pub fn column_blocks(cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(32).max(1) as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
pub fn warp_per_row(rows: usize) -> LaunchConfig {
    let warps = (BLOCK / 32) as usize;
    LaunchConfig {
        grid_dim: (rows.div_ceil(warps).max(1) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows per tile of the tiled attention kernels (`TB` in `attention.cu`).
pub const ATTENTION_TILE: usize = 32;

/// The widest head the tiled attention kernels take (`TD` in `attention.cu`); wider heads
/// run on the kernels with one warp per row.
pub const ATTENTION_TILE_DIM: usize = 64;

// The tiled attention kernels map their 256 threads onto 16 × 16 (`attention.cu`).
const _: () = assert!(BLOCK == 256 && ATTENTION_TILE == 32);

/// One block per tile of [`ATTENTION_TILE`] rows of `rows`, per head, per sequence.
pub fn tiles(rows: usize, heads: usize, batch: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            rows.div_ceil(ATTENTION_TILE).max(1) as u32,
            heads as u32,
            batch as u32,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device address of a slice (no element is read on the host).
pub fn at<T>(s: &DeviceSlice<T>) -> u64 {
    s.host().as_ptr() as u64
}

/// The device address of a slice the kernel writes.
pub fn at_mut<T>(s: &mut DeviceSlice<T>) -> u64 {
    s.host_mut().as_mut_ptr() as u64
}

/// The attention kernels' `Shape` argument (`attention.cu`), passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Sequences.
    pub batch: u32,
    /// Query rows per sequence.
    pub sq: u32,
    /// Key rows per sequence.
    pub skv: u32,
    /// Query heads.
    pub heads: u32,
    /// Key/value heads.
    pub kv_heads: u32,
    /// Head dimension (at most 256).
    pub d: u32,
}

// SAFETY: `repr(C)` of six `u32`, the layout of the CUDA struct.
unsafe impl DeviceRepr for Shape {}

/// Launches kernel `$name` of backend `$be` with config `$cfg` and the arguments by value.
/// The arguments' sizes are checked against the kernel's PTX parameters first. A failed
/// launch is a fatal GPU error: it panics naming the kernel.
macro_rules! launch {
    ($be:expr, $name:literal, $cfg:expr; $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg;
        let be = &$be;
        let f = be.gpu.function($name);
        let mut builder = be.stream.launch_builder(f);
        let mut sizes = Vec::new();
        $(
            let a = $arg;
            sizes.push(std::mem::size_of_val(&a));
            builder.arg(&a);
        )*
        be.gpu.check_args($name, &sizes);
        // SAFETY: the arguments match the kernel's parameters in `kernels/*.cu`, and every
        // address is a slice of the length the kernel reads.
        unsafe { builder.launch($cfg) }
            .unwrap_or_else(|e| panic!("CUDA kernel {} failed to launch: {e}", $name));
    }};
}
pub(crate) use launch;
