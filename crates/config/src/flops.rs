//! FLOPs per token and MFU: the one definition `train`, `bench`, `plan` and the docs use.
//!
//! ```text
//! MFU = model FLOPs per token × tokens per second ÷ peak FLOP/s of the hardware occupied
//! ```
//!
//! The FLOPs are nanotron's exact count (playbook §2): training is 3 × the forward, whose
//! matmuls are the query, key and value projections, the output projection, the gated MLP
//! (a mixture of experts: `top_k` experts and the router), the attention scores and values
//! (over the full `s × s` matrix, or its causal half), and the LM head. The model FLOPs, the
//! MFU numerator, count attention over the full matrix, as nanotron's `get_flops` and
//! Megatron-LM's `num_floating_point_operations` do; recomputation is never counted (HFU).
//! `plan` describes a mixture of experts apart from its `ModelConfig`, so the per-block
//! counts take the block's experts as an argument.

use crate::ModelConfig;

/// A mixture-of-experts block as its FLOPs see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Experts {
    /// Experts of the block (the router's outputs).
    pub experts: usize,
    /// Experts each token runs through.
    pub top_k: usize,
}

/// MFU of `tokens_per_s` tokens per second at `flops_per_token` model FLOPs each, against
/// `peak_flops` FLOP/s.
pub fn mfu(tokens_per_s: f64, flops_per_token: f64, peak_flops: f64) -> f64 {
    tokens_per_s * flops_per_token / peak_flops
}

impl ModelConfig {
    /// The experts of block `l` under this configuration (`None`: a dense block).
    pub fn block_experts(&self, l: usize) -> Option<Experts> {
        self.is_moe_layer(l).then_some(Experts {
            experts: self.experts,
            top_k: self.top_k,
        })
    }

    /// Forward FLOPs per token of one block whose MLP is `experts` (`None`: dense): QKV,
    /// output projection, the MLP, and QKᵀ and AV over the full `s × s` matrix
    /// (`causal = false`) or its causal half (`causal = true`).
    pub fn block_forward_flops(&self, experts: Option<Experts>, causal: bool) -> f64 {
        let (h, d, s) = (
            self.hidden as f64,
            self.head_dim() as f64,
            self.seq_len as f64,
        );
        let (a, akv) = (self.heads as f64, self.kv_heads as f64);
        let qkv = 2.0 * h * (a + 2.0 * akv) * d;
        let out = 2.0 * a * d * h;
        let mlp = match experts {
            None => self.dense_mlp_flops(),
            Some(e) => self.experts_forward_flops(e),
        };
        // QKᵀ and AV: 2·a·s·d each per token over the full matrix.
        let attn_full = 4.0 * a * s * d;
        let attn = if causal {
            attn_full * (s + 1.0) / (2.0 * s)
        } else {
            attn_full
        };
        qkv + out + mlp + attn
    }

    /// Forward FLOPs per token of a mixture of experts: its `top_k` experts' gated MLPs and
    /// the router.
    pub fn experts_forward_flops(&self, e: Experts) -> f64 {
        e.top_k as f64 * self.dense_mlp_flops() + 2.0 * self.hidden as f64 * e.experts as f64
    }

    /// Forward FLOPs per token of one gated MLP, `6·h·h_ff`.
    fn dense_mlp_flops(&self) -> f64 {
        6.0 * self.hidden as f64 * self.ffn as f64
    }

    /// Forward FLOPs per token of the LM head, `2·h·v`.
    pub fn head_forward_flops(&self) -> f64 {
        2.0 * self.hidden as f64 * self.vocab as f64
    }

    /// Training FLOPs per token with block `l`'s experts `experts_of(l)`: 3 × (every
    /// block's forward + the head's).
    pub fn train_flops_with(
        &self,
        experts_of: impl Fn(usize) -> Option<Experts>,
        causal: bool,
    ) -> f64 {
        let blocks: f64 = (0..self.layers)
            .map(|l| self.block_forward_flops(experts_of(l), causal))
            .sum();
        3.0 * (blocks + self.head_forward_flops())
    }

    /// Training FLOPs per token of this configuration (its own experts), attention over the
    /// causal half (`causal`) or the full matrix.
    pub fn train_flops_per_token(&self, causal: bool) -> f64 {
        self.train_flops_with(|l| self.block_experts(l), causal)
    }

    /// Model FLOPs per token with block `l`'s experts `experts_of(l)`, the numerator of MFU
    /// everywhere: the training FLOPs with attention over the full `s × s` matrix.
    pub fn model_flops_with(&self, experts_of: impl Fn(usize) -> Option<Experts>) -> f64 {
        self.train_flops_with(experts_of, false)
    }

    /// Model FLOPs per token of this configuration (its own experts), the MFU numerator.
    pub fn model_flops_per_token(&self) -> f64 {
        self.model_flops_with(|l| self.block_experts(l))
    }

    /// Model FLOPs per token when each query's attention spans `span` keys on average
    /// instead of the window's `seq_len`: under document masking every document counts its
    /// own full matrix, as if it were a sequence of its own, so `span` is the sum of the
    /// documents' squared lengths over the tokens.
    pub fn model_flops_with_span(&self, span: f64) -> f64 {
        let (a, d, s) = (
            self.heads as f64,
            self.head_dim() as f64,
            self.seq_len as f64,
        );
        // 3 × (QKᵀ and AV: 4·a·d per key per token) in every block.
        let per_key = 3.0 * self.layers as f64 * 4.0 * a * d;
        self.model_flops_per_token() - per_key * (s - span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-block sum against the closed form of the count (every block alike, the
    /// mixture-of-experts blocks' MLP replaced by `top_k` MLPs and the router), for a dense
    /// model and a Mixtral-style one with MoE every other block.
    #[test]
    fn the_count_is_the_closed_form() {
        let mut c = ModelConfig {
            hidden: 64,
            layers: 6,
            heads: 8,
            kv_heads: 2,
            ffn: 160,
            vocab: 1000,
            seq_len: 96,
            ..ModelConfig::default()
        };
        for (experts, top_k, every) in [(0, 0, 0), (8, 2, 2)] {
            (c.experts, c.top_k, c.moe_every) = (experts, top_k, every);
            let (h, d, s, f) = (64.0, 8.0, 96.0, 160.0);
            let per_block = 2.0 * h * (8.0 + 4.0) * d + 2.0 * 8.0 * d * h;
            let moe = if experts > 0 { 3.0 } else { 0.0 };
            let mlps = (6.0 - moe) * 6.0 * h * f + moe * (2.0 * 6.0 * h * f + 2.0 * h * 8.0);
            for causal in [false, true] {
                let attn = 4.0 * 8.0 * s * d * if causal { (s + 1.0) / (2.0 * s) } else { 1.0 };
                let want = 3.0 * (6.0 * (per_block + attn) + mlps + 2.0 * h * 1000.0);
                let got = c.train_flops_per_token(causal);
                assert!(
                    (got - want).abs() <= 1e-12 * want,
                    "{experts} {causal}: {got} {want}"
                );
            }
            assert_eq!(c.model_flops_per_token(), c.train_flops_per_token(false));
        }
    }

    #[test]
    fn a_span_replaces_the_windows_attention() {
        let c = ModelConfig {
            hidden: 64,
            layers: 3,
            heads: 8,
            kv_heads: 2,
            ffn: 160,
            seq_len: 96,
            ..ModelConfig::default()
        };
        assert_eq!(c.model_flops_with_span(96.0), c.model_flops_per_token());
        // Windows of two 48-token documents: each document's full matrix, as a 48-token model.
        let half = ModelConfig { seq_len: 48, ..c };
        let span = (48.0 * 48.0 * 2.0) / 96.0;
        let (got, want) = (c.model_flops_with_span(span), half.model_flops_per_token());
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
    }

    #[test]
    fn mfu_is_achieved_over_peak() {
        // 1,000 tokens/s at 6 MFLOP each against a 12 GFLOP/s peak: half of it.
        assert_eq!(mfu(1000.0, 6.0e6, 12.0e9), 0.5);
    }
}
