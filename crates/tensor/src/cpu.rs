//! The host backend: `gemm` matmuls and rayon element-wise loops on the current thread pool.

use crate::adamw::{adamw_update, sum_squares, AdamW};
use crate::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};
use crate::backend::RingBlock;
use crate::elementwise::add;
use crate::embedding::{
    embedding_backward, embedding_backward_slice, embedding_forward, embedding_forward_slice,
};
use crate::linear::{linear_backward_input, linear_backward_weight, linear_forward};
use crate::moe::{self, AuxStats, Dispatch, Routing};
use crate::ring_attention::{self, BlockShape};
use crate::rmsnorm::{rmsnorm_apply, rmsnorm_backward, rmsnorm_forward};
use crate::rope::{rope_apply, RopeTable};
use crate::swiglu::{swiglu_backward, swiglu_forward};
use crate::xent::{lm_head_xent, logits_exp_stats, logits_row_max, vocab_softmax_grad, XentGrads};
use crate::{Backend, Ledger};

/// Host kernels: `gemm` matmuls and rayon element-wise loops on the current thread pool.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

#[allow(clippy::too_many_arguments)]
impl Backend for CpuBackend {
    fn linear_forward(
        &self,
        y: &mut [f32],
        x: &[f32],
        w: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    ) {
        linear_forward(y, x, w, t, d_in, d_out)
    }
    fn linear_backward_input(
        &self,
        dx: &mut [f32],
        dy: &[f32],
        w: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
        accumulate: bool,
    ) {
        linear_backward_input(dx, dy, w, t, d_in, d_out, accumulate)
    }
    fn linear_backward_weight(
        &self,
        dw: &mut [f32],
        dy: &[f32],
        x: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    ) {
        linear_backward_weight(dw, dy, x, t, d_in, d_out)
    }
    fn rmsnorm_forward(
        &self,
        y: &mut [f32],
        rstd: &mut [f32],
        x: &[f32],
        w: &[f32],
        h: usize,
        eps: f32,
    ) {
        rmsnorm_forward(y, rstd, x, w, h, eps)
    }
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
    ) {
        rmsnorm_backward(dx, dw, dy, x, rstd, w, h, accumulate)
    }
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    ) {
        rope_apply(x, positions, heads, table, inverse)
    }
    fn attention_forward(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
    ) {
        attention_forward(out, lse, q, k, v, shape)
    }
    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        delta: &mut [f32],
        dout: &[f32],
        saved: AttnSaved<'_>,
        shape: AttnShape,
    ) {
        attention_backward(dq, dk, dv, delta, dout, saved, shape)
    }
    fn swiglu_forward(&self, act: &mut [f32], gate: &[f32], up: &[f32]) {
        swiglu_forward(act, gate, up)
    }
    fn swiglu_backward(
        &self,
        dgate: &mut [f32],
        dup: &mut [f32],
        dact: &[f32],
        gate: &[f32],
        up: &[f32],
    ) {
        swiglu_backward(dgate, dup, dact, gate, up)
    }
    fn embedding_forward(&self, x: &mut [f32], table: &[f32], tokens: &[u32], h: usize) {
        embedding_forward(x, table, tokens, h)
    }
    fn embedding_backward(&self, dtable: &mut [f32], dx: &[f32], tokens: &[u32], h: usize) {
        embedding_backward(dtable, dx, tokens, h)
    }
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
    ) -> f64 {
        lm_head_xent(ledger, xn, w, targets, h, v, chunk, grads)
    }
    fn adamw(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        grad_scale: f32,
        hyper: AdamW,
    ) {
        adamw_update(param, grad, m, v, grad_scale, hyper)
    }
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
    ) {
        ring_attention::block_forward(out, lse, q, k, v, q_pos, kv_pos, sh)
    }
    fn attention_merge(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        part_out: &[f32],
        part_lse: &[f32],
        sh: BlockShape,
    ) {
        ring_attention::merge_partial(out, lse, part_out, part_lse, sh)
    }
    fn attention_delta(&self, delta: &mut [f32], dout: &[f32], out: &[f32], sh: BlockShape) {
        ring_attention::attention_delta(delta, dout, out, sh)
    }
    fn attention_block_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        s: RingBlock<'_>,
        q_pos: &[usize],
        kv_pos: &[usize],
        sh: BlockShape,
    ) {
        ring_attention::block_backward(
            dq, dk, dv, dout, s.q, s.k, s.v, s.lse, s.delta, q_pos, kv_pos, sh,
        )
    }
    fn moe_route(&self, logits: &[f32], t: usize, experts: usize, top_k: usize) -> Routing {
        moe::route(logits, t, experts, top_k)
    }
    fn moe_route_backward(
        &self,
        d_logits: &mut [f32],
        d_gates: &[f32],
        routing: &Routing,
        t: usize,
        experts: usize,
        top_k: usize,
    ) {
        moe::route_backward(d_logits, d_gates, routing, t, experts, top_k)
    }
    fn moe_aux_stats(&self, routing: &Routing, t: usize, experts: usize, top_k: usize) -> AuxStats {
        moe::aux_stats(routing, t, experts, top_k)
    }
    fn moe_aux_loss_backward(
        &self,
        d_logits: &mut [f32],
        coef: f64,
        stats: &AuxStats,
        tokens: usize,
        routing: &Routing,
        t: usize,
        experts: usize,
    ) {
        moe::aux_loss_backward(d_logits, coef, stats, tokens, routing, t, experts)
    }
    fn moe_gather_rows(&self, dst: &mut [f32], src: &[f32], h: usize, dispatch: &Dispatch) {
        moe::gather_rows(dst, src, h, dispatch)
    }
    fn moe_scatter_add_rows(&self, dst: &mut [f32], src: &[f32], h: usize, dispatch: &Dispatch) {
        moe::scatter_add_rows(dst, src, h, dispatch)
    }
    fn moe_combine_forward(
        &self,
        out: &mut [f32],
        expert_out: &[f32],
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    ) {
        moe::combine_forward(out, expert_out, h, routing, dispatch)
    }
    fn moe_combine_backward(
        &self,
        d_expert_out: &mut [f32],
        d_gates: &mut [f32],
        d_out: &[f32],
        expert_out: &[f32],
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    ) {
        moe::combine_backward(
            d_expert_out,
            d_gates,
            d_out,
            expert_out,
            h,
            routing,
            dispatch,
        )
    }
    fn embedding_forward_slice(
        &self,
        x: &mut [f32],
        table: &[f32],
        tokens: &[u32],
        h: usize,
        v0: usize,
    ) {
        embedding_forward_slice(x, table, tokens, h, v0)
    }
    fn embedding_backward_slice(
        &self,
        dtable: &mut [f32],
        dx: &[f32],
        tokens: &[u32],
        h: usize,
        v0: usize,
    ) {
        embedding_backward_slice(dtable, dx, tokens, h, v0)
    }
    fn logits_row_max(&self, lg: &[f32], vl: usize) -> Vec<f32> {
        logits_row_max(lg, vl)
    }
    fn logits_exp_stats(
        &self,
        lg: &[f32],
        targets: &[u32],
        row_max: &[f32],
        slice: (usize, usize),
    ) -> Vec<f32> {
        logits_exp_stats(lg, targets, row_max, slice)
    }
    fn vocab_softmax_grad(
        &self,
        lg: &mut [f32],
        targets: &[u32],
        lse: &[f64],
        slice: (usize, usize),
        scale: f32,
    ) {
        vocab_softmax_grad(lg, targets, lse, slice, scale)
    }
    fn add(&self, out: &mut [f32], a: &[f32], b: &[f32]) {
        add(out, a, b)
    }
    fn rmsnorm_apply(&self, y: &mut [f32], x: &[f32], rstd: &[f32], w: &[f32], h: usize) {
        rmsnorm_apply(y, x, rstd, w, h)
    }
    fn sum_squares(&self, x: &[f32]) -> f64 {
        sum_squares(x)
    }
}
