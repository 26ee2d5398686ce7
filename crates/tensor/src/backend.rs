//! The kernel interface the model and the parallel techniques are written against: every
//! kernel of a training step goes through it. [`crate::CpuBackend`] (`cpu.rs`) runs on the
//! host with `gemm` and rayon; a CUDA backend implements the same trait over device buffers.

use crate::adamw::AdamW;
use crate::attention::{AttnSaved, AttnShape};
use crate::moe::{AuxStats, Dispatch, Routing};
use crate::ring_attention::BlockShape;
use crate::rope::RopeTable;
use crate::xent::XentGrads;
use crate::{bf16, DeviceSlice, Ledger};

/// A device as kernels' callers see it: where buffers are counted and what runs kernels.
#[derive(Clone, Copy)]
pub struct Device<'a> {
    /// The ledger every buffer is counted in.
    pub ledger: &'a Ledger,
    /// The kernels.
    pub backend: &'a dyn Backend,
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

/// Every kernel of a Llama training step, forward and backward, over the backend's
/// [`DeviceSlice`]s. Shapes follow the free functions of each module, whose docs give the
/// layouts.
///
/// Execution order: kernels run in the order they are called, on the backend's one compute
/// stream; [`Backend::synchronize`] waits for them. Kernels that return a host value (the
/// loss, a squared norm, the MoE routing tables) are device-to-host transfers and count
/// themselves on the ledger they are given.
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send + Sync {
    /// See [`linear_forward`](crate::linear::linear_forward).
    fn linear_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        t: usize,
        d_in: usize,
        d_out: usize,
    );
    /// See [`linear_backward_input`](crate::linear::linear_backward_input).
    fn linear_backward_input(
        &self,
        dx: &mut DeviceSlice<f32>,
        dy: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        t: usize,
        d_in: usize,
        d_out: usize,
        accumulate: bool,
    );
    /// See [`linear_backward_weight`](crate::linear::linear_backward_weight).
    fn linear_backward_weight(
        &self,
        dw: &mut DeviceSlice<f32>,
        dy: &DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        t: usize,
        d_in: usize,
        d_out: usize,
    );
    /// See [`bias_forward`](crate::linear::bias_forward): `y[i, :] += b`.
    fn bias_forward(&self, y: &mut DeviceSlice<f32>, b: &DeviceSlice<f32>);
    /// See [`bias_backward`](crate::linear::bias_backward): `db += Σ_i dy[i, :]`.
    fn bias_backward(&self, db: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>);
    /// See [`rmsnorm_forward`](crate::rmsnorm::rmsnorm_forward).
    fn rmsnorm_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        rstd: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        h: usize,
        eps: f32,
    );
    /// See [`rmsnorm_backward`](crate::rmsnorm::rmsnorm_backward).
    fn rmsnorm_backward(
        &self,
        dx: &mut DeviceSlice<f32>,
        dw: &mut DeviceSlice<f32>,
        dy: &DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        rstd: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        h: usize,
        accumulate: bool,
    );
    /// See [`rope_apply`](crate::rope::rope_apply).
    fn rope(
        &self,
        x: &mut DeviceSlice<f32>,
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    );
    /// See [`attention_forward`](crate::attention::attention_forward).
    fn attention_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        shape: AttnShape,
    );
    /// See [`attention_backward`](crate::attention::attention_backward).
    fn attention_backward(
        &self,
        dq: &mut DeviceSlice<f32>,
        dk: &mut DeviceSlice<f32>,
        dv: &mut DeviceSlice<f32>,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        saved: AttnSaved<'_, DeviceSlice<f32>>,
        shape: AttnShape,
    );
    /// See [`swiglu_forward`](crate::swiglu::swiglu_forward).
    fn swiglu_forward(
        &self,
        act: &mut DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    );
    /// See [`swiglu_backward`](crate::swiglu::swiglu_backward).
    fn swiglu_backward(
        &self,
        dgate: &mut DeviceSlice<f32>,
        dup: &mut DeviceSlice<f32>,
        dact: &DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    );
    /// See [`embedding_forward`](crate::embedding::embedding_forward).
    fn embedding_forward(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    );
    /// See [`embedding_backward`](crate::embedding::embedding_backward).
    fn embedding_backward(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    );
    /// See [`lm_head_xent`](crate::xent::lm_head_xent).
    fn lm_head_xent(
        &self,
        ledger: &Ledger,
        xn: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        h: usize,
        v: usize,
        chunk: usize,
        grads: Option<XentGrads<'_, DeviceSlice<f32>>>,
    ) -> f64;
    /// See [`adamw_update`](crate::adamw::adamw_update).
    fn adamw(
        &self,
        param: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        v: &mut DeviceSlice<f32>,
        grad_scale: f32,
        hyper: AdamW,
    );
    /// See [`crate::ring_attention::block_forward`]: one key/value block of ring attention.
    fn attention_block_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        q_pos: &[usize],
        kv_pos: &[usize],
        sh: BlockShape,
    );
    /// See [`crate::ring_attention::merge_partial`].
    fn attention_merge(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        part_out: &DeviceSlice<f32>,
        part_lse: &DeviceSlice<f32>,
        sh: BlockShape,
    );
    /// See [`crate::ring_attention::attention_delta`].
    fn attention_delta(
        &self,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        out: &DeviceSlice<f32>,
        sh: BlockShape,
    );
    /// See [`crate::ring_attention::block_backward`].
    fn attention_block_backward(
        &self,
        dq: &mut DeviceSlice<f32>,
        dk: &mut DeviceSlice<f32>,
        dv: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        saved: RingBlock<'_>,
        q_pos: &[usize],
        kv_pos: &[usize],
        sh: BlockShape,
    );
    /// See [`crate::moe::route`].
    fn moe_route(
        &self,
        ledger: &Ledger,
        logits: &DeviceSlice<f32>,
        t: usize,
        experts: usize,
        top_k: usize,
    ) -> Routing;
    /// See [`crate::moe::route_backward`].
    fn moe_route_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        d_gates: &DeviceSlice<f32>,
        routing: &Routing,
        t: usize,
        experts: usize,
        top_k: usize,
    );
    /// See [`crate::moe::aux_stats`].
    fn moe_aux_stats(&self, routing: &Routing, t: usize, experts: usize, top_k: usize) -> AuxStats;
    /// See [`crate::moe::aux_loss_backward`].
    fn moe_aux_loss_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        coef: f64,
        stats: &AuxStats,
        tokens: usize,
        routing: &Routing,
        t: usize,
        experts: usize,
    );
    /// See [`crate::moe::gather_rows`].
    fn moe_gather_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    );
    /// See [`crate::moe::scatter_add_rows`].
    fn moe_scatter_add_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    );
    /// See [`crate::moe::combine_forward`].
    fn moe_combine_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    );
    /// See [`crate::moe::combine_backward`].
    fn moe_combine_backward(
        &self,
        d_expert_out: &mut DeviceSlice<f32>,
        d_gates: &mut DeviceSlice<f32>,
        d_out: &DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    );
    /// See [`embedding_forward_slice`](crate::embedding::embedding_forward_slice).
    fn embedding_forward_slice(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    );
    /// See [`embedding_backward_slice`](crate::embedding::embedding_backward_slice).
    fn embedding_backward_slice(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    );
    /// See [`logits_row_max`](crate::xent::logits_row_max): `out[i]` = the maximum of row
    /// `i` of `lg` (`[n, vl]`).
    fn logits_row_max(&self, out: &mut DeviceSlice<f32>, lg: &DeviceSlice<f32>, vl: usize);
    /// `out[i] = max_r gathered[r·n + i]` over the `ranks` pieces of an all-gather.
    fn max_over_ranks(&self, out: &mut DeviceSlice<f32>, gathered: &DeviceSlice<f32>, ranks: usize);
    /// See [`logits_exp_stats`](crate::xent::logits_exp_stats) (`out`: `2n` floats).
    fn logits_exp_stats(
        &self,
        out: &mut DeviceSlice<f32>,
        lg: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        row_max: &DeviceSlice<f32>,
        slice: (usize, usize),
    );
    /// Each row's log-sum-exp over the whole vocabulary from its maximum and the
    /// all-reduced `[Σ exp ; target logit]` statistics (`2n` floats), into `lse`; returns
    /// the sum of the rows' losses, a host value counted on `ledger` as `"loss"`.
    fn vocab_lse(
        &self,
        ledger: &Ledger,
        lse: &mut DeviceSlice<f64>,
        row_max: &DeviceSlice<f32>,
        stats: &DeviceSlice<f32>,
    ) -> f64;
    /// See [`vocab_softmax_grad`](crate::xent::vocab_softmax_grad).
    fn vocab_softmax_grad(
        &self,
        lg: &mut DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        lse: &DeviceSlice<f64>,
        slice: (usize, usize),
        scale: f32,
    );
    /// See [`add`](crate::elementwise::add): the residual add.
    fn add(&self, out: &mut DeviceSlice<f32>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>);
    /// See [`rmsnorm_apply`](crate::rmsnorm::rmsnorm_apply).
    fn rmsnorm_apply(
        &self,
        y: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        rstd: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        h: usize,
    );
    /// See [`sum_squares`](crate::adamw::sum_squares): a squared norm for clipping, a host
    /// value counted on `ledger` as `"grad norm"`.
    fn sum_squares(&self, ledger: &Ledger, x: &DeviceSlice<f32>) -> f64;
    /// `dst = src`.
    fn copy(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>);
    /// `dst = src` for bf16 elements.
    fn copy_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<bf16>);
    /// Every element of `dst` set to `value`.
    fn fill(&self, dst: &mut DeviceSlice<f32>, value: f32);
    /// Every element of `dst` set to `value` (bf16).
    fn fill_bf16(&self, dst: &mut DeviceSlice<bf16>, value: bf16);
    /// `dst += src`.
    fn add_assign(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>);
    /// `dst = round(dst + src)` for a bf16 `dst` (accumulated in f32, rounded once).
    fn add_assign_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>);
    /// `dst *= s`.
    fn scale(&self, dst: &mut DeviceSlice<f32>, s: f32);
    /// The cast f32 → bf16 (round to nearest even).
    fn round_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>);
    /// The cast bf16 → f32 (exact).
    fn widen_bf16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<bf16>);
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
