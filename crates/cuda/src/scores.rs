//! Attention as batched products on a GPU (`train.attention = "products"`): the CUDA
//! backend's [`ScoreOps`] (cuBLASLt strided batches and the `scores.cu` row kernels) and the
//! scratch the plan runs in.

use cudarc::driver::DeviceRepr;
use ferrotron_tensor::attention::AttnShape;

use crate::backend::CudaBackend;
use crate::launch::{elementwise, launch, warp_per_row};
use crate::score_attention::{Backward, Batched, Forward, ScoreOps, ScorePlan, ScoreRows};

/// The row kernels' `ScoreRows` argument (`scores.cu`), passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Rows {
    count: u32,
    rows: u32,
    cols: u32,
    r0: u32,
    stat_stride: u32,
}

// SAFETY: `repr(C)` of five `u32`, the layout of the CUDA struct.
unsafe impl DeviceRepr for Rows {}

impl From<ScoreRows> for Rows {
    fn from(r: ScoreRows) -> Rows {
        Rows {
            count: r.count as u32,
            rows: r.rows as u32,
            cols: r.cols as u32,
            r0: r.r0 as u32,
            stat_stride: r.stat_stride as u32,
        }
    }
}

impl ScoreOps for CudaBackend {
    fn product(&self, g: Batched, a: u64, b: u64, c: u64, alpha: f32, beta: f32) {
        // The column-major call reads the row-major B first.
        self.batched_gemm(g.column_major(), [b, a, c], alpha, beta);
    }
    fn probs_forward(&self, r: ScoreRows, s: u64, lse: u64) {
        launch!(self, "scores_softmax", warp_per_row(r.count * r.rows); s, lse, Rows::from(r));
    }
    fn probs_again(&self, r: ScoreRows, s: u64, lse: u64) {
        launch!(self, "scores_probs", warp_per_row(r.count * r.rows); s, lse, Rows::from(r));
    }
    fn probs_grad(&self, r: ScoreRows, dp: u64, p: u64, delta: u64) {
        launch!(self, "scores_grad", warp_per_row(r.count * r.rows); dp, p, delta, Rows::from(r));
    }
    fn zero(&self, x: u64, elems: usize) {
        launch!(self, "fill_f32", elementwise(elems); x, 0.0f32, elems as u64);
    }
}

impl CudaBackend {
    /// The plan for `shape` in this rank's score scratch (`buffers` score buffers: 1 for the
    /// forward, 2 for the backward) and the scratch's address; `None` without a scratch
    /// (`train.attention = "tiles"`) or when not one row of the shape fits in it.
    pub(crate) fn score_plan(&self, shape: AttnShape, buffers: usize) -> Option<(ScorePlan, u64)> {
        let scratch = self.scores.as_ref()?;
        let per_row = buffers * shape.kv_heads * shape.seq;
        let fit = (scratch.bytes() / 4).checked_div(per_row)?;
        let rows = ferrotron_config::attention_score_rows(shape.seq, shape.kv_heads).min(fit);
        (rows > 0).then(|| (ScorePlan::with_rows(shape, rows), scratch.ptr()))
    }

    /// Attention's forward as batched products, if this rank has a score scratch.
    pub(crate) fn forward_by_products(&self, t: Forward, shape: AttnShape) -> bool {
        let Some((plan, s)) = self.score_plan(shape, 1) else {
            return false;
        };
        plan.forward(self, t, s);
        true
    }

    /// Attention's backward as batched products (`delta` already computed), if this rank
    /// has a score scratch.
    pub(crate) fn backward_by_products(&self, t: Backward, shape: AttnShape) -> bool {
        let Some((plan, s)) = self.score_plan(shape, 2) else {
            return false;
        };
        let dp = s + 4 * plan.score_elems() as u64;
        plan.backward(self, t, s, dp);
        true
    }
}
