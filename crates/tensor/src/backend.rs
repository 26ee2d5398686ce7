//! The kernel interface the model and the parallel techniques are written against: every
//! kernel of a training step goes through it. [`crate::CpuBackend`] (`cpu.rs`) runs on the
//! host with `gemm` and rayon; a CUDA backend implements the same traits over device buffers.
//!
//! The kernels come in families, one trait each ([`kernels`]): products, norms, attention,
//! the mixture of experts, the loss, element-wise kernels and the optimizer. [`Backend`] is
//! all of them together with the stream and the device memory. A caller that runs kernels
//! imports the families with `use ferrotron_tensor::kernels::*`.
//!
//! Kernels take shapes as named structs ([`LinearShape`], [`NormSaved`], [`KvBlock`],
//! [`RouteShape`], [`HeadShape`] …), never as long runs of scalars.

mod family;

pub use family::{
    AttentionKernels, Elementwise, LossKernels, MoeKernels, Norms, OptimizerKernels, Products,
};

pub use crate::device::Operand;
use crate::moe::{AuxStats, Dispatch, Routing};
pub use crate::ring_attention::KvBlock;
use crate::{DeviceSlice, Ledger};

/// A device as kernels' callers see it: where buffers are counted and what runs kernels.
#[derive(Clone, Copy)]
pub struct Device<'a> {
    /// The ledger every buffer is counted in.
    pub ledger: &'a Ledger,
    /// The kernels.
    pub backend: &'a dyn Backend,
}

/// Every kernel of a Llama training step, forward and backward, over the backend's
/// [`DeviceSlice`]s: the kernel families together. Shapes follow the free functions of each
/// module, whose docs give the layouts.
///
/// Execution order: kernels run in the order they are called, on the backend's one compute
/// stream; [`Backend::synchronize`] waits for them. Kernels that return a host value (the
/// loss, a squared norm, the MoE routing tables) are device-to-host transfers and count
/// themselves on the ledger they are given.
pub trait Backend:
    Products
    + Norms
    + AttentionKernels
    + MoeKernels
    + LossKernels
    + Elementwise
    + OptimizerKernels
    + Send
    + Sync
{
    /// Waits until every kernel issued so far has finished (the backend's stream is drained).
    /// The CPU backend runs each kernel to completion when it is called, so this returns at
    /// once; a GPU backend synchronises its compute stream.
    fn synchronize(&self) {}
    /// The device memory this backend's buffers live in: a ledger made with
    /// [`Ledger::on`] allocates from it. `None` (the CPU backend): host vectors.
    fn memory(&self) -> Option<std::sync::Arc<dyn crate::memory::DeviceMemory>> {
        None
    }
}

/// The shape of a linear layer's product: `t` rows of `d_in` features to `d_out`
/// (`x: [t, d_in]`, `w: [d_out, d_in]`, `y: [t, d_out]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearShape {
    /// Rows (tokens).
    pub t: usize,
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
}

impl LinearShape {
    /// `t` rows of `d_in` features to `d_out`.
    pub const fn new(t: usize, d_in: usize, d_out: usize) -> LinearShape {
        LinearShape { t, d_in, d_out }
    }
}

/// What RMSNorm's backward (and its re-application) reads: the input `x` (`[rows, h]`), the
/// reciprocal RMS of each row the forward saved, and the weight (`[h]`).
#[derive(Clone, Copy)]
pub struct NormSaved<'a> {
    /// The norm's input.
    pub x: &'a DeviceSlice<f32>,
    /// `1 / rms` of each row.
    pub rstd: &'a DeviceSlice<f32>,
    /// The weight.
    pub w: &'a DeviceSlice<f32>,
    /// Features per row.
    pub h: usize,
}

/// The gradients an attention backward writes: queries', keys' and values'.
pub struct AttnGrads<'a> {
    /// `d loss / d q`.
    pub dq: &'a mut DeviceSlice<f32>,
    /// `d loss / d k`.
    pub dk: &'a mut DeviceSlice<f32>,
    /// `d loss / d v`.
    pub dv: &'a mut DeviceSlice<f32>,
}

/// What one key/value block's ring-attention backward reads: this rank's queries, the
/// visiting keys and values, and the queries' final log-sum-exp and `delta`.
#[derive(Clone, Copy)]
pub struct RingBlock<'a> {
    /// Queries.
    pub q: &'a DeviceSlice<f32>,
    /// The visiting block's keys.
    pub k: &'a DeviceSlice<f32>,
    /// The visiting block's values.
    pub v: &'a DeviceSlice<f32>,
    /// Log-sum-exp of the queries over every block.
    pub lse: &'a DeviceSlice<f32>,
    /// `rowsum(dout ⊙ out)` of the queries.
    pub delta: &'a DeviceSlice<f32>,
}

/// A mixture of experts' routing shape: `t` tokens, each sent to `top_k` of `experts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteShape {
    /// Tokens routed.
    pub t: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// The load-balancing loss whose gradient [`MoeKernels::moe_aux_loss_backward`] adds: its
/// coefficient, the routing statistics over every token it covers, and their number.
#[derive(Clone, Copy)]
pub struct AuxLoss<'a> {
    /// The loss's coefficient in the objective.
    pub coef: f64,
    /// Routing statistics summed over the loss's tokens.
    pub stats: &'a AuxStats,
    /// Tokens the statistics cover.
    pub tokens: usize,
}

/// Tokens routed to experts: the routing (experts and gates per token) and the dispatch
/// (rows per expert) built from it.
#[derive(Clone, Copy)]
pub struct Routed<'a> {
    /// Experts and gates of each token.
    pub routing: &'a Routing,
    /// Rows of each expert.
    pub dispatch: &'a Dispatch,
}

/// The LM head with its cross-entropy: `h` features to a vocabulary of `v`, `chunk` tokens
/// at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// Hidden features.
    pub h: usize,
    /// Vocabulary (this rank's slice of it).
    pub v: usize,
    /// Tokens per chunk of logits.
    pub chunk: usize,
}

/// The kernel families, for `use ferrotron_tensor::kernels::*` where kernels are called.
pub mod kernels {
    pub use super::{
        AttentionKernels, Backend, Elementwise, LossKernels, MoeKernels, Norms, OptimizerKernels,
        Products,
    };
}
