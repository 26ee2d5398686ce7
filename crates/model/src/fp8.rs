//! The blocks' linear layers with FP8 operands (`train.fp8`), emulated: each operand is
//! copied through FP8 ([`ferrotron_tensor::fp8`], counted as workspace) before the backend's
//! f32 product. E4M3 for weights and activations, E5M2 for gradients. Rowwise scales run
//! along the dimension each product does not sum over: per token and per output feature
//! forward (`y = x·wᵀ`), per token and per input feature for the input gradient
//! (`dx = dy·w`), per feature of both for the weight gradient (`dw = dyᵀ·x`).
//!
//! Under tensor parallelism an operand's scale is that of the whole tensor, as on one rank:
//! where a group of elements sharing a scale is split over the TP ranks, its largest
//! magnitude is the maximum over them (an all-gather of the group maxima, as
//! TransformerEngine reduces its amax over TP). Column-parallel layers (Q, K, V, gate, up)
//! split the weight's rows and the output gradient's columns; row-parallel ones (O, down)
//! split the input's and the weight's columns.

use ferrotron_config::Fp8;
use ferrotron_tensor::fp8::{groups, Fp8Axis, Fp8Format, Fp8Quant};
use ferrotron_tensor::{Buf, Category, DeviceSlice, LinearShape, Operand};

use crate::ctx::StepCtx;
use crate::layout::Split;
use crate::HookError;

use crate::fp8_history::Role;

/// Host transfers of the amax history's scales.
const AMAX: &str = "fp8 amax history";

/// A linear layer as FP8 sees it: how tensor parallelism splits its weight, and where the
/// weight starts in the rank's flat layout (its amax-history sites).
#[derive(Debug, Clone, Copy)]
pub struct Fp8Layer {
    /// The weight's tensor-parallel split.
    pub split: Split,
    /// The weight's flat offset in this rank's layout.
    pub at: usize,
}

/// Which dimension of an operand `[rows, cols]` tensor parallelism splits.
#[derive(Clone, Copy, PartialEq)]
enum Cut {
    None,
    Rows,
    Cols,
}

/// The cuts of a linear layer's `(x, w, dy)` for a parameter split `split`.
fn cuts(split: Split) -> (Cut, Cut, Cut) {
    match split {
        Split::Replicated => (Cut::None, Cut::None, Cut::None),
        // Column-parallel: output features split.
        Split::Rows => (Cut::None, Cut::Rows, Cut::Cols),
        // Row-parallel: input features split.
        Split::Cols => (Cut::Cols, Cut::Cols, Cut::None),
    }
}

/// One operand `[rows, cols]` cut by `cut` through FP8 in `format`, scaled along `axis`
/// (rowwise) or whole (tensorwise; by its amax history's largest with one, at `site`), as a
/// new workspace buffer; `None` with FP8 off.
fn operand(
    ctx: &StepCtx<'_>,
    x: Operand<'_>,
    (rows, cols, cut): (usize, usize, Cut),
    (format, axis, site): (Fp8Format, Fp8Axis, (usize, Role)),
) -> Result<Option<Buf<f32>>, HookError> {
    let axis = match ctx.fp8 {
        Fp8::Off => return Ok(None),
        Fp8::Tensorwise => Fp8Axis::Tensor,
        Fp8::Rowwise => axis,
    };
    let (be, dev) = (ctx.backend, ctx.device());
    let widened;
    let src: &DeviceSlice<f32> = match x {
        Operand::F32(s) => s,
        Operand::Bf16(s) => {
            let mut w = ctx.ledger.zeros::<f32>(Category::Workspace, s.len());
            be.widen_bf16(&mut w, s);
            widened = w;
            &widened
        }
    };
    let q = Fp8Quant {
        format,
        axis,
        rows,
        cols,
    };
    let mut amax = ctx.ledger.zeros::<f32>(Category::Workspace, groups(q));
    be.fp8_amax(&mut amax, src, q);
    // A group is split when the cut runs across it: the whole tensor, a row cut in columns,
    // a column cut in rows.
    let split = match (axis, cut) {
        (_, Cut::None) => false,
        (Fp8Axis::Tensor, _) => true,
        (Fp8Axis::Rows, c) => c == Cut::Cols,
        (Fp8Axis::Cols, c) => c == Cut::Rows,
    };
    if let Some(tp) = ctx.tp().filter(|tp| split && tp.size() > 1) {
        let all = tp.all_gather(dev, &amax)?;
        be.max_over_ranks(&mut amax, &all, tp.size());
    }
    let delayed = ctx
        .fp8_history
        .and_then(|h| Some((h, h.site(site.0, site.1)?)));
    if let Some((history, site)) = delayed.filter(|_| axis == Fp8Axis::Tensor) {
        let own = ctx.ledger.download(AMAX, &amax)[0];
        let used = history.scale_amax(site, own);
        ctx.ledger.upload_into(AMAX, &mut amax, &[used]);
    }
    let mut out = ctx.ledger.zeros::<f32>(Category::Workspace, src.len());
    be.fp8_apply(&mut out, src, &amax, q);
    Ok(Some(out))
}

/// The operand as the product reads it: the FP8 copy where there is one.
fn read<'a>(q: &'a Option<Buf<f32>>, x: Operand<'a>) -> Operand<'a> {
    q.as_deref().map_or(x, Operand::F32)
}

/// `y = x · wᵀ` (`x` `[t, in]`, `w` `[out, in]`) for a weight split `split`.
pub(crate) fn forward(
    ctx: &StepCtx<'_>,
    y: &mut DeviceSlice<f32>,
    (x, w, layer): (Operand<'_>, Operand<'_>, Fp8Layer),
    sh: LinearShape,
) -> Result<(), HookError> {
    let (cx, cw, _) = cuts(layer.split);
    let e4m3 = |role| (Fp8Format::E4M3, Fp8Axis::Rows, (layer.at, role));
    let xq = operand(ctx, x, (sh.t, sh.d_in, cx), e4m3(Role::ForwardInput))?;
    let wq = operand(ctx, w, (sh.d_out, sh.d_in, cw), e4m3(Role::ForwardWeight))?;
    ctx.backend
        .linear_forward(y, read(&xq, x), read(&wq, w), sh);
    Ok(())
}

/// `dx (+)= dy · w` (`dy` `[t, out]`).
pub(crate) fn backward_input(
    ctx: &StepCtx<'_>,
    (dx, accumulate): (&mut DeviceSlice<f32>, bool),
    (dy, w, layer): (Operand<'_>, Operand<'_>, Fp8Layer),
    sh: LinearShape,
) -> Result<(), HookError> {
    let (_, cw, cdy) = cuts(layer.split);
    let site = |role| (layer.at, role);
    let dq = operand(
        ctx,
        dy,
        (sh.t, sh.d_out, cdy),
        (Fp8Format::E5M2, Fp8Axis::Rows, site(Role::InputGradOutput)),
    )?;
    let wq = operand(
        ctx,
        w,
        (sh.d_out, sh.d_in, cw),
        (Fp8Format::E4M3, Fp8Axis::Cols, site(Role::InputGradWeight)),
    )?;
    ctx.backend
        .linear_backward_input(dx, read(&dq, dy), read(&wq, w), sh, accumulate);
    Ok(())
}

/// `dw += dyᵀ · x`.
pub(crate) fn backward_weight(
    ctx: &StepCtx<'_>,
    dw: &mut DeviceSlice<f32>,
    (dy, x, layer): (Operand<'_>, Operand<'_>, Fp8Layer),
    sh: LinearShape,
) -> Result<(), HookError> {
    let (cx, _, cdy) = cuts(layer.split);
    let site = |role| (layer.at, role);
    let dq = operand(
        ctx,
        dy,
        (sh.t, sh.d_out, cdy),
        (Fp8Format::E5M2, Fp8Axis::Cols, site(Role::WeightGradOutput)),
    )?;
    let xq = operand(
        ctx,
        x,
        (sh.t, sh.d_in, cx),
        (Fp8Format::E4M3, Fp8Axis::Cols, site(Role::WeightGradInput)),
    )?;
    ctx.backend
        .linear_backward_weight(dw, read(&dq, dy), read(&xq, x), sh);
    Ok(())
}
