//! The host backend: `gemm` matmuls and rayon element-wise loops on the current thread pool.

use crate::adamw::{adamw_update, sum_squares, AdamW};
use crate::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};
use crate::backend::RingBlock;
use crate::elementwise::{self, add};
use crate::embedding::{
    embedding_backward, embedding_backward_slice, embedding_forward, embedding_forward_slice,
};
use crate::linear::{bias_backward, bias_forward, HostMatmul};
use crate::moe::{self, AuxStats, Dispatch, Routing};
use crate::ring_attention::{self, BlockShape};
use crate::rmsnorm::{rmsnorm_apply, rmsnorm_backward, rmsnorm_forward};
use crate::rope::{rope_apply, RopeTable};
use crate::store::{round_into, widen_into};
use crate::swiglu::{swiglu_backward, swiglu_forward};
use crate::xent::{lm_head_xent, logits_exp_stats, logits_row_max, vocab_softmax_grad, XentGrads};
use crate::{Backend, DeviceSlice, Ledger};
use half::bf16;

/// Host kernels: matmuls on `gemm` (default) or OpenBLAS, rayon element-wise loops, all on
/// the current thread pool.
#[derive(Debug, Default, Clone)]
pub struct CpuBackend {
    matmul: HostMatmul,
}

impl CpuBackend {
    /// The host backend with the linear layers' products on `matmul`.
    pub fn new(matmul: HostMatmul) -> CpuBackend {
        CpuBackend { matmul }
    }

    /// The library of the linear layers' products.
    pub fn matmul(&self) -> &HostMatmul {
        &self.matmul
    }
}

#[allow(clippy::too_many_arguments)]
impl Backend for CpuBackend {
    fn linear_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        t: usize,
        d_in: usize,
        d_out: usize,
    ) {
        self.matmul
            .linear_forward(y.host_mut(), x.host(), w.host(), t, d_in, d_out)
    }
    fn linear_backward_input(
        &self,
        dx: &mut DeviceSlice<f32>,
        dy: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        t: usize,
        d_in: usize,
        d_out: usize,
        accumulate: bool,
    ) {
        self.matmul.linear_backward_input(
            dx.host_mut(),
            dy.host(),
            w.host(),
            t,
            d_in,
            d_out,
            accumulate,
        )
    }
    fn linear_backward_weight(
        &self,
        dw: &mut DeviceSlice<f32>,
        dy: &DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        t: usize,
        d_in: usize,
        d_out: usize,
    ) {
        self.matmul
            .linear_backward_weight(dw.host_mut(), dy.host(), x.host(), t, d_in, d_out)
    }
    fn rmsnorm_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        rstd: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        h: usize,
        eps: f32,
    ) {
        rmsnorm_forward(y.host_mut(), rstd.host_mut(), x.host(), w.host(), h, eps)
    }
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
    ) {
        rmsnorm_backward(
            dx.host_mut(),
            dw.host_mut(),
            dy.host(),
            x.host(),
            rstd.host(),
            w.host(),
            h,
            accumulate,
        )
    }
    fn rope(
        &self,
        x: &mut DeviceSlice<f32>,
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    ) {
        rope_apply(x.host_mut(), positions, heads, table, inverse)
    }
    fn attention_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        shape: AttnShape,
    ) {
        attention_forward(
            out.host_mut(),
            lse.host_mut(),
            q.host(),
            k.host(),
            v.host(),
            shape,
        )
    }
    fn attention_backward(
        &self,
        dq: &mut DeviceSlice<f32>,
        dk: &mut DeviceSlice<f32>,
        dv: &mut DeviceSlice<f32>,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        saved: AttnSaved<'_, DeviceSlice<f32>>,
        shape: AttnShape,
    ) {
        attention_backward(
            dq.host_mut(),
            dk.host_mut(),
            dv.host_mut(),
            delta.host_mut(),
            dout.host(),
            saved.host(),
            shape,
        )
    }
    fn swiglu_forward(
        &self,
        act: &mut DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    ) {
        swiglu_forward(act.host_mut(), gate.host(), up.host())
    }
    fn swiglu_backward(
        &self,
        dgate: &mut DeviceSlice<f32>,
        dup: &mut DeviceSlice<f32>,
        dact: &DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    ) {
        swiglu_backward(
            dgate.host_mut(),
            dup.host_mut(),
            dact.host(),
            gate.host(),
            up.host(),
        )
    }
    fn embedding_forward(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    ) {
        embedding_forward(x.host_mut(), table.host(), tokens.host(), h)
    }
    fn embedding_backward(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    ) {
        embedding_backward(dtable.host_mut(), dx.host(), tokens.host(), h)
    }
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
    ) -> f64 {
        let grads = grads.map(|g| XentGrads {
            dx: g.dx.host_mut(),
            dw: g.dw.host_mut(),
            scale: g.scale,
        });
        let loss = lm_head_xent(
            &self.matmul,
            ledger,
            xn.host(),
            w.host(),
            targets.host(),
            h,
            v,
            chunk,
            grads,
        );
        ledger.count_to_host("loss", 8);
        loss
    }
    fn adamw(
        &self,
        param: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        v: &mut DeviceSlice<f32>,
        grad_scale: f32,
        hyper: AdamW,
    ) {
        adamw_update(
            param.host_mut(),
            grad.host(),
            m.host_mut(),
            v.host_mut(),
            grad_scale,
            hyper,
        )
    }
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
    ) {
        ring_attention::block_forward(
            out.host_mut(),
            lse.host_mut(),
            q.host(),
            k.host(),
            v.host(),
            q_pos,
            kv_pos,
            sh,
        )
    }
    fn attention_merge(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        part_out: &DeviceSlice<f32>,
        part_lse: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        ring_attention::merge_partial(
            out.host_mut(),
            lse.host_mut(),
            part_out.host(),
            part_lse.host(),
            sh,
        )
    }
    fn attention_delta(
        &self,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        out: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        ring_attention::attention_delta(delta.host_mut(), dout.host(), out.host(), sh)
    }
    fn attention_block_backward(
        &self,
        dq: &mut DeviceSlice<f32>,
        dk: &mut DeviceSlice<f32>,
        dv: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        s: RingBlock<'_>,
        q_pos: &[usize],
        kv_pos: &[usize],
        sh: BlockShape,
    ) {
        ring_attention::block_backward(
            dq.host_mut(),
            dk.host_mut(),
            dv.host_mut(),
            dout.host(),
            s.q.host(),
            s.k.host(),
            s.v.host(),
            s.lse.host(),
            s.delta.host(),
            q_pos,
            kv_pos,
            sh,
        )
    }
    fn moe_route(
        &self,
        ledger: &Ledger,
        logits: &DeviceSlice<f32>,
        t: usize,
        experts: usize,
        top_k: usize,
    ) -> Routing {
        let routing = moe::route(logits.host(), t, experts, top_k);
        ledger.count_to_host("expert routing", routing.heap_bytes());
        routing
    }
    fn moe_route_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        d_gates: &DeviceSlice<f32>,
        routing: &Routing,
        t: usize,
        experts: usize,
        top_k: usize,
    ) {
        moe::route_backward(
            d_logits.host_mut(),
            d_gates.host(),
            routing,
            t,
            experts,
            top_k,
        )
    }
    fn moe_aux_stats(&self, routing: &Routing, t: usize, experts: usize, top_k: usize) -> AuxStats {
        moe::aux_stats(routing, t, experts, top_k)
    }
    fn moe_aux_loss_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        coef: f64,
        stats: &AuxStats,
        tokens: usize,
        routing: &Routing,
        t: usize,
        experts: usize,
    ) {
        moe::aux_loss_backward(
            d_logits.host_mut(),
            coef,
            stats,
            tokens,
            routing,
            t,
            experts,
        )
    }
    fn moe_gather_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    ) {
        moe::gather_rows(dst.host_mut(), src.host(), h, dispatch)
    }
    fn moe_scatter_add_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    ) {
        moe::scatter_add_rows(dst.host_mut(), src.host(), h, dispatch)
    }
    fn moe_combine_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    ) {
        moe::combine_forward(out.host_mut(), expert_out.host(), h, routing, dispatch)
    }
    fn moe_combine_backward(
        &self,
        d_expert_out: &mut DeviceSlice<f32>,
        d_gates: &mut DeviceSlice<f32>,
        d_out: &DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        routing: &Routing,
        dispatch: &Dispatch,
    ) {
        moe::combine_backward(
            d_expert_out.host_mut(),
            d_gates.host_mut(),
            d_out.host(),
            expert_out.host(),
            h,
            routing,
            dispatch,
        )
    }
    fn embedding_forward_slice(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    ) {
        embedding_forward_slice(x.host_mut(), table.host(), tokens.host(), h, v0)
    }
    fn embedding_backward_slice(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    ) {
        embedding_backward_slice(dtable.host_mut(), dx.host(), tokens.host(), h, v0)
    }
    fn logits_row_max(&self, out: &mut DeviceSlice<f32>, lg: &DeviceSlice<f32>, vl: usize) {
        out.host_mut()
            .copy_from_slice(&logits_row_max(lg.host(), vl));
    }
    fn max_over_ranks(
        &self,
        out: &mut DeviceSlice<f32>,
        gathered: &DeviceSlice<f32>,
        ranks: usize,
    ) {
        let (out, g) = (out.host_mut(), gathered.host());
        let n = out.len();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (0..ranks)
                .map(|r| g[r * n + i])
                .fold(f32::NEG_INFINITY, f32::max);
        }
    }
    fn logits_exp_stats(
        &self,
        out: &mut DeviceSlice<f32>,
        lg: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        row_max: &DeviceSlice<f32>,
        slice: (usize, usize),
    ) {
        let stats = logits_exp_stats(lg.host(), targets.host(), row_max.host(), slice);
        out.host_mut().copy_from_slice(&stats);
    }
    fn vocab_lse(
        &self,
        ledger: &Ledger,
        lse: &mut DeviceSlice<f64>,
        row_max: &DeviceSlice<f32>,
        stats: &DeviceSlice<f32>,
    ) -> f64 {
        let (lse, row_max, stats) = (lse.host_mut(), row_max.host(), stats.host());
        let n = lse.len();
        for (i, l) in lse.iter_mut().enumerate() {
            *l = row_max[i] as f64 + (stats[i] as f64).ln();
        }
        ledger.count_to_host("loss", 8);
        (0..n).map(|i| lse[i] - stats[n + i] as f64).sum::<f64>()
    }
    fn vocab_softmax_grad(
        &self,
        lg: &mut DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        lse: &DeviceSlice<f64>,
        slice: (usize, usize),
        scale: f32,
    ) {
        vocab_softmax_grad(lg.host_mut(), targets.host(), lse.host(), slice, scale)
    }
    fn bias_forward(&self, y: &mut DeviceSlice<f32>, b: &DeviceSlice<f32>) {
        bias_forward(y.host_mut(), b.host())
    }
    fn bias_backward(&self, db: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>) {
        bias_backward(db.host_mut(), dy.host())
    }
    fn add(&self, out: &mut DeviceSlice<f32>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>) {
        add(out.host_mut(), a.host(), b.host())
    }
    fn rmsnorm_apply(
        &self,
        y: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        rstd: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        h: usize,
    ) {
        rmsnorm_apply(y.host_mut(), x.host(), rstd.host(), w.host(), h)
    }
    fn sum_squares(&self, ledger: &Ledger, x: &DeviceSlice<f32>) -> f64 {
        ledger.count_to_host("grad norm", 8);
        sum_squares(x.host())
    }
    fn copy(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>) {
        elementwise::copy(dst.host_mut(), src.host())
    }
    fn copy_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<bf16>) {
        elementwise::copy(dst.host_mut(), src.host())
    }
    fn fill(&self, dst: &mut DeviceSlice<f32>, value: f32) {
        elementwise::fill(dst.host_mut(), value)
    }
    fn fill_bf16(&self, dst: &mut DeviceSlice<bf16>, value: bf16) {
        elementwise::fill(dst.host_mut(), value)
    }
    fn add_assign(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>) {
        elementwise::add_assign(dst.host_mut(), src.host())
    }
    fn add_assign_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>) {
        elementwise::add_assign_bf16(dst.host_mut(), src.host())
    }
    fn scale(&self, dst: &mut DeviceSlice<f32>, s: f32) {
        elementwise::scale(dst.host_mut(), s)
    }
    fn round_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>) {
        round_into(dst.host_mut(), src.host())
    }
    fn widen_bf16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<bf16>) {
        widen_into(dst.host_mut(), src.host())
    }
}
