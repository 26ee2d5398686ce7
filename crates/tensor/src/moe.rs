//! The routing math of a Mixtral-style mixture-of-experts layer, forward and backward.
//!
//! The pieces, in the order a layer uses them (`t` tokens of width `h`, `E` experts, top-`k`):
//!
//! 1. The caller computes router logits `[t, E]` with a linear layer (Mixtral's
//!    `block_sparse_moe.gate`, weight `[E, h]`), then [`route`] takes the softmax over all `E`
//!    experts, keeps the `k` most probable per token and renormalises their probabilities to
//!    gate weights that sum to 1 (Hugging Face `MixtralSparseMoeBlock`, without router jitter).
//! 2. [`Dispatch`] groups the `t·k` (token, slot) assignments by expert; [`gather_rows`] copies
//!    token rows into that order so each expert sees one contiguous `[count, h]` block.
//! 3. The caller runs each expert on its block; [`combine_forward`] sums the gate-weighted
//!    outputs back per token.
//! 4. Backward: [`combine_backward`], the experts' own backward, [`scatter_add_rows`] for the
//!    input gradient, and [`route_backward`] plus [`aux_loss_backward`] for the router logits.
//!
//! The layer is dropless: there is no expert capacity, every assignment is computed however
//! unbalanced the routing is, so the grouped buffers always hold exactly `t·k` rows.
//!
//! The load-balancing loss ([`aux_loss`]) is built from per-expert statistics ([`AuxStats`])
//! that add across shards of tokens, so data-parallel ranks (or several layers) can sum them and
//! get exactly the loss of the whole batch.

use rayon::prelude::*;

use crate::PAR_CHUNK;

mod balance;
mod dispatch;
#[cfg(test)]
mod tests;

pub use balance::{aux_loss, aux_loss_backward, aux_stats, AuxStats};
pub use dispatch::{
    combine_backward, combine_forward, gather_rows, scatter_add_rows, Dispatch, DROPPED,
};

/// The router's decision for `t` tokens: per token, `k` experts with their gate weights, plus
/// the full softmax the backward and the load-balancing loss need.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Selected expert of every (token, slot), `[t, k]`, most probable first.
    pub ids: Vec<usize>,
    /// Gate weight of every (token, slot), `[t, k]`; each token's `k` weights sum to 1.
    pub gates: Vec<f32>,
    /// Softmax of the router logits over all experts, `[t, E]`.
    pub probs: Vec<f32>,
}

impl Routing {
    /// Bytes of its tables on the heap.
    pub fn heap_bytes(&self) -> usize {
        self.ids.len() * std::mem::size_of::<usize>() + 4 * (self.gates.len() + self.probs.len())
    }
}

/// Rows per rayon task for row-wise kernels whose rows are `len` floats wide.
pub(crate) fn rows_per_task(len: usize) -> usize {
    (PAR_CHUNK / len.max(1)).max(1)
}

/// Routes `t` tokens from their router logits `[t, E]`: `probs = softmax(logits)` (f32,
/// max-subtracted), the `top_k` most probable experts per token (ties go to the lower expert
/// index, so the result is deterministic), and gate weights equal to the selected
/// probabilities divided by their sum (Mixtral's `routing_weights /= routing_weights.sum()`).
pub fn route(logits: &[f32], t: usize, experts: usize, top_k: usize) -> Routing {
    route_biased(logits, None, t, experts, top_k)
}

/// [`route`] with aux-loss-free balancing's per-expert `bias` (`[E]`, DeepSeek-V3): the
/// experts are chosen by `probs + bias` (ties to the lower index), the gates are still the
/// chosen experts' unbiased probabilities divided by their sum. The bias never reaches the
/// gradient: [`route_backward`] is the same for both.
pub fn route_biased(
    logits: &[f32],
    bias: Option<&[f32]>,
    t: usize,
    experts: usize,
    top_k: usize,
) -> Routing {
    if let Some(b) = bias {
        assert_eq!(b.len(), experts, "one bias per expert");
    }
    let score = |p: &[f32], e: usize| p[e] + bias.map_or(0.0, |b| b[e]);
    assert!(
        (1..=experts).contains(&top_k),
        "top_k {top_k} must be in 1..={experts}"
    );
    assert_eq!(logits.len(), t * experts, "logits must be [t, E]");
    let mut r = Routing {
        ids: vec![0; t * top_k],
        gates: vec![0.0; t * top_k],
        probs: vec![0.0; t * experts],
    };
    r.probs
        .par_chunks_mut(experts)
        .zip(r.ids.par_chunks_mut(top_k))
        .zip(r.gates.par_chunks_mut(top_k))
        .zip(logits.par_chunks(experts))
        .with_min_len(rows_per_task(experts))
        .for_each(|(((p, ids), gates), z)| {
            let max = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for (p, &z) in p.iter_mut().zip(z) {
                *p = (z - max).exp();
                sum += *p;
            }
            for p in p.iter_mut() {
                *p /= sum;
            }
            // k passes of a strict `>` scan keep the first (lowest-index) maximum; k is small.
            let mut selected = 0.0f32;
            for s in 0..top_k {
                let mut best: Option<usize> = None;
                for e in 0..experts {
                    if ids[..s].contains(&e) {
                        continue;
                    }
                    if best.is_none_or(|b| score(p, e) > score(p, b)) {
                        best = Some(e);
                    }
                }
                let e = best.expect("top_k <= experts leaves a candidate");
                ids[s] = e;
                gates[s] = p[e];
                selected += p[e];
            }
            for g in gates.iter_mut() {
                *g /= selected;
            }
        });
    r
}

/// Gradient of the router logits, `[t, E]` (overwritten), from the gradient of the gate
/// weights `d_gates`, `[t, k]`.
///
/// With `p = softmax(z)`, the selected set `K`, `S = Σ_{j∈K} p_j` and `g_j = p_j / S`:
/// `∂L/∂p_m = (dg_m − c) / S` for `m ∈ K` (0 otherwise), where `c = Σ_{j∈K} g_j·dg_j`.
/// The softmax backward `dz_i = p_i·(∂L/∂p_i − Σ_m p_m·∂L/∂p_m)` then has a vanishing
/// correction, since `Σ_{m∈K} p_m (dg_m − c)/S = c − c·Σ g = 0`, which leaves
/// `dz_i = g_i·(dg_i − c)` for `i ∈ K` and `0` for the experts not selected. (Equivalently:
/// the renormalised top-k is a softmax over the selected logits alone.) The selection itself
/// is piecewise constant and has no gradient.
pub fn route_backward(
    d_logits: &mut [f32],
    d_gates: &[f32],
    routing: &Routing,
    t: usize,
    experts: usize,
    top_k: usize,
) {
    assert_eq!(d_logits.len(), t * experts, "d_logits must be [t, E]");
    assert_eq!(d_gates.len(), t * top_k, "d_gates must be [t, k]");
    assert_eq!(routing.ids.len(), t * top_k, "routing is not [t, k]");
    d_logits
        .par_chunks_mut(experts)
        .zip(d_gates.par_chunks(top_k))
        .zip(routing.ids.par_chunks(top_k))
        .zip(routing.gates.par_chunks(top_k))
        .with_min_len(rows_per_task(experts))
        .for_each(|(((dz, dg), ids), g)| {
            let c: f32 = g.iter().zip(dg).map(|(g, dg)| g * dg).sum();
            dz.fill(0.0);
            for s in 0..top_k {
                dz[ids[s]] += g[s] * (dg[s] - c);
            }
        });
}
