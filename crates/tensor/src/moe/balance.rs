//! The Switch-style load-balancing loss, exactly as Hugging Face's `load_balancing_loss_func`
//! computes it for Mixtral (no attention mask):
//!
//! ```text
//! routing_weights  = softmax(gate_logits)                      # [T, E]
//! selected         = topk(routing_weights, k).indices          # [T, k]
//! expert_mask      = one_hot(selected, E)                      # [T, k, E]
//! tokens_per_expert      = mean(expert_mask, dim=0)            # [k, E]
//! router_prob_per_expert = mean(routing_weights, dim=0)        # [E]
//! aux = E · sum(tokens_per_expert · router_prob_per_expert[None, :])
//! ```
//!
//! Summing the `[k, E]` mask over slots gives `count_e`, the number of (token, slot)
//! assignments to expert `e`, so `aux = E · Σ_e (count_e / T) · (prob_sum_e / T)` with
//! `prob_sum_e = Σ_tokens probs[:, e]`. Note the fraction is over `T` tokens, not `T·k`
//! assignments: perfectly balanced routing gives `aux = k`, not 1.
//!
//! `count_e` comes from an argmax and is not differentiable; the gradient flows through
//! `prob_sum_e` and the softmax only (as in PyTorch, where `one_hot` cuts the graph).
//!
//! Both ingredients are sums over tokens, so shards of a batch (data-parallel ranks) can add
//! their [`AuxStats`] and call [`aux_loss`] with the global token count to get the exact loss
//! of the whole batch. Hugging Face concatenates the router logits of all layers before this
//! formula; adding the stats of every MoE layer and passing `T = layers × tokens` reproduces
//! that, while one call per layer gives a per-layer loss instead.

use rayon::prelude::*;

use super::{rows_per_task, Routing};

/// The per-expert sums the load-balancing loss is made of, over some set of tokens. They add
/// across shards of tokens (see [`AuxStats::add`]); f64 so the sums stay exact enough after
/// an all-reduce over many ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct AuxStats {
    /// Number of (token, slot) assignments to every expert, `[E]`.
    pub counts: Vec<f64>,
    /// Sum over tokens of every expert's router probability, `[E]`.
    pub prob_sums: Vec<f64>,
}

impl AuxStats {
    /// Adds the statistics of another shard of tokens.
    pub fn add(&mut self, other: &AuxStats) {
        assert_eq!(
            self.counts.len(),
            other.counts.len(),
            "expert counts differ"
        );
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        for (a, b) in self.prob_sums.iter_mut().zip(&other.prob_sums) {
            *a += b;
        }
    }
}

/// The load-balancing statistics of the `t` tokens of `routing` (`E` experts, `top_k` slots).
pub fn aux_stats(routing: &Routing, t: usize, experts: usize, top_k: usize) -> AuxStats {
    assert_eq!(routing.ids.len(), t * top_k, "routing is not [t, k]");
    assert_eq!(
        routing.probs.len(),
        t * experts,
        "routing probs are not [t, E]"
    );
    let mut counts = vec![0.0f64; experts];
    for &e in &routing.ids {
        counts[e] += 1.0;
    }
    let mut prob_sums = vec![0.0f64; experts];
    // Sequential, in token order: the sums must not depend on thread scheduling.
    for p in routing.probs.chunks(experts) {
        for (s, &p) in prob_sums.iter_mut().zip(p) {
            *s += p as f64;
        }
    }
    AuxStats { counts, prob_sums }
}

/// `aux = E · Σ_e (counts_e / T) · (prob_sums_e / T)` (Hugging Face's
/// `load_balancing_loss_func` for Mixtral, see the module doc), with `stats` summed over all
/// `tokens = T` tokens of the batch. An empty batch has no imbalance: 0.
pub fn aux_loss(stats: &AuxStats, tokens: usize) -> f64 {
    if tokens == 0 {
        return 0.0;
    }
    let experts = stats.counts.len() as f64;
    let t = tokens as f64;
    let dot: f64 = stats
        .counts
        .iter()
        .zip(&stats.prob_sums)
        .map(|(c, p)| c * p)
        .sum();
    experts * dot / (t * t)
}

/// Adds to `d_logits` (`[t, E]`, the logits of this shard's `t` tokens) the gradient of
/// `coef · aux`, where `stats` and `tokens` describe the whole batch as in [`aux_loss`].
///
/// Only `prob_sums` depends on the logits: `∂(coef·aux)/∂p_ie = a_e = coef·E·counts_e / T²`,
/// then through the softmax `dz_ij = p_ij·(a_j − Σ_e p_ie·a_e)`. Every token's gradient needs
/// only its own probabilities and the global counts, so the shards' gradients are exactly the
/// corresponding rows of the whole batch's gradient.
pub fn aux_loss_backward(
    d_logits: &mut [f32],
    coef: f64,
    stats: &AuxStats,
    tokens: usize,
    routing: &Routing,
    t: usize,
    experts: usize,
) {
    assert_eq!(
        stats.counts.len(),
        experts,
        "stats are for another number of experts"
    );
    assert_eq!(d_logits.len(), t * experts, "d_logits must be [t, E]");
    assert_eq!(
        routing.probs.len(),
        t * experts,
        "routing probs are not [t, E]"
    );
    let tt = tokens as f64;
    let a: Vec<f64> = stats
        .counts
        .iter()
        .map(|c| coef * experts as f64 * c / (tt * tt))
        .collect();
    d_logits
        .par_chunks_mut(experts)
        .zip(routing.probs.par_chunks(experts))
        .with_min_len(rows_per_task(experts))
        .for_each(|(dz, p)| {
            let mean: f64 = p.iter().zip(&a).map(|(&p, a)| p as f64 * a).sum();
            for ((dz, &p), a) in dz.iter_mut().zip(p).zip(&a) {
                *dz += (p as f64 * (a - mean)) as f32;
            }
        });
}
