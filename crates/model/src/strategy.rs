//! Where the playbook's parallelism enters the single-device model: strategy traits the model
//! calls at the places the playbook names, implemented by `crates/parallel` (one file per
//! technique). The model names no communicator, group or rank; with no strategy given
//! (`None` in [`crate::StepCtx`]) it runs on one device.
//!
//! | trait | playbook | where the model calls it | implemented in |
//! |---|---|---|---|
//! | [`TensorParallel`] | §4 tensor + sequence parallelism | Megatron's `f`, `f̄`, `g`, `ḡ` around each region ([`crate::tp`]), the vocabulary-parallel loss | `parallel/src/tensor_parallel.rs` |
//! | [`ContextParallel`] | §4 context parallelism | attention of this rank's zig-zag share (`attention.rs`) | `parallel/src/context_parallel.rs` |
//! | [`ExpertParallel`] | §4 expert parallelism | the dispatch and combine of a mixture-of-experts block ([`crate::moe`]) | `parallel/src/expert_parallel.rs` |
//! | [`crate::WeightSource`], [`crate::GradSink`] | §3, §4 data parallelism, ZeRO | entering and leaving a unit, finishing its gradients | `parallel/src/zero.rs`, `parallel/src/data_parallel.rs` |
//! | [`ferrotron_config::Recompute`] | §3 recomputation | what a block keeps ([`crate::block`]) | the model |

use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::{Buf, Device, DeviceSlice};

use crate::HookError;

/// The tensor-parallel group a TP region spans (playbook §4): its three collectives, over
/// which [`crate::tp`] writes Megatron's conjugate operators, and the vocabulary-parallel
/// cross-entropy, so that full logits never exist on any rank.
pub trait TensorParallel: Sync {
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// This rank's index in the group.
    fn index(&self) -> usize;
    /// Whether activations outside TP regions are split along tokens (sequence parallelism).
    fn sequence_parallel(&self) -> bool;
    /// Sum of every member's `x`.
    fn all_reduce(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError>;
    /// Concatenation of every member's `x` (equal sizes).
    fn all_gather(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError>;
    /// This member's equal piece of the sum of every member's `x`.
    fn reduce_scatter(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError>;
    /// Sum over tokens of the cross-entropy of `x · Wᵀ` where this rank holds vocabulary rows
    /// `[v0, v0 + vl)` of `W` (`w`: `[vl, h]`); identical on every member. With `grads`, adds
    /// this rank's partial input gradient and its weight gradient.
    fn vocab_parallel_xent(
        &self,
        dev: Device<'_>,
        head: VocabHead<'_>,
        x: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        grads: Option<VpGrads<'_>>,
    ) -> Result<f64, HookError>;
}

/// The LM head slice a tensor-parallel rank holds.
#[derive(Clone, Copy)]
pub struct VocabHead<'a> {
    /// This rank's rows of the LM head, `[vl, h]`.
    pub w: &'a DeviceSlice<f32>,
    /// Hidden size `h`.
    pub hidden: usize,
    /// First vocabulary row this rank holds.
    pub v0: usize,
    /// Tokens per logits chunk.
    pub chunk: usize,
}

/// Gradients wanted from [`TensorParallel::vocab_parallel_xent`].
pub struct VpGrads<'a> {
    /// This rank's partial `d loss / d x`, `[t, h]` (sum over ranks = the gradient).
    pub dx: &'a mut DeviceSlice<f32>,
    /// `d loss / d W_local`, accumulated.
    pub dw: &'a mut DeviceSlice<f32>,
    /// Multiplier of every token's loss.
    pub scale: f32,
}

/// The context-parallel ring (playbook §4): the tokens given to the model are this rank's
/// zig-zag share of every sequence, and attention sees every earlier key of the sequence.
pub trait ContextParallel: Sync {
    /// Ranks in the ring.
    fn size(&self) -> usize;
    /// Global positions (within a sequence) of this rank's tokens.
    fn positions(&self) -> &[usize];
    /// Attention forward: `out` and `lse` of this rank's queries over every rank's keys and
    /// values (`q, out: [b·n, heads·d]`, `k, v: [b·n, kv_heads·d]`, `lse: [b, heads, n]`).
    /// Under document masking `starts` (`[b, seq_len]`, every token of the windows) holds
    /// the position at which each token's document starts, and keys before a query's
    /// document are hidden from it.
    fn attention_forward(
        &self,
        dev: Device<'_>,
        out: AttnOut<'_>,
        qkv: Qkv<'_>,
        sh: BlockShape,
        starts: Option<&[usize]>,
    ) -> Result<(), HookError>;
    /// Attention backward: overwrites `dq` with the gradient of this rank's queries and `dk`,
    /// `dv` with the gradient of this rank's keys and values from every rank's queries
    /// (`starts` as in the forward).
    fn attention_backward(
        &self,
        dev: Device<'_>,
        grads: QkvGrads<'_>,
        dout: &DeviceSlice<f32>,
        saved: RingSaved<'_>,
        sh: BlockShape,
        starts: Option<&[usize]>,
    ) -> Result<(), HookError>;
    /// Sum of every member's `x` (statistics of the whole sequence).
    fn all_reduce(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError>;
}

/// Queries, keys and values of this rank's tokens, in that order.
pub type Qkv<'a> = (
    &'a DeviceSlice<f32>,
    &'a DeviceSlice<f32>,
    &'a DeviceSlice<f32>,
);

/// Where attention writes its output.
pub struct AttnOut<'a> {
    /// Attention output `[b·n, heads·d]`.
    pub out: &'a mut DeviceSlice<f32>,
    /// Log-sum-exp `[b, heads, n]`.
    pub lse: &'a mut DeviceSlice<f32>,
}

/// Where attention backward writes its input gradients.
pub struct QkvGrads<'a> {
    /// Gradient of the queries.
    pub dq: &'a mut DeviceSlice<f32>,
    /// Gradient of the keys.
    pub dk: &'a mut DeviceSlice<f32>,
    /// Gradient of the values.
    pub dv: &'a mut DeviceSlice<f32>,
}

/// What attention backward reads from the forward: this rank's queries, keys and values
/// (after RoPE) and the attention output with its log-sum-exp.
#[derive(Clone, Copy)]
pub struct RingSaved<'a> {
    /// Queries `[b·n, heads·d]`.
    pub q: &'a DeviceSlice<f32>,
    /// Keys `[b·n, kv_heads·d]`.
    pub k: &'a DeviceSlice<f32>,
    /// Values `[b·n, kv_heads·d]`.
    pub v: &'a DeviceSlice<f32>,
    /// Attention output `[b·n, heads·d]`.
    pub out: &'a DeviceSlice<f32>,
    /// Log-sum-exp over all blocks `[b, heads, n]`.
    pub lse: &'a DeviceSlice<f32>,
}

/// The expert-parallel group (playbook §4): member `j` of `ep` holds experts
/// `[j·E/ep, (j+1)·E/ep)`, and token rows travel to them and back by all-to-all.
pub trait ExpertParallel: Sync {
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// All-to-all: `send[j]` elements of `data` (in member order) go to member `j`; returns
    /// the `recv[j]` elements from each member `j`, in member order.
    fn all_to_all(
        &self,
        dev: Device<'_>,
        data: &DeviceSlice<f32>,
        send: Vec<usize>,
        recv: Vec<usize>,
    ) -> Result<Buf<f32>, HookError>;
}
