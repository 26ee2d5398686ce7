//! The blocks' linear layers with FP8 operands (`train.fp8`), emulated: each operand is
//! copied through [`ferrotron_tensor::fp8::fake_quant`] (counted as workspace) before the
//! backend's f32 product. E4M3 for weights and activations, E5M2 for gradients. Rowwise
//! scales run along the dimension each product does not sum over: per token and per output
//! feature forward (`y = x·wᵀ`), per token and per input feature for the input gradient
//! (`dx = dy·w`), per feature of both for the weight gradient (`dw = dyᵀ·x`).

use ferrotron_config::Fp8;
use ferrotron_tensor::fp8::{Fp8Axis, Fp8Format, Fp8Quant};
use ferrotron_tensor::{Buf, Category, DeviceSlice, LinearShape, Operand};

use crate::ctx::StepCtx;

/// One operand `[rows, cols]` through FP8 in `format`, scaled along `axis` (rowwise) or whole
/// (tensorwise), as a new workspace buffer; `None` with FP8 off.
fn operand(
    ctx: &StepCtx<'_>,
    x: Operand<'_>,
    (rows, cols): (usize, usize),
    (format, axis): (Fp8Format, Fp8Axis),
) -> Option<Buf<f32>> {
    let axis = match ctx.fp8 {
        Fp8::Off => return None,
        Fp8::Tensorwise => Fp8Axis::Tensor,
        Fp8::Rowwise => axis,
    };
    let be = ctx.backend;
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
    let mut out = ctx.ledger.zeros::<f32>(Category::Workspace, src.len());
    let q = Fp8Quant {
        format,
        axis,
        rows,
        cols,
    };
    be.fp8_fake_quant(&mut out, src, q);
    Some(out)
}

/// The operand as the product reads it: the FP8 copy where there is one.
fn read<'a>(q: &'a Option<Buf<f32>>, x: Operand<'a>) -> Operand<'a> {
    q.as_deref().map_or(x, Operand::F32)
}

/// `y = x · wᵀ` (`x` `[t, in]`, `w` `[out, in]`).
pub(crate) fn forward(
    ctx: &StepCtx<'_>,
    y: &mut DeviceSlice<f32>,
    (x, w): (Operand<'_>, Operand<'_>),
    sh: LinearShape,
) {
    use Fp8Format::E4M3;
    let xq = operand(ctx, x, (sh.t, sh.d_in), (E4M3, Fp8Axis::Rows));
    let wq = operand(ctx, w, (sh.d_out, sh.d_in), (E4M3, Fp8Axis::Rows));
    ctx.backend
        .linear_forward(y, read(&xq, x), read(&wq, w), sh)
}

/// `dx (+)= dy · w` (`dy` `[t, out]`).
pub(crate) fn backward_input(
    ctx: &StepCtx<'_>,
    (dx, accumulate): (&mut DeviceSlice<f32>, bool),
    (dy, w): (Operand<'_>, Operand<'_>),
    sh: LinearShape,
) {
    let dq = operand(ctx, dy, (sh.t, sh.d_out), (Fp8Format::E5M2, Fp8Axis::Rows));
    let wq = operand(
        ctx,
        w,
        (sh.d_out, sh.d_in),
        (Fp8Format::E4M3, Fp8Axis::Cols),
    );
    ctx.backend
        .linear_backward_input(dx, read(&dq, dy), read(&wq, w), sh, accumulate)
}

/// `dw += dyᵀ · x`.
pub(crate) fn backward_weight(
    ctx: &StepCtx<'_>,
    dw: &mut DeviceSlice<f32>,
    (dy, x): (Operand<'_>, Operand<'_>),
    sh: LinearShape,
) {
    let dq = operand(ctx, dy, (sh.t, sh.d_out), (Fp8Format::E5M2, Fp8Axis::Cols));
    let xq = operand(ctx, x, (sh.t, sh.d_in), (Fp8Format::E4M3, Fp8Axis::Cols));
    ctx.backend
        .linear_backward_weight(dw, read(&dq, dy), read(&xq, x), sh)
}
