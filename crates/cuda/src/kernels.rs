//! The kernel families of [`Backend`] for [`CudaBackend`]: each kernel of the step as a launch
//! on the rank's stream. Layouts and semantics are those of the CPU kernels named in each
//! method's trait docs.

use std::ops::Range;

use ferrotron_tensor::adamw::{AdamW, SQUARED_NORMS};
use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::fp8::{Fp8Axis, Fp8Format, Fp8Quant};
use ferrotron_tensor::kernels::*;
use ferrotron_tensor::moe::{self, AuxStats, Dispatch, Routing};
use ferrotron_tensor::muon::MuonMomentum;
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::rope::RopeTable;
use ferrotron_tensor::xent::XentGrads;
use ferrotron_tensor::{bf16, f16, DeviceSlice, Ledger, RingBlock};
use ferrotron_tensor::{AttnGrads, AuxLoss, HeadShape, KvBlock, LinearShape, NormSaved};
use ferrotron_tensor::{Operand, RouteShape, Routed};

use crate::backend::CudaBackend;
use crate::blas::Gemm;
use crate::launch::{at, at_mut, column_blocks, elementwise, launch, per_row, warp_per_row};
use crate::memory::DeviceVec;

impl Backend for CudaBackend {
    fn synchronize(&self) {
        ferrotron_tensor::memory::DeviceMemory::synchronize(&*self.memory)
    }
    fn memory(&self) -> Option<std::sync::Arc<dyn ferrotron_tensor::memory::DeviceMemory>> {
        Some(self.memory.clone())
    }
}

impl Products for CudaBackend {
    fn reads_bf16(&self) -> bool {
        self.bf16.is_some()
    }
    fn linear_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        x: Operand<'_>,
        w: Operand<'_>,
        sh: LinearShape,
    ) {
        let LinearShape { t, d_in, d_out } = sh;
        debug_assert_eq!((w.len(), x.len()), (d_out * d_in, t * d_in));
        self.product(Gemm::forward(t, d_in, d_out), w, x, at_mut(y), 0.0)
    }
    fn linear_backward_input(
        &self,
        dx: &mut DeviceSlice<f32>,
        dy: Operand<'_>,
        w: Operand<'_>,
        sh: LinearShape,
        accumulate: bool,
    ) {
        let LinearShape { t, d_in, d_out } = sh;
        let beta = if accumulate { 1.0 } else { 0.0 };
        debug_assert_eq!((w.len(), dy.len()), (d_out * d_in, t * d_out));
        self.product(
            Gemm::backward_input(t, d_in, d_out),
            w,
            dy,
            at_mut(dx),
            beta,
        )
    }
    fn linear_backward_weight(
        &self,
        dw: &mut DeviceSlice<f32>,
        dy: Operand<'_>,
        x: Operand<'_>,
        sh: LinearShape,
    ) {
        let LinearShape { t, d_in, d_out } = sh;
        debug_assert_eq!((x.len(), dy.len()), (t * d_in, t * d_out));
        self.product(
            Gemm::backward_weight(t, d_in, d_out),
            x,
            dy,
            at_mut(dw),
            1.0,
        )
    }
    fn bias_forward(&self, y: &mut DeviceSlice<f32>, b: &DeviceSlice<f32>) {
        let (n, total) = (b.len(), y.len());
        assert!(
            n > 0 && total.is_multiple_of(n),
            "bias_forward: rows of {n}"
        );
        launch!(self, "bias_forward_f32", elementwise(total); at_mut(y), at(b), n as u64, total as u64);
    }
    fn bias_backward(&self, db: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>) {
        let n = db.len();
        assert!(
            n > 0 && dy.len().is_multiple_of(n),
            "bias_backward: rows of {n}"
        );
        let rows = dy.len() / n;
        launch!(self, "bias_backward_f32", elementwise(n); at_mut(db), at(dy), n as u64, rows as u64);
    }
}

impl Norms for CudaBackend {
    fn rmsnorm_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        rstd: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        w: &DeviceSlice<f32>,
        h: usize,
        eps: f32,
    ) {
        let rows = x.len() / h;
        launch!(self, "rmsnorm_forward", per_row(rows); at_mut(y), at_mut(rstd), at(x), at(w), h as u32, eps);
    }
    fn rmsnorm_backward(
        &self,
        dx: &mut DeviceSlice<f32>,
        dw: &mut DeviceSlice<f32>,
        dy: &DeviceSlice<f32>,
        s: NormSaved<'_>,
        accumulate: bool,
    ) {
        let (h, rows) = (s.h, s.x.len() / s.h);
        launch!(self, "rmsnorm_backward_input", per_row(rows);
            at_mut(dx), at(dy), at(s.x), at(s.rstd), at(s.w), h as u32, accumulate as i32);
        launch!(self, "rmsnorm_backward_weight", column_blocks(h);
            at_mut(dw), at(dy), at(s.x), at(s.rstd), rows as u32, h as u32);
    }
    fn rmsnorm_apply(&self, y: &mut DeviceSlice<f32>, s: NormSaved<'_>) {
        let (h, rows) = (s.h, s.x.len() / s.h);
        launch!(self, "rmsnorm_apply", per_row(rows); at_mut(y), at(s.x), at(s.rstd), at(s.w), h as u32);
    }
}

impl AttentionKernels for CudaBackend {
    fn rope(
        &self,
        x: &mut DeviceSlice<f32>,
        positions: &[usize],
        heads: usize,
        table: &RopeTable,
        inverse: bool,
    ) {
        self.rope_launch(x, positions, heads, table, inverse)
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
        self.whole_forward(out, lse, q, k, v, shape)
    }
    fn attention_backward(
        &self,
        grads: AttnGrads<'_>,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        saved: AttnSaved<'_, DeviceSlice<f32>>,
        shape: AttnShape,
    ) {
        self.whole_backward(grads, delta, dout, saved, shape)
    }
    fn attention_block_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        block: KvBlock<'_>,
    ) {
        self.block_forward(out, lse, q, k, v, block)
    }
    fn attention_merge(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        part_out: &DeviceSlice<f32>,
        part_lse: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        self.merge_partial(out, lse, part_out, part_lse, sh)
    }
    fn attention_delta(
        &self,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        out: &DeviceSlice<f32>,
        sh: BlockShape,
    ) {
        self.delta_of(delta, dout, out, sh)
    }
    fn attention_block_backward(
        &self,
        grads: AttnGrads<'_>,
        dout: &DeviceSlice<f32>,
        s: RingBlock<'_>,
        block: KvBlock<'_>,
    ) {
        self.block_backward(grads, dout, s, block)
    }
}

impl MoeKernels for CudaBackend {
    fn moe_route(
        &self,
        ledger: &Ledger,
        logits: &DeviceSlice<f32>,
        bias: Option<&[f32]>,
        sh: RouteShape,
    ) -> Routing {
        let host = ledger.download("expert routing", logits);
        moe::route_biased(&host, bias, sh.t, sh.experts, sh.top_k)
    }
    fn moe_route_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        d_gates: &DeviceSlice<f32>,
        routing: &Routing,
        sh: RouteShape,
    ) {
        let mut dz = vec![0.0f32; d_logits.len()];
        let dg = self.fetch(d_gates);
        moe::route_backward(&mut dz, &dg, routing, sh.t, sh.experts, sh.top_k);
        self.store(d_logits, &dz);
    }
    fn moe_aux_stats(&self, routing: &Routing, sh: RouteShape) -> AuxStats {
        moe::aux_stats(routing, sh.t, sh.experts, sh.top_k)
    }
    fn moe_aux_loss_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        aux: AuxLoss<'_>,
        routing: &Routing,
        sh: RouteShape,
    ) {
        let mut dz = self.fetch(d_logits);
        let AuxLoss {
            coef,
            stats,
            tokens,
        } = aux;
        moe::aux_loss_backward(&mut dz, coef, stats, tokens, routing, sh.t, sh.experts);
        self.store(d_logits, &dz);
    }
    fn moe_gather_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    ) {
        let tables = self.moe_tables(dispatch, None);
        let rows = dispatch.token_table().len();
        launch!(self, "moe_gather_rows", elementwise(rows * h);
            at_mut(dst), at(src), tables.token.ptr(), rows as u32, h as u32);
    }
    fn moe_scatter_add_rows(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        h: usize,
        dispatch: &Dispatch,
    ) {
        let tables = self.moe_tables(dispatch, None);
        let (t, k) = (dst.len() / h, dispatch.top_k());
        launch!(self, "moe_scatter_add_rows", elementwise(t * h);
            at_mut(dst), at(src), tables.row.ptr(), t as u32, h as u32, k as u32);
    }
    fn moe_combine_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        r: Routed<'_>,
    ) {
        let tables = self.moe_tables(r.dispatch, Some(r.routing));
        let gates = tables.gates.as_ref().map_or(0, DeviceVec::ptr);
        let (t, k) = (out.len() / h, r.dispatch.top_k());
        launch!(self, "moe_combine_forward", elementwise(t * h);
            at_mut(out), at(expert_out), tables.row.ptr(), gates, t as u32, h as u32, k as u32);
    }
    fn moe_combine_backward(
        &self,
        d_expert_out: &mut DeviceSlice<f32>,
        d_gates: &mut DeviceSlice<f32>,
        d_out: &DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        r: Routed<'_>,
    ) {
        let tables = self.moe_tables(r.dispatch, Some(r.routing));
        let gates = tables.gates.as_ref().map_or(0, DeviceVec::ptr);
        let (t, k) = (d_out.len() / h, r.dispatch.top_k());
        launch!(self, "moe_combine_backward", warp_per_row(t * k);
            at_mut(d_expert_out), at_mut(d_gates), at(d_out), at(expert_out), tables.row.ptr(),
            gates, t as u32, h as u32, k as u32);
    }
}

impl LossKernels for CudaBackend {
    fn lm_head_xent(
        &self,
        ledger: &Ledger,
        xn: &DeviceSlice<f32>,
        w: Operand<'_>,
        targets: &DeviceSlice<u32>,
        sh: HeadShape,
        grads: Option<XentGrads<'_, DeviceSlice<f32>>>,
    ) -> f64 {
        self.head_xent(ledger, xn, w, targets, sh, grads)
    }
    fn logits_row_max(&self, out: &mut DeviceSlice<f32>, lg: &DeviceSlice<f32>, vl: usize) {
        launch!(self, "logits_row_max", per_row(out.len()); at_mut(out), at(lg), vl as u32);
    }
    fn max_over_ranks(
        &self,
        out: &mut DeviceSlice<f32>,
        gathered: &DeviceSlice<f32>,
        ranks: usize,
    ) {
        let n = out.len();
        launch!(self, "max_over_ranks", elementwise(n); at_mut(out), at(gathered), n as u32, ranks as u32);
    }
    fn logits_exp_stats(
        &self,
        out: &mut DeviceSlice<f32>,
        lg: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        row_max: &DeviceSlice<f32>,
        (vl, v0): (usize, usize),
    ) {
        let n = targets.len();
        launch!(self, "logits_exp_stats", per_row(n);
            at_mut(out), at(lg), at(targets), at(row_max), n as u32, vl as u32, v0 as u32);
    }
    fn vocab_lse(
        &self,
        ledger: &Ledger,
        lse: &mut DeviceSlice<f64>,
        row_max: &DeviceSlice<f32>,
        stats: &DeviceSlice<f32>,
    ) -> f64 {
        let n = lse.len();
        let losses = DeviceVec::zeros(&self.memory, 8 * n.max(1));
        launch!(self, "vocab_lse", elementwise(n); at_mut(lse), losses.ptr(), at(row_max), at(stats), n as u32);
        self.sum_to_host(ledger, "loss", losses.ptr(), n)
    }
    fn vocab_softmax_grad(
        &self,
        lg: &mut DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        lse: &DeviceSlice<f64>,
        (vl, v0): (usize, usize),
        scale: f32,
    ) {
        let n = targets.len();
        launch!(self, "vocab_softmax_grad", elementwise(n * vl);
            at_mut(lg), at(targets), at(lse), n as u32, vl as u32, v0 as u32, scale);
    }
}

impl Elementwise for CudaBackend {
    fn swiglu_forward(
        &self,
        act: &mut DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    ) {
        let n = act.len();
        launch!(self, "swiglu_forward", elementwise(n); at_mut(act), at(gate), at(up), n as u64);
    }
    fn swiglu_backward(
        &self,
        dgate: &mut DeviceSlice<f32>,
        dup: &mut DeviceSlice<f32>,
        dact: &DeviceSlice<f32>,
        gate: &DeviceSlice<f32>,
        up: &DeviceSlice<f32>,
    ) {
        let n = dact.len();
        launch!(self, "swiglu_backward", elementwise(n);
            at_mut(dgate), at_mut(dup), at(dact), at(gate), at(up), n as u64);
    }
    fn embedding_forward(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    ) {
        self.embedding_forward_slice(x, table, tokens, h, 0)
    }
    fn embedding_backward(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
    ) {
        self.embedding_backward_slice(dtable, dx, tokens, h, 0)
    }
    fn embedding_forward_slice(
        &self,
        x: &mut DeviceSlice<f32>,
        table: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    ) {
        let (t, vl) = (tokens.len(), table.len() / h);
        launch!(self, "embedding_forward", elementwise(t * h);
            at_mut(x), at(table), at(tokens), t as u32, h as u32, v0 as u32, vl as u32);
    }
    fn embedding_backward_slice(
        &self,
        dtable: &mut DeviceSlice<f32>,
        dx: &DeviceSlice<f32>,
        tokens: &DeviceSlice<u32>,
        h: usize,
        v0: usize,
    ) {
        let (t, vl) = (tokens.len(), dtable.len() / h);
        launch!(self, "embedding_backward", elementwise(t * h);
            at_mut(dtable), at(dx), at(tokens), t as u32, h as u32, v0 as u32, vl as u32);
    }
    fn add(&self, out: &mut DeviceSlice<f32>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>) {
        let n = out.len();
        launch!(self, "add_f32", elementwise(n); at_mut(out), at(a), at(b), n as u64);
    }
    fn copy(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>) {
        let n = dst.len();
        assert_eq!(n, src.len(), "copy: lengths differ");
        launch!(self, "copy_f32", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn copy_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<bf16>) {
        let n = dst.len();
        assert_eq!(n, src.len(), "copy_bf16: lengths differ");
        launch!(self, "copy_bf16", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn fill(&self, dst: &mut DeviceSlice<f32>, value: f32) {
        let n = dst.len();
        launch!(self, "fill_f32", elementwise(n); at_mut(dst), value, n as u64);
    }
    fn fill_bf16(&self, dst: &mut DeviceSlice<bf16>, value: bf16) {
        let n = dst.len();
        launch!(self, "fill_bf16", elementwise(n); at_mut(dst), value.to_bits(), n as u64);
    }
    fn add_assign(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>) {
        let n = dst.len();
        launch!(self, "add_assign_f32", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn add_assign_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>) {
        let n = dst.len();
        launch!(self, "add_assign_bf16", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn scale(&self, dst: &mut DeviceSlice<f32>, s: f32) {
        let n = dst.len();
        launch!(self, "scale_f32", elementwise(n); at_mut(dst), s, n as u64);
    }
    fn round_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>) {
        let n = dst.len();
        launch!(self, "round_bf16", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn widen_bf16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<bf16>) {
        let n = dst.len();
        launch!(self, "widen_bf16", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn fill_f16(&self, dst: &mut DeviceSlice<f16>, value: f16) {
        let n = dst.len();
        launch!(self, "fill_f16", elementwise(n); at_mut(dst), value.to_bits(), n as u64);
    }
    fn add_assign_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>) {
        let n = dst.len();
        launch!(self, "add_assign_f16", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn round_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>) {
        let n = dst.len();
        launch!(self, "round_f16", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn widen_f16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f16>) {
        let n = dst.len();
        launch!(self, "widen_f16", elementwise(n); at_mut(dst), at(src), n as u64);
    }
    fn fp8_amax(&self, out: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, q: Fp8Quant) {
        // One block per group: the tensor, a row or a column (`stride` apart, `len` long).
        let (groups, len, stride, step) = match q.axis {
            Fp8Axis::Tensor => (1, q.rows * q.cols, 1, 0),
            Fp8Axis::Rows => (q.rows, q.cols, 1, q.cols),
            Fp8Axis::Cols => (q.cols, q.rows, q.cols, 1),
        };
        launch!(self, "fp8_amax", per_row(groups);
            at_mut(out), at(src), len as u32, stride as u32, step as u32);
    }
    fn fp8_apply(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        amax: &DeviceSlice<f32>,
        q: Fp8Quant,
    ) {
        let n = dst.len();
        let axis: i32 = match q.axis {
            Fp8Axis::Tensor => 0,
            Fp8Axis::Rows => 1,
            Fp8Axis::Cols => 2,
        };
        let (e4m3, max) = (q.format == Fp8Format::E4M3, q.format.max());
        launch!(self, "fp8_apply", elementwise(n);
            at_mut(dst), at(src), at(amax), n as u64, q.cols as u32, axis, e4m3 as i32, max);
    }
}

impl OptimizerKernels for CudaBackend {
    fn adamw(
        &self,
        param: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        v: &mut DeviceSlice<f32>,
        grad_scale: f32,
        hyper: AdamW,
    ) {
        self.adamw_launch(param, grad, m, v, grad_scale, hyper)
    }
    fn muon_momentum(
        &self,
        u: &mut DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        grad_scale: f32,
        hyper: MuonMomentum,
    ) {
        let n = u.len();
        launch!(self, "muon_momentum", elementwise(n);
            at_mut(u), at_mut(m), at(grad), n as u64, grad_scale, hyper.beta,
            hyper.nesterov as i32);
    }
    fn sum_squares(&self, ledger: &Ledger, x: &DeviceSlice<f32>) -> f64 {
        let n = x.len();
        let cfg = elementwise(n.min(1024 * 256));
        let blocks = cfg.grid_dim.0 as usize;
        let partial = DeviceVec::zeros(&self.memory, 8 * blocks);
        launch!(self, "sum_squares_partial", cfg; partial.ptr(), at(x), n as u64);
        self.sum_to_host(ledger, "grad norm", partial.ptr(), blocks)
    }
    fn sum_squares_ranges(
        &self,
        ledger: &Ledger,
        x: Operand<'_>,
        ranges: &[Range<usize>],
    ) -> Vec<f64> {
        // Each range's per-block partials (as `sum_squares`), summed on the device into one
        // slot of `out`; every buffer lives until the one download, which waits for them.
        let configs: Vec<_> = ranges
            .iter()
            .map(|r| elementwise(r.len().min(1024 * 256)))
            .collect();
        let blocks: Vec<usize> = configs.iter().map(|c| c.grid_dim.0 as usize).collect();
        let partial = DeviceVec::zeros(&self.memory, 8 * blocks.iter().sum::<usize>().max(1));
        let out = DeviceVec::zeros(&self.memory, 8 * ranges.len().max(1));
        let mut at_partial = partial.ptr();
        for (i, (r, cfg)) in ranges.iter().zip(configs).enumerate() {
            let n = r.len() as u64;
            match x {
                Operand::F32(s) => {
                    launch!(self, "sum_squares_partial", cfg; at_partial, at(&s[r.clone()]), n)
                }
                Operand::Bf16(s) => {
                    launch!(self, "sum_squares_partial_bf16", cfg; at_partial, at(&s[r.clone()]), n)
                }
            }
            launch!(self, "sum_f64", per_row(1); out.ptr() + 8 * i as u64, at_partial, blocks[i] as u32);
            at_partial += 8 * blocks[i] as u64;
        }
        ledger.count_to_host(SQUARED_NORMS, 8 * ranges.len());
        out.download::<f64>(ranges.len())
    }
}
