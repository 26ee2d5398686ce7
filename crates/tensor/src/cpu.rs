//! The host backend: `gemm` matmuls and rayon element-wise loops on the current thread pool.
//! Its kernel families are split by file: products, norms, the loss and the optimizer here;
//! attention, the mixture of experts and the element-wise kernels in `cpu/`.

mod attention;
mod elementwise;
mod moe;

use std::ops::Range;

use crate::adamw::{adamw_update, sum_squares, sum_squares_bf16, AdamW, SQUARED_NORMS};
use crate::backend::{HeadShape, LinearShape, NormSaved, Operand};
use crate::kernels::{LossKernels, Norms, OptimizerKernels, Products};
use crate::linear::{bias_backward, bias_forward, HostMatmul, HostOperand};
use crate::muon::{muon_momentum, MuonMomentum};
use crate::product_rate::BestRate;
use crate::rmsnorm::{rmsnorm_apply, rmsnorm_backward, rmsnorm_forward};
use crate::xent::{
    lm_head_xent_operand, logits_exp_stats, logits_row_max, vocab_softmax_grad, XentGrads,
};
use crate::{Backend, DeviceSlice, Ledger};

/// Host kernels: matmuls on `gemm` (default) or OpenBLAS, rayon element-wise loops, all on
/// the current thread pool.
#[derive(Debug, Default, Clone)]
pub struct CpuBackend {
    matmul: HostMatmul,
    /// The best rate per thread of the products (shared by the clones).
    best: std::sync::Arc<BestRate>,
}

impl CpuBackend {
    /// The host backend with the linear layers' products on `matmul`.
    pub fn new(matmul: HostMatmul) -> CpuBackend {
        CpuBackend {
            matmul,
            best: Default::default(),
        }
    }

    /// Runs a product of `m × k × n` (2mkn FLOPs) on the current pool's threads, timed.
    fn timed<R>(&self, (m, k, n): (usize, usize, usize), product: impl FnOnce() -> R) -> R {
        let flops = 2.0 * m as f64 * k as f64 * n as f64;
        self.best.time(flops, rayon::current_num_threads(), product)
    }

    /// The library of the linear layers' products.
    pub fn matmul(&self) -> &HostMatmul {
        &self.matmul
    }
}

impl Backend for CpuBackend {}

/// The host memory of a device operand.
fn host(x: Operand<'_>) -> HostOperand<'_> {
    match x {
        Operand::F32(s) => HostOperand::F32(s.host()),
        Operand::Bf16(s) => HostOperand::Bf16(s.host()),
    }
}

impl Products for CpuBackend {
    fn reads_bf16(&self) -> bool {
        self.matmul.reads_bf16()
    }
    fn best_product_rate(&self) -> Option<f64> {
        self.best.best()
    }
    fn linear_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        x: Operand<'_>,
        w: Operand<'_>,
        sh: LinearShape,
    ) {
        self.timed((sh.t, sh.d_in, sh.d_out), || {
            self.matmul.forward(y.host_mut(), host(x), host(w), sh)
        })
    }
    fn linear_backward_input(
        &self,
        dx: &mut DeviceSlice<f32>,
        dy: Operand<'_>,
        w: Operand<'_>,
        sh: LinearShape,
        accumulate: bool,
    ) {
        let dx = (dx.host_mut(), accumulate);
        self.timed((sh.t, sh.d_out, sh.d_in), || {
            self.matmul.backward_input(dx, host(dy), host(w), sh)
        })
    }
    fn linear_backward_weight(
        &self,
        dw: &mut DeviceSlice<f32>,
        dy: Operand<'_>,
        x: Operand<'_>,
        sh: LinearShape,
    ) {
        self.timed((sh.d_out, sh.t, sh.d_in), || {
            self.matmul
                .backward_weight(dw.host_mut(), host(dy), host(x), sh)
        })
    }
    fn bias_forward(&self, y: &mut DeviceSlice<f32>, b: &DeviceSlice<f32>) {
        bias_forward(y.host_mut(), b.host())
    }
    fn bias_backward(&self, db: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>) {
        bias_backward(db.host_mut(), dy.host())
    }
}

impl Norms for CpuBackend {
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
        s: NormSaved<'_>,
        accumulate: bool,
    ) {
        let (dx, dw, dy) = (dx.host_mut(), dw.host_mut(), dy.host());
        let (x, rstd, w) = (s.x.host(), s.rstd.host(), s.w.host());
        rmsnorm_backward(dx, dw, dy, x, rstd, w, s.h, accumulate)
    }
    fn rmsnorm_apply(&self, y: &mut DeviceSlice<f32>, s: NormSaved<'_>) {
        rmsnorm_apply(y.host_mut(), s.x.host(), s.rstd.host(), s.w.host(), s.h)
    }
}

impl LossKernels for CpuBackend {
    fn lm_head_xent(
        &self,
        ledger: &Ledger,
        xn: &DeviceSlice<f32>,
        w: Operand<'_>,
        targets: &DeviceSlice<u32>,
        sh: HeadShape,
        grads: Option<XentGrads<'_, DeviceSlice<f32>>>,
    ) -> f64 {
        let grads = grads.map(|g| XentGrads {
            dx: g.dx.host_mut(),
            dw: g.dw.host_mut(),
            scale: g.scale,
        });
        let head = (xn.host(), host(w));
        // Timed as its products (forward, and the two backward ones with gradients): the
        // softmax in the same time only lowers the rate.
        let products = if grads.is_some() { 3 } else { 1 };
        let loss = self.timed((products * targets.len(), sh.h, sh.v), || {
            lm_head_xent_operand(&self.matmul, ledger, head, targets.host(), sh, grads)
        });
        ledger.count_to_host("loss", 8);
        loss
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
}

impl OptimizerKernels for CpuBackend {
    fn adamw(
        &self,
        param: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        v: &mut DeviceSlice<f32>,
        grad_scale: f32,
        hyper: AdamW,
    ) {
        let (param, grad) = (param.host_mut(), grad.host());
        adamw_update(param, grad, m.host_mut(), v.host_mut(), grad_scale, hyper)
    }
    fn muon_momentum(
        &self,
        u: &mut DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        grad_scale: f32,
        hyper: MuonMomentum,
    ) {
        muon_momentum(u.host_mut(), m.host_mut(), grad.host(), grad_scale, hyper)
    }
    fn sum_squares(&self, ledger: &Ledger, x: &DeviceSlice<f32>) -> f64 {
        ledger.count_to_host("grad norm", 8);
        sum_squares(x.host())
    }
    fn sum_squares_ranges(
        &self,
        ledger: &Ledger,
        x: Operand<'_>,
        ranges: &[Range<usize>],
    ) -> Vec<f64> {
        ledger.count_to_host(SQUARED_NORMS, 8 * ranges.len());
        let norm = |r: &Range<usize>| match x {
            Operand::F32(s) => sum_squares(&s.host()[r.clone()]),
            Operand::Bf16(s) => sum_squares_bf16(&s.host()[r.clone()]),
        };
        ranges.iter().map(norm).collect()
    }
}
