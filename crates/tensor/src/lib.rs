//! Kernels of the ferrotron engine, each with its forward and backward written out, plus the
//! storage types every buffer is allocated through.
//!
//! - [`ledger`]: the memory ledger. Every buffer is a [`Buf`] registered under a
//!   [`Category`]; the ledger keeps current and peak bytes per category.
//! - [`store`]: activations and weights stored as f32 or bf16, read back as f32.
//! - [`linear`], [`rmsnorm`], [`rope`], [`attention`], [`swiglu`], [`xent`], [`adamw`],
//!   [`embedding`]: CPU kernels. Element-wise work is parallel over the current rayon pool;
//!   matmuls run on `gemm`.
//! - [`ring_attention`]: the per-block attention pieces of context-parallel ring attention
//!   (block forward/backward under a global-position causal mask, online-softmax merge,
//!   zig-zag split); [`sequences`]: attention over whole sequences through a backend, plain
//!   causal or document-masked.
//! - [`moe`]: the routing math of a mixture-of-experts layer (router, dispatch, combine,
//!   load-balancing loss); the experts themselves are ordinary [`linear`] and [`swiglu`] calls.
//! - [`Backend`]: the kernel interface the model calls, so a CUDA backend is an addition;
//!   [`profile::ProfiledBackend`] times another backend's kernels by class (`bench --profile`).
//! - [`device`]: [`DeviceSlice`], what every buffer dereferences to and every kernel takes —
//!   device memory the engine passes on but cannot read; host↔device moves are the ledger's
//!   counted transfers ([`Ledger::upload`], [`Ledger::download`]).
//! - [`memory`]: [`memory::DeviceMemory`], the allocator a ledger draws a backend's buffers
//!   from ([`Ledger::on`]), and [`memory::Arena`], the one of [`ArenaBackend`], the test
//!   suite's second backend (the CPU kernels over an arena, refusing any other memory).
//!
//! No knowledge of ranks lives here beyond the index arithmetic of the context-parallel
//! split in [`ring_attention`]; communication belongs to the caller.

#![warn(missing_docs)]
// Kernels take shapes as separate arguments and index several arrays in one loop; these
// lints would only obscure them.
#![allow(clippy::too_many_arguments, clippy::needless_range_loop)]

pub mod adamw;
mod arena;
pub mod attention;
pub mod backend;
pub mod bf16_gemm;
pub mod blas;
mod cpu;
pub mod device;
pub mod elementwise;
pub mod embedding;
pub mod fastmath;
pub mod fp8;
pub mod ledger;
pub mod linear;
mod mat;
pub mod memory;
pub mod moe;
pub mod muon;
pub mod product_rate;
pub mod profile;
pub mod ring_attention;
pub mod rmsnorm;
pub mod rope;
pub mod sequences;
mod shared;
pub mod store;
pub mod swiglu;
pub mod trace;
mod transpose;
pub mod xent;

pub use arena::ArenaBackend;
pub use backend::{kernels, Backend, Device, Operand, RingBlock};
pub use backend::{
    AttnGrads, AuxLoss, HeadShape, KvBlock, LinearShape, NormSaved, RouteShape, Routed,
};
pub use cpu::CpuBackend;
pub use device::DeviceSlice;
pub use half::{bf16, f16};
pub use ledger::{Buf, Category, Held, Ledger, LedgerSnapshot, Recycling, TransferCount};
pub use store::{Store, StoreDType, View};

/// Minimum elements per rayon task in element-wise kernels: below this, splitting costs more
/// than it saves.
pub(crate) const PAR_CHUNK: usize = 16 * 1024;
