//! The kernel interface the model and the parallel techniques are written against: every
//! kernel of a training step goes through it. [`crate::CpuBackend`] (`cpu.rs`) runs on the
//! host with `gemm` and rayon; a CUDA backend implements the same trait over device buffers.

use crate::adamw::AdamW;
use crate::attention::{AttnSaved, AttnShape};
use crate::moe::{AuxStats, Dispatch, Routing};
use crate::ring_attention::BlockShape;
use crate::rope::RopeTable;
use crate::xent::XentGrads;
use crate::Ledger;

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
    pub q: &'a [f32],
    /// The visiting block's keys.
    pub k: &'a [f32],
    /// The visiting block's values.
    pub v: &'a [f32],
    /// Log-sum-exp of the queries over every block.
    pub lse: &'a [f32],
    /// `rowsum(dout ⊙ out)` of the queries.
    pub delta: &'a [f32],
}

/// Every kernel of a Llama training step, forward and backward. Shapes follow the free
/// functions of each module, whose docs give the layouts.
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send + Sync {
    /// See [`linear_forward`](crate::linear::linear_forward).
    fn linear_forward(
        &self,
        y: &mut [f32],
        x: &[f32],
        w: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    );
    /// See [`linear_backward_input`](crate::linear::linear_backward_input).
    fn linear_backward_input(
        &self,
        dx: &mut [f32],
        dy: &[f32],
        w: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
        accumulate: bool,
    );
    /// See [`linear_backward_weight`](crate::linear::linear_backward_weight).
    fn linear_backward_weight(
        &self,
        dw: &mut [f32],
        dy: &[f32],
        x: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    );
    /// See [`rmsnorm_forward`](crate::rmsnorm::rmsnorm_forward).
    fn rmsnorm_forward(
        &self,
        y: &mut [f32],
        rstd: &mut [f32],
        x: &[f32],
        w: &[f32],
        h: usize,
        eps: f32,
    );
    /// See [`rmsnorm_backward`](crate::rmsnorm::rmsnorm_backward).
    fn rmsnorm_backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        dy: &[f32],
        x: &[f32],
        rstd: &[f32],
        w: &[f32],
        h: usize,
        accumulate: bool,
    );
    /// See [`rope_apply`](crate::rope::rope_apply).
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    );
    /// See [`attention_forward`](crate::attention::attention_forward).
    fn attention_forward(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
    );
    /// See [`attention_backward`](crate::attention::attention_backward).
    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        delta: &mut [f32],
        dout: &[f32],
        saved: AttnSaved<'_>,
        shape: AttnShape,
    );
    /// See [`swiglu_forward`](crate::swiglu::swiglu_forward).
    fn swiglu_forward(&self, act: &mut [f32], gate: &[f32], up: &[f32]);
    /// See [`swiglu_backward`](crate::swiglu::swiglu_backward).
    fn swiglu_backward(
        &self,
        dgate: &mut [f32],
        dup: &mut [f32],
        dact: &[f32],
        gate: &[f32],
        up: &[f32],
    );
    /// See [`embedding_forward`](crate::embedding::embedding_forward).
    fn embedding_forward(&self, x: &mut [f32], table: &[f32], tokens: &[u32], h: usize);
    /// See [`embedding_backward`](crate::embedding::embedding_backward).
    fn embedding_backward(&self, dtable: &mut [f32], dx: &[f32], tokens: &[u32], h: usize);
    /// See [`lm_head_xent`](crate::xent::lm_head_xent).
    fn lm_head_xent(
        &self,
        ledger: &Ledger,
        xn: &[f32],
        w: &[f32],
        targets: &[u32],
        h: usize,
        v: usize,
        chunk: usize,
        grads: Option<XentGrads<'_>>,
    ) -> f64;
    /// See [`adamw_update`](crate::adamw::adamw_update).
    fn adamw(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        grad_scale: f32,
        hyper: AdamW,
    );
    /// See [`crate::ring_attention::block_forward`]: one key/value block of ring attention.
    fn attention_block_forward(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        q_pos: &[usize],
        kv_pos: &[usize],
        sh: BlockShape,
    );
    /// See [`crate::ring_attention::merge_partial`].
    fn attention_merge(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        part_out: &[f32],
        part_lse: &[f32],
        sh: BlockShape,
    );
    /// See [`crate::ring_attention::attention_delta`].
    fn attention_delta(&self, delta: &mut [f32], dout: &[f32], out: &[f32], sh: BlockShape);
    /// See [`crate::ring_attention::block_backward`].
    fn attention_block_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        saved: RingBlock<'_>,
        q_pos: &[usize],
        kv_pos: &[usize],
        sh: BlockShape,
    );
    /// See [`crate::moe::route`].
    fn moe_route(&self, logits: &[f32], t: usize, experts: usize, top_k: usize) -> Routing;
    /// See [`crate::moe::route_backward`].
    fn moe_route_backward(
        &self,
        d_logits: &mut [f32],
        d_gates: &[f32],
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
        d_logits: &mut [f32],
        coef: f64,
        stats: &AuxStats,
        tokens: usize,
        routing: &Routing,
        t: usize,
        experts: usize,
    );
    /// See [`crate::moe::gather_rows`].
    fn moe_gather_rows(&self, dst: &mut [f32], src: &[f32], h: usize, dispatch: &Dispatch);
    /// See [`crate::moe::scatter_add_rows`].
    fn moe_scatter_add_rows(&self, dst: &mut [f32], src: &[f32], h: usize, dispatch: &Dispatch);
    /// See [`crate::moe::combine_forward`].
    fn moe_combine_forward(
        &self,
        out: &mut [f32],
        expert_out: &[f32],
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    );
    /// See [`crate::moe::combine_backward`].
    fn moe_combine_backward(
        &self,
        d_expert_out: &mut [f32],
        d_gates: &mut [f32],
        d_out: &[f32],
        expert_out: &[f32],
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    );
    /// See [`embedding_forward_slice`](crate::embedding::embedding_forward_slice).
    fn embedding_forward_slice(
        &self,
        x: &mut [f32],
        table: &[f32],
        tokens: &[u32],
        h: usize,
        v0: usize,
    );
    /// See [`embedding_backward_slice`](crate::embedding::embedding_backward_slice).
    fn embedding_backward_slice(
        &self,
        dtable: &mut [f32],
        dx: &[f32],
        tokens: &[u32],
        h: usize,
        v0: usize,
    );
    /// See [`logits_row_max`](crate::xent::logits_row_max).
    fn logits_row_max(&self, lg: &[f32], vl: usize) -> Vec<f32>;
    /// See [`logits_exp_stats`](crate::xent::logits_exp_stats).
    fn logits_exp_stats(
        &self,
        lg: &[f32],
        targets: &[u32],
        row_max: &[f32],
        slice: (usize, usize),
    ) -> Vec<f32>;
    /// See [`vocab_softmax_grad`](crate::xent::vocab_softmax_grad).
    fn vocab_softmax_grad(
        &self,
        lg: &mut [f32],
        targets: &[u32],
        lse: &[f64],
        slice: (usize, usize),
        scale: f32,
    );
    /// See [`add`](crate::elementwise::add): the residual add.
    fn add(&self, out: &mut [f32], a: &[f32], b: &[f32]);
    /// See [`rmsnorm_apply`](crate::rmsnorm::rmsnorm_apply).
    fn rmsnorm_apply(&self, y: &mut [f32], x: &[f32], rstd: &[f32], w: &[f32], h: usize);
    /// See [`sum_squares`](crate::adamw::sum_squares): the squared norm clipping sums.
    fn sum_squares(&self, x: &[f32]) -> f64;
}
