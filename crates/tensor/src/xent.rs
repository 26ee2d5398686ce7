//! The LM head fused with cross-entropy, in chunks of tokens, so the full `[tokens, vocab]`
//! logits never exist: at most `chunk × vocab` floats of workspace at a time.
//!
//! Because the loss is the last operation, its gradient is known as soon as a chunk's logits
//! are: the backward of the head (input and weight gradients) runs chunk by chunk right
//! after the forward, and the logits are never kept for a later backward pass.

use rayon::prelude::*;

use crate::linear::{linear_backward_input, linear_backward_weight, linear_forward};
use crate::{Category, Ledger};

/// Gradient outputs of [`lm_head_xent`].
pub struct XentGrads<'a> {
    /// `d loss / d xn`, `[t, h]`, overwritten.
    pub dx: &'a mut [f32],
    /// `d loss / d W`, `[v, h]`, accumulated.
    pub dw: &'a mut [f32],
    /// Multiplier of every token's loss in the objective (e.g. 1 / tokens of the global batch).
    pub scale: f32,
}

/// Sum over tokens of `−log softmax(xn·Wᵀ)[target]` (f64), for `xn: [t, h]`, `w: [v, h]`.
/// With `grads`, also writes the gradients of `scale × that sum`.
pub fn lm_head_xent(
    ledger: &Ledger,
    xn: &[f32],
    w: &[f32],
    targets: &[u32],
    h: usize,
    v: usize,
    chunk: usize,
    mut grads: Option<XentGrads<'_>>,
) -> f64 {
    let t = targets.len();
    let chunk = chunk.max(1).min(t.max(1));
    let mut logits = ledger.zeros::<f32>(Category::Workspace, chunk * v);
    let mut total = 0.0f64;
    for start in (0..t).step_by(chunk) {
        let n = chunk.min(t - start);
        let x = &xn[start * h..(start + n) * h];
        let tg = &targets[start..start + n];
        let lg = &mut logits[..n * v];
        linear_forward(lg, x, w, n, h, v);
        let scale = grads.as_ref().map(|g| g.scale);
        // Per row: loss = logsumexp − logit[target]; in place, logits become
        // scale·(softmax − onehot) when a gradient is wanted.
        total += lg
            .par_chunks_mut(v)
            .zip(tg.par_iter())
            .map(|(row, &target)| {
                let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let sum: f64 = row.iter().map(|&z| ((z - max) as f64).exp()).sum();
                let lse = max as f64 + sum.ln();
                let loss = lse - row[target as usize] as f64;
                if let Some(scale) = scale {
                    for z in row.iter_mut() {
                        *z = ((*z as f64 - lse).exp() as f32) * scale;
                    }
                    row[target as usize] -= scale;
                }
                loss
            })
            .sum::<f64>();
        if let Some(g) = grads.as_mut() {
            linear_backward_input(&mut g.dx[start * h..(start + n) * h], lg, w, n, h, v, false);
            linear_backward_weight(g.dw, lg, x, n, h, v);
        }
    }
    total
}
