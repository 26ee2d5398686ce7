//! The kernel families of [`Backend`](super::Backend), one trait each.

use super::{AttnGrads, AuxLoss, HeadShape, KvBlock, LinearShape, NormSaved, RingBlock};
use super::{Operand, RouteShape, Routed};
use crate::adamw::AdamW;
use crate::attention::{AttnSaved, AttnShape};
use crate::fp8::Fp8Quant;
use crate::moe::{AuxStats, Dispatch, Routing};
use crate::muon::MuonMomentum;
use crate::ring_attention::BlockShape;
use crate::rope::RopeTable;
use crate::xent::XentGrads;
use crate::{bf16, f16, DeviceSlice, Ledger};
use std::ops::Range;

/// Matrix products: the linear layers and their biases. Their inputs are [`Operand`]s, f32
/// or bf16 as stored; the outputs are f32.
pub trait Products {
    /// Whether the products read a bf16 operand as it is stored (bf16 products on tensor
    /// cores or AVX-512 BF16), so that a caller holding a bf16 tensor passes it without a
    /// widened f32 copy. A backend that answers `false` still takes bf16 operands, widening
    /// them first into memory outside the ledger: callers widen them themselves instead.
    fn reads_bf16(&self) -> bool {
        false
    }
    /// The best FLOP/s per compute thread one of the linear products reached so far (None
    /// where they are not timed: on a GPU they run asynchronously). A run's MFU denominator
    /// is never below it times the threads the run occupies.
    fn best_product_rate(&self) -> Option<f64> {
        None
    }
    /// See [`linear_forward`](crate::linear::linear_forward): `y = x · wᵀ`.
    fn linear_forward(
        &self,
        y: &mut DeviceSlice<f32>,
        x: Operand<'_>,
        w: Operand<'_>,
        sh: LinearShape,
    );
    /// See [`linear_backward_input`](crate::linear::linear_backward_input): `dx (+)= dy · w`.
    fn linear_backward_input(
        &self,
        dx: &mut DeviceSlice<f32>,
        dy: Operand<'_>,
        w: Operand<'_>,
        sh: LinearShape,
        accumulate: bool,
    );
    /// See [`linear_backward_weight`](crate::linear::linear_backward_weight):
    /// `dw += dyᵀ · x`.
    fn linear_backward_weight(
        &self,
        dw: &mut DeviceSlice<f32>,
        dy: Operand<'_>,
        x: Operand<'_>,
        sh: LinearShape,
    );
    /// See [`bias_forward`](crate::linear::bias_forward): `y[i, :] += b`.
    fn bias_forward(&self, y: &mut DeviceSlice<f32>, b: &DeviceSlice<f32>);
    /// See [`bias_backward`](crate::linear::bias_backward): `db += Σ_i dy[i, :]`.
    fn bias_backward(&self, db: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>);
}

/// RMSNorm, forward, backward and re-applied.
pub trait Norms {
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
    /// See [`rmsnorm_backward`](crate::rmsnorm::rmsnorm_backward): `dx` (overwritten, or
    /// added to with `accumulate`) and `dw` (added to).
    fn rmsnorm_backward(
        &self,
        dx: &mut DeviceSlice<f32>,
        dw: &mut DeviceSlice<f32>,
        dy: &DeviceSlice<f32>,
        saved: NormSaved<'_>,
        accumulate: bool,
    );
    /// See [`rmsnorm_apply`](crate::rmsnorm::rmsnorm_apply): the forward again from its
    /// saved statistics.
    fn rmsnorm_apply(&self, y: &mut DeviceSlice<f32>, saved: NormSaved<'_>);
}

/// Attention: whole causal sequences, ring attention's blocks, and RoPE.
pub trait AttentionKernels {
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
        grads: AttnGrads<'_>,
        delta: &mut DeviceSlice<f32>,
        dout: &DeviceSlice<f32>,
        saved: AttnSaved<'_, DeviceSlice<f32>>,
        shape: AttnShape,
    );
    /// See [`crate::ring_attention::block_forward`]: one key/value block of ring attention.
    fn attention_block_forward(
        &self,
        out: &mut DeviceSlice<f32>,
        lse: &mut DeviceSlice<f32>,
        q: &DeviceSlice<f32>,
        k: &DeviceSlice<f32>,
        v: &DeviceSlice<f32>,
        block: KvBlock<'_>,
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
        grads: AttnGrads<'_>,
        dout: &DeviceSlice<f32>,
        saved: RingBlock<'_>,
        block: KvBlock<'_>,
    );
}

/// A mixture of experts: routing, its statistics, and moving rows to and from the experts.
pub trait MoeKernels {
    /// See [`crate::moe::route_biased`]: `bias` is aux-loss-free balancing's per-expert bias
    /// (None: [`crate::moe::route`]).
    fn moe_route(
        &self,
        ledger: &Ledger,
        logits: &DeviceSlice<f32>,
        bias: Option<&[f32]>,
        sh: RouteShape,
    ) -> Routing;
    /// See [`crate::moe::route_backward`].
    fn moe_route_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        d_gates: &DeviceSlice<f32>,
        routing: &Routing,
        sh: RouteShape,
    );
    /// See [`crate::moe::aux_stats`].
    fn moe_aux_stats(&self, routing: &Routing, sh: RouteShape) -> AuxStats;
    /// See [`crate::moe::aux_loss_backward`].
    fn moe_aux_loss_backward(
        &self,
        d_logits: &mut DeviceSlice<f32>,
        aux: AuxLoss<'_>,
        routing: &Routing,
        sh: RouteShape,
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
        routed: Routed<'_>,
    );
    /// See [`crate::moe::combine_backward`].
    fn moe_combine_backward(
        &self,
        d_expert_out: &mut DeviceSlice<f32>,
        d_gates: &mut DeviceSlice<f32>,
        d_out: &DeviceSlice<f32>,
        expert_out: &DeviceSlice<f32>,
        h: usize,
        routed: Routed<'_>,
    );
}

/// The LM head with its cross-entropy, whole or split over a vocabulary-parallel group.
pub trait LossKernels {
    /// See [`lm_head_xent`](crate::xent::lm_head_xent).
    fn lm_head_xent(
        &self,
        ledger: &Ledger,
        xn: &DeviceSlice<f32>,
        w: Operand<'_>,
        targets: &DeviceSlice<u32>,
        sh: HeadShape,
        grads: Option<XentGrads<'_, DeviceSlice<f32>>>,
    ) -> f64;
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
}

/// Element-wise and row-gathering kernels: SwiGLU, embeddings, residual adds, copies, fills
/// and casts.
pub trait Elementwise {
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
    /// See [`add`](crate::elementwise::add): the residual add.
    fn add(&self, out: &mut DeviceSlice<f32>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>);
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
    /// Every element of `dst` set to `value` (IEEE half).
    fn fill_f16(&self, dst: &mut DeviceSlice<f16>, value: f16);
    /// `dst = round(dst + src)` for an IEEE-half `dst` (accumulated in f32, rounded once).
    fn add_assign_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>);
    /// The cast f32 → IEEE half (round to nearest even: from ±65520 on to ±∞, below 2⁻¹⁴ to
    /// subnormals and zero).
    fn round_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>);
    /// The cast IEEE half → f32 (exact).
    fn widen_f16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f16>);
    /// See [`group_amax`](crate::fp8::group_amax): the largest magnitude of every group of
    /// an FP8 operand.
    fn fp8_amax(&self, out: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, q: Fp8Quant);
    /// See [`apply_scales`](crate::fp8::apply_scales): `src` through FP8 into `dst` at the
    /// scales of the groups' maxima `amax`.
    fn fp8_apply(
        &self,
        dst: &mut DeviceSlice<f32>,
        src: &DeviceSlice<f32>,
        amax: &DeviceSlice<f32>,
        q: Fp8Quant,
    );
}

/// The optimizer's kernels: the AdamW update and the squared norm for clipping.
pub trait OptimizerKernels {
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
    /// See [`muon_momentum`](crate::muon::muon_momentum): Muon's momentum and the update it
    /// orthogonalises, written into `u`.
    fn muon_momentum(
        &self,
        u: &mut DeviceSlice<f32>,
        m: &mut DeviceSlice<f32>,
        grad: &DeviceSlice<f32>,
        grad_scale: f32,
        hyper: MuonMomentum,
    );
    /// See [`sum_squares`](crate::adamw::sum_squares): a squared norm for clipping, a host
    /// value counted on `ledger` as `"grad norm"`.
    fn sum_squares(&self, ledger: &Ledger, x: &DeviceSlice<f32>) -> f64;
    /// The squared norm of each of `ranges` of `x`, as [`OptimizerKernels::sum_squares`]
    /// computes each (the same value, bit for bit, for f32 or widened bf16 elements), all
    /// brought to the host in one transfer counted on `ledger` as
    /// [`SQUARED_NORMS`](crate::adamw::SQUARED_NORMS): the clipping's one readback a step.
    fn sum_squares_ranges(
        &self,
        ledger: &Ledger,
        x: Operand<'_>,
        ranges: &[Range<usize>],
    ) -> Vec<f64>;
}
