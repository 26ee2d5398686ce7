//! Model shapes the planner reasons about: a Llama [`ModelConfig`] plus an optional
//! mixture-of-experts MLP (the run configuration has no MoE fields yet), parameter counts per
//! unit and per rank, and the training FLOPs.

use ferrotron_config::flops::Experts;
use ferrotron_config::ModelConfig;
use serde::{Deserialize, Serialize};

use crate::{invalid, PlanError};

/// Mixture-of-experts MLP: every `every`-th block replaces its SwiGLU MLP by `experts` SwiGLU
/// experts of inner size `ffn` and a router; each token goes to its `top_k` experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moe {
    /// Experts per MoE block.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Block `l` is a MoE block when `(l + 1) % every == 0` (1 = every block).
    pub every: usize,
}

/// A model: its name, its Llama shape and its MoE layers (if any).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Display name (a preset's name, or `config` for a run configuration).
    pub name: String,
    /// The Llama shape; `seq_len` is the sequence length of the run.
    pub config: ModelConfig,
    /// Mixture-of-experts settings; `None` for a dense model.
    pub moe: Option<Moe>,
}

/// A group of parameters that the engine gathers, reduces and assigns to a pipeline stage as
/// one piece: the embedding, one block, or the head (final norm + LM head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unit {
    /// Token embedding `[v, h]`.
    Embed,
    /// Transformer block `l`.
    Block(usize),
    /// Final norm and LM head (the norm alone when the head is tied to the embedding and both
    /// live on the same rank).
    Head,
}

/// (name, hidden, layers, heads, kv_heads, ffn, vocab, tied, rope_theta, MoE).
type PresetRow = (
    &'static str,
    [usize; 6],
    bool,
    f64,
    Option<(usize, usize, usize)>,
);

/// The presets: Llama 3.2 1B and 3B (tied embeddings), Llama 3.1 8B, 70B and 405B, and
/// Mixtral 8×7B (8 experts, top-2, every block). The tiny model is the engine's default.
const PRESETS: [PresetRow; 6] = [
    (
        "llama3-1b",
        [2048, 16, 32, 8, 8192, 128256],
        true,
        5e5,
        None,
    ),
    (
        "llama3-3b",
        [3072, 28, 24, 8, 8192, 128256],
        true,
        5e5,
        None,
    ),
    (
        "llama3-8b",
        [4096, 32, 32, 8, 14336, 128256],
        false,
        5e5,
        None,
    ),
    (
        "llama3-70b",
        [8192, 80, 64, 8, 28672, 128256],
        false,
        5e5,
        None,
    ),
    (
        "llama3-405b",
        [16384, 126, 128, 8, 53248, 128256],
        false,
        5e5,
        None,
    ),
    (
        "mixtral-8x7b",
        [4096, 32, 32, 8, 14336, 32000],
        false,
        1e6,
        Some((8, 2, 1)),
    ),
];

/// Largest parameter count the crate accepts (2⁵⁰ ≈ 10¹⁵): every byte count then fits in 64
/// bits with room to spare.
const MAX_PARAMS: u128 = 1 << 50;

impl ModelSpec {
    /// A dense model named `name`.
    pub fn dense(name: impl Into<String>, config: ModelConfig) -> Self {
        ModelSpec {
            name: name.into(),
            config,
            moe: None,
        }
    }

    /// Names of the presets, plus `tiny` (the engine's built-in model).
    pub fn preset_names() -> Vec<&'static str> {
        let mut names: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
        names.push("tiny");
        names
    }

    /// The preset called `name` (case-insensitive; `llama-3-8b`, `llama3.1-8b` and `8b` also
    /// name `llama3-8b`), with sequence length 4096 (the tiny model keeps its 128).
    pub fn preset(name: &str) -> Result<Self, PlanError> {
        let key = name.to_ascii_lowercase().replace(['_', '.', ' '], "-");
        let key = key.replace("llama-3", "llama3");
        let key = key
            .trim_start_matches("llama3-1-")
            .trim_start_matches("llama3-2-");
        if key == "tiny" {
            return Ok(ModelSpec::dense("tiny", ModelConfig::default()));
        }
        let row = PRESETS.iter().find(|p| {
            p.0 == key || p.0.strip_prefix("llama3-") == Some(key) || p.0 == format!("llama3-{key}")
        });
        let Some((n, [hidden, layers, heads, kv_heads, ffn, vocab], tied, theta, moe)) = row else {
            return Err(PlanError::UnknownPreset {
                name: name.to_string(),
                known: Self::preset_names().join(", "),
            });
        };
        let config = ModelConfig {
            hidden: *hidden,
            layers: *layers,
            heads: *heads,
            kv_heads: *kv_heads,
            ffn: *ffn,
            vocab: *vocab,
            seq_len: 4096,
            rope_theta: *theta,
            rms_eps: 1e-5,
            tie_embeddings: *tied,
            // The planner keeps the MoE settings in `ModelSpec::moe`.
            ..ModelConfig::default()
        };
        Ok(ModelSpec {
            name: n.to_string(),
            config,
            moe: moe.map(|(experts, top_k, every)| Moe {
                experts,
                top_k,
                every,
            }),
        })
    }

    /// Checks the shape (the config's own rules, the MoE settings, and a size small enough
    /// to count in 64 bits).
    pub fn validate(&self) -> Result<(), PlanError> {
        // The planner's configuration is dense; the capacity factor caps `moe`'s experts.
        let mut dense = self.config.clone();
        if let Some(cf) = dense.moe_capacity_factor.take() {
            if self.moe.is_none() {
                return Err(invalid(
                    "model.moe_capacity_factor",
                    "caps the experts of a mixture of experts: set model.experts, or remove it",
                ));
            }
            if !(cf > 0.0 && cf.is_finite()) {
                return Err(invalid(
                    "model.moe_capacity_factor",
                    format!("{cf}: must be a finite number above 0"),
                ));
            }
        }
        dense.validate()?;
        if let Some(m) = &self.moe {
            if m.experts == 0 || m.top_k == 0 || m.every == 0 {
                return Err(invalid(
                    "model.experts",
                    "experts, top_k and moe_every must be at least 1",
                ));
            }
            if m.top_k > m.experts {
                return Err(invalid(
                    "model.top_k",
                    format!("top_k={} exceeds experts={}", m.top_k, m.experts),
                ));
            }
        }
        let c = &self.config;
        let (h, v, l) = (c.hidden as u128, c.vocab as u128, c.layers as u128);
        let block = h * (c.heads * c.head_dim()) as u128 * 4
            + 3 * h * c.ffn as u128 * self.moe.map_or(1, |m| m.experts as u128 + 1);
        if 2 * v * h + l * block > MAX_PARAMS {
            return Err(PlanError::TooLarge(format!(
                "more than 2^50 parameters (hidden={}, layers={}, ffn={}, vocab={})",
                c.hidden, c.layers, c.ffn, c.vocab
            )));
        }
        Ok(())
    }

    /// Whether block `l` has a mixture-of-experts MLP.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.moe.is_some_and(|m| (l + 1).is_multiple_of(m.every))
    }

    /// Number of MoE blocks.
    pub fn moe_layers(&self) -> usize {
        (0..self.config.layers)
            .filter(|&l| self.is_moe_layer(l))
            .count()
    }

    /// Elements of `unit` held by one rank, as (dense part, expert part), under tensor
    /// parallelism `tp` (projections, embedding and LM head split; norms, router and experts
    /// replicated, as the engine runs them; the vocabulary padded to a multiple of `tp`) and
    /// expert parallelism `ep` (experts split). `head_copy` gives the head its own `[v, h]` matrix when the
    /// embedding is tied but lives on another pipeline stage.
    pub fn unit_elems(&self, unit: Unit, tp: usize, ep: usize, head_copy: bool) -> (u64, u64) {
        let c = &self.config;
        let (h, t) = (c.hidden as u64, tp.max(1) as u64);
        // Under TP the vocabulary is padded to rows split evenly (`model.vocab_multiple`).
        let vocab_rows = c.vocab_rows(t as usize) as u64;
        match unit {
            Unit::Embed => (vocab_rows * h, 0),
            Unit::Head => {
                let lm = if c.tie_embeddings && !head_copy {
                    0
                } else {
                    vocab_rows * h
                };
                (h + lm, 0)
            }
            Unit::Block(l) => {
                let (a, akv, d) = (c.heads as u64, c.kv_heads as u64, c.head_dim() as u64);
                let bias = c.qkv_bias_params() as u64;
                let attention = (h * a * d + 2 * h * akv * d + a * d * h + bias) / t;
                let mlp = 3 * h * c.ffn as u64 / t;
                match self.moe.filter(|_| self.is_moe_layer(l)) {
                    None => (attention + mlp + 2 * h, 0),
                    Some(m) => {
                        let local = (m.experts / ep.max(1)) as u64;
                        (
                            attention + 2 * h + h * m.experts as u64,
                            local * 3 * h * c.ffn as u64,
                        )
                    }
                }
            }
        }
    }

    /// Ψ: every parameter of the model once (experts included, a tied head counted once).
    pub fn num_params(&self) -> u64 {
        let units = self.units();
        units
            .iter()
            .map(|u| {
                let (d, e) = self.unit_elems(*u, 1, 1, false);
                d + e
            })
            .sum()
    }

    /// Parameters one token passes through (MoE: `top_k` experts per MoE block).
    pub fn active_params(&self) -> u64 {
        let Some(m) = self.moe else {
            return self.num_params();
        };
        let per_expert = 3 * self.config.hidden as u64 * self.config.ffn as u64;
        let unused = (m.experts - m.top_k) as u64 * per_expert * self.moe_layers() as u64;
        self.num_params() - unused
    }

    /// Units in forward order: embedding, blocks, head.
    pub fn units(&self) -> Vec<Unit> {
        let mut u = vec![Unit::Embed];
        u.extend((0..self.config.layers).map(Unit::Block));
        u.push(Unit::Head);
        u
    }

    /// The experts of block `l` (`None`: a dense block), for the FLOP counts.
    fn block_experts(&self, l: usize) -> Option<Experts> {
        self.moe.filter(|_| self.is_moe_layer(l)).map(|m| Experts {
            experts: m.experts,
            top_k: m.top_k,
        })
    }

    /// Forward FLOPs per token of block `l`
    /// ([`ModelConfig::block_forward_flops`](ferrotron_config::ModelConfig::block_forward_flops)
    /// with this model's experts).
    pub fn layer_forward_flops_per_token(&self, l: usize, causal: bool) -> f64 {
        self.config
            .block_forward_flops(self.block_experts(l), causal)
    }

    /// Forward FLOPs per token of block `l`'s mixture of experts (its `top_k` experts and
    /// the router; 0 for a dense block): the part tensor parallelism does not split, since
    /// every tensor-parallel rank runs the experts on all tokens.
    pub fn moe_forward_flops_per_token(&self, l: usize) -> f64 {
        self.block_experts(l)
            .map_or(0.0, |e| self.config.experts_forward_flops(e))
    }

    /// Forward FLOPs per token of the LM head, `2·h·v`.
    pub fn head_forward_flops_per_token(&self) -> f64 {
        self.config.head_forward_flops()
    }

    /// Model FLOPs per token, the MFU numerator: [`Self::train_flops_per_token`] over the
    /// full attention matrix ([`ferrotron_config::flops`]).
    pub fn model_flops_per_token(&self) -> f64 {
        self.config.model_flops_with(|l| self.block_experts(l))
    }

    /// Training FLOPs per token: 3 × forward (backward = 2 × forward), recomputation
    /// excluded; `causal` counts attention over the causal half (the kernels' real work).
    pub fn train_flops_per_token(&self, causal: bool) -> f64 {
        self.config
            .train_flops_with(|l| self.block_experts(l), causal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_counts_match_the_config() {
        for name in ["tiny", "llama3-1b", "llama3-8b", "llama3-405b"] {
            let m = ModelSpec::preset(name).unwrap();
            assert_eq!(m.num_params(), m.config.num_params() as u64, "{name}");
            for causal in [false, true] {
                let ours = m.train_flops_per_token(causal);
                let theirs = m.config.train_flops_per_token(causal);
                assert!((ours - theirs).abs() <= 1e-9 * theirs, "{name} {causal}");
            }
            let mfu_numerator = m.config.model_flops_per_token();
            assert!((m.model_flops_per_token() - mfu_numerator).abs() <= 1e-9 * mfu_numerator);
            // Full attention: 3 · 4·a·s·d per layer more than the causal half's (s+1)/2s share.
            let c = &m.config;
            let attn = 3.0 * 4.0 * (c.heads * c.seq_len * c.head_dim() * c.layers) as f64;
            let causal_share = (c.seq_len as f64 + 1.0) / (2.0 * c.seq_len as f64);
            let gap = mfu_numerator - m.train_flops_per_token(true);
            assert!(
                (gap - attn * (1.0 - causal_share)).abs() <= 1e-9 * mfu_numerator,
                "{name}"
            );
        }
        assert_eq!(
            ModelSpec::preset("llama3-8b").unwrap().num_params(),
            8_030_261_248
        );
        assert_eq!(
            ModelSpec::preset("70b").unwrap().num_params(),
            70_553_706_496
        );
        assert_eq!(
            ModelSpec::preset("Llama-3.1-405B").unwrap().num_params(),
            405_853_388_800
        );
        assert_eq!(ModelSpec::preset("1b").unwrap().num_params(), 1_235_814_400);
    }

    #[test]
    fn mixtral_has_47b_parameters_13b_active() {
        let m = ModelSpec::preset("mixtral-8x7b").unwrap();
        assert_eq!(m.num_params(), 46_702_792_704);
        assert_eq!(m.active_params(), 12_879_925_248);
        // Expert parallelism splits the experts only.
        let (dense, experts) = m.unit_elems(Unit::Block(0), 1, 4, false);
        assert_eq!(experts, 2 * 3 * 4096 * 14336);
        // q, o: 4096²; k, v: 4096·1024; two norms; the router 4096 × 8.
        assert_eq!(
            dense,
            2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 4096 * 8
        );
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let err = ModelSpec::preset("gpt5").unwrap_err().to_string();
        assert!(
            err.contains("llama3-70b") && err.contains("mixtral-8x7b"),
            "{err}"
        );
    }
}
