//! The LM head fused with cross-entropy on the CUDA backend (`xent.rs` of the CPU backend):
//! per chunk of tokens, the logits' product, the softmax and loss kernel (which leaves the
//! logits' gradient in place), and the head's two gradient products.

use ferrotron_tensor::kernels::Products;
use ferrotron_tensor::xent::XentGrads;
use ferrotron_tensor::{Category, DeviceSlice, HeadShape, Ledger, LinearShape, Operand};

use crate::backend::CudaBackend;
use crate::launch::{at, at_mut, launch, per_row};
use crate::memory::DeviceVec;

impl CudaBackend {
    /// See [`ferrotron_tensor::xent::lm_head_xent`]: `xn` `[t, h]`, `w` `[v, h]`, chunks of
    /// `chunk` tokens; the loss summed over tokens (f64).
    pub(crate) fn head_xent(
        &self,
        ledger: &Ledger,
        xn: &DeviceSlice<f32>,
        w: Operand<'_>,
        targets: &DeviceSlice<u32>,
        HeadShape { h, v, chunk }: HeadShape,
        mut grads: Option<XentGrads<'_, DeviceSlice<f32>>>,
    ) -> f64 {
        let t = targets.len();
        let chunk = chunk.max(1).min(t.max(1));
        // Each chunk's product overwrites the rows it uses.
        let mut logits = ledger.overwritten(Category::Workspace, chunk * v);
        let losses = DeviceVec::zeros(&self.memory, 8 * t.max(1));
        for start in (0..t).step_by(chunk) {
            let n = chunk.min(t - start);
            let x = &xn[start * h..(start + n) * h];
            let lg = &mut logits[..n * v];
            let sh = LinearShape::new(n, h, v);
            self.linear_forward(lg, x.operand(), w, sh);
            let scale = grads.as_ref().map_or(0.0, |g| g.scale);
            launch!(self, "softmax_xent", per_row(n);
                at_mut(lg), at(&targets[start..start + n]), losses.ptr() + 8 * start as u64,
                v as u32, scale, grads.is_some() as i32);
            if let Some(g) = grads.as_mut() {
                let dx = &mut g.dx[start * h..(start + n) * h];
                self.linear_backward_input(dx, lg.operand(), w, sh, false);
                self.linear_backward_weight(g.dw, lg.operand(), x.operand(), sh);
            }
        }
        self.sum_to_host(ledger, "loss", losses.ptr(), t)
    }
}
