//! The kernel interface the model is written against. [`CpuBackend`] runs on the host with
//! `gemm` and rayon; a CUDA backend implements the same trait over device buffers.

use crate::adamw::{adamw_update, AdamW};
use crate::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};
use crate::embedding::{embedding_backward, embedding_forward};
use crate::linear::{linear_backward_input, linear_backward_weight, linear_forward};
use crate::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use crate::rope::{rope_apply, RopeTable};
use crate::swiglu::{swiglu_backward, swiglu_forward};
use crate::xent::{lm_head_xent, XentGrads};
use crate::Ledger;

/// Every kernel of a Llama training step, forward and backward. Shapes follow the free
/// functions of each module, whose docs give the layouts.
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send + Sync {
    /// See [`linear_forward`].
    fn linear_forward(
        &self,
        y: &mut [f32],
        x: &[f32],
        w: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    );
    /// See [`linear_backward_input`].
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
    /// See [`linear_backward_weight`].
    fn linear_backward_weight(
        &self,
        dw: &mut [f32],
        dy: &[f32],
        x: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    );
    /// See [`rmsnorm_forward`].
    fn rmsnorm_forward(
        &self,
        y: &mut [f32],
        rstd: &mut [f32],
        x: &[f32],
        w: &[f32],
        h: usize,
        eps: f32,
    );
    /// See [`rmsnorm_backward`].
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
    /// See [`rope_apply`].
    fn rope(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    );
    /// See [`attention_forward`].
    fn attention_forward(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: AttnShape,
    );
    /// See [`attention_backward`].
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
    /// See [`swiglu_forward`].
    fn swiglu_forward(&self, act: &mut [f32], gate: &[f32], up: &[f32]);
    /// See [`swiglu_backward`].
    fn swiglu_backward(
        &self,
        dgate: &mut [f32],
        dup: &mut [f32],
        dact: &[f32],
        gate: &[f32],
        up: &[f32],
    );
    /// See [`embedding_forward`].
    fn embedding_forward(&self, x: &mut [f32], table: &[f32], tokens: &[u32], h: usize);
    /// See [`embedding_backward`].
    fn embedding_backward(&self, dtable: &mut [f32], dx: &[f32], tokens: &[u32], h: usize);
    /// See [`lm_head_xent`].
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
    /// See [`adamw_update`].
    fn adamw(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        grad_scale: f32,
        hyper: AdamW,
    );
}

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
}
