//! The LM head fused with cross-entropy on the CUDA backend (`xent.rs` of the CPU backend):
//! per chunk of tokens, the logits' product, the softmax and loss kernel (which leaves the
//! logits' gradient in place), and the head's two gradient products.

use ferrotron_tensor::xent::XentGrads;
use ferrotron_tensor::{Backend, Category, DeviceSlice, Ledger};

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
        w: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        (h, v, chunk): (usize, usize, usize),
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
            self.linear_forward(lg, x, w, n, h, v);
            let scale = grads.as_ref().map_or(0.0, |g| g.scale);
            launch!(self, "softmax_xent", per_row(n);
                at_mut(lg), at(&targets[start..start + n]), losses.ptr() + 8 * start as u64,
                v as u32, scale, grads.is_some() as i32);
            if let Some(g) = grads.as_mut() {
                self.linear_backward_input(
                    &mut g.dx[start * h..(start + n) * h],
                    lg,
                    w,
                    n,
                    h,
                    v,
                    false,
                );
                self.linear_backward_weight(g.dw, lg, x, n, h, v);
            }
        }
        self.sum_to_host(ledger, "loss", losses.ptr(), t)
    }
}
