//! The LM head fused with cross-entropy, in chunks of tokens, so the full `[tokens, vocab]`
//! logits never exist: at most `chunk × vocab` floats of workspace at a time.
//!
//! Because the loss is the last operation, its gradient is known as soon as a chunk's logits
//! are: the backward of the head (input and weight gradients) runs chunk by chunk right
//! after the forward, and the logits are never kept for a later backward pass.

use rayon::prelude::*;

use crate::backend::{HeadShape, LinearShape};
use crate::fastmath;
use crate::linear::{HostMatmul, HostOperand};
use crate::{Category, Ledger};

/// Gradient outputs of [`lm_head_xent`]: host slices for the kernel,
/// [`DeviceSlice`](crate::DeviceSlice)s through [`Backend`](crate::Backend).
pub struct XentGrads<'a, S: ?Sized = [f32]> {
    /// `d loss / d xn`, `[t, h]`, overwritten.
    pub dx: &'a mut S,
    /// `d loss / d W`, `[v, h]`, accumulated.
    pub dw: &'a mut S,
    /// Multiplier of every token's loss in the objective (e.g. 1 / tokens of the global batch).
    pub scale: f32,
}

/// Sum over tokens of `−log softmax(xn·Wᵀ)[target]` (f64), for `xn: [t, h]`, `w: [v, h]`.
/// With `grads`, also writes the gradients of `scale × that sum`.
pub fn lm_head_xent(
    mm: &HostMatmul,
    ledger: &Ledger,
    xn: &[f32],
    w: &[f32],
    targets: &[u32],
    h: usize,
    v: usize,
    chunk: usize,
    grads: Option<XentGrads<'_>>,
) -> f64 {
    let sh = HeadShape { h, v, chunk };
    lm_head_xent_operand(mm, ledger, (xn, HostOperand::F32(w)), targets, sh, grads)
}

/// [`lm_head_xent`] with the head's weight in either precision (bf16 read as stored by the
/// bf16 products).
pub fn lm_head_xent_operand(
    mm: &HostMatmul,
    ledger: &Ledger,
    (xn, w): (&[f32], HostOperand<'_>),
    targets: &[u32],
    HeadShape { h, v, chunk }: HeadShape,
    mut grads: Option<XentGrads<'_>>,
) -> f64 {
    let t = targets.len();
    let chunk = chunk.max(1).min(t.max(1));
    // Each chunk's product overwrites the rows it uses.
    let mut logits = ledger.overwritten(Category::Workspace, chunk * v);
    let mut total = 0.0f64;
    for start in (0..t).step_by(chunk) {
        let n = chunk.min(t - start);
        let x = &xn[start * h..(start + n) * h];
        let tg = &targets[start..start + n];
        let lg = logits[..n * v].host_mut();
        let sh = LinearShape::new(n, h, v);
        mm.forward(lg, HostOperand::F32(x), w, sh);
        let scale = grads.as_ref().map(|g| g.scale);
        // Per row: loss = logsumexp − logit[target]; in place, logits become
        // scale·(softmax − onehot) when a gradient is wanted.
        // Each row's loss in order, then their sum in order: the total does not depend on
        // how the rows were split over threads.
        let losses: Vec<f64> = lg
            .par_chunks_mut(v)
            .zip(tg.par_iter())
            .map(|(row, &target)| {
                let max = fastmath::max(row);
                let sum = fastmath::sum_exp_f64(row, max);
                let lse = max as f64 + sum.ln();
                let loss = lse - row[target as usize] as f64;
                if let Some(scale) = scale {
                    fastmath::exp_minus_f64(row, lse, scale);
                    row[target as usize] -= scale;
                }
                loss
            })
            .collect();
        total += losses.iter().sum::<f64>();
        if let Some(g) = grads.as_mut() {
            let dx = &mut g.dx[start * h..(start + n) * h];
            mm.backward_input((dx, false), HostOperand::F32(lg), w, sh);
            mm.linear_backward_weight(g.dw, lg, x, n, h, v);
        }
    }
    total
}

/// The maximum of each row of this rank's logits `lg` (`[n, vl]`): the first step of a
/// vocabulary-parallel log-sum-exp.
pub fn logits_row_max(lg: &[f32], vl: usize) -> Vec<f32> {
    lg.par_chunks(vl).map(fastmath::max).collect()
}

/// `[Σ_j exp(z_ij − max_i) over this slice ; the target's logit if this slice holds it]`
/// for each of the `n` rows of this rank's logits `lg` (`[n, vl]`, vocabulary rows
/// `[v0, v0 + vl)`), given every row's global maximum `row_max`: `2n` floats whose sum over
/// the vocabulary slices gives each row's sum of exponentials and target logit.
pub fn logits_exp_stats(
    lg: &[f32],
    targets: &[u32],
    row_max: &[f32],
    (vl, v0): (usize, usize),
) -> Vec<f32> {
    let n = targets.len();
    let mut stats = vec![0.0f32; 2 * n];
    for i in 0..n {
        let row = &lg[i * vl..(i + 1) * vl];
        stats[i] = fastmath::sum_exp_f64(row, row_max[i]) as f32;
        let target = targets[i] as usize;
        if (v0..v0 + vl).contains(&target) {
            stats[n + i] = row[target - v0];
        }
    }
    stats
}

/// Overwrites this rank's logits `lg` (`[n, vl]`, vocabulary rows `[v0, v0 + vl)`) with
/// `scale ×` the gradient of the token losses, `softmax − one-hot(target)`, from every row's
/// log-sum-exp over the whole vocabulary.
pub fn vocab_softmax_grad(
    lg: &mut [f32],
    targets: &[u32],
    lse: &[f64],
    (vl, v0): (usize, usize),
    scale: f32,
) {
    lg.par_chunks_mut(vl)
        .zip(targets.par_iter())
        .zip(lse.par_iter())
        .for_each(|((row, &target), &lse)| {
            fastmath::exp_minus_f64(row, lse, scale);
            let target = target as usize;
            if (v0..v0 + vl).contains(&target) {
                row[target - v0] -= scale;
            }
        });
}
