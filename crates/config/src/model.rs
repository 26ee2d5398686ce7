//! The Llama model shape.

use serde::{Deserialize, Serialize};

use crate::{invalid, ConfigError};

/// Shape of a Llama-style decoder: GQA attention, SwiGLU MLP, RMSNorm, RoPE.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Hidden size `h`.
    pub hidden: usize,
    /// Number of transformer blocks `L`.
    pub layers: usize,
    /// Attention (query) heads `a`.
    pub heads: usize,
    /// Key/value heads `a_kv` (grouped-query attention); must divide `heads`.
    pub kv_heads: usize,
    /// MLP inner size `h_ff`.
    pub ffn: usize,
    /// Vocabulary size `v`.
    pub vocab: usize,
    /// Sequence length `s` (tokens per sample).
    pub seq_len: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Share the embedding matrix with the LM head.
    pub tie_embeddings: bool,
}

impl Default for ModelConfig {
    /// The built-in tiny model that trains on the embedded synthetic corpus.
    fn default() -> Self {
        ModelConfig {
            hidden: 128,
            layers: 4,
            heads: 4,
            kv_heads: 4,
            ffn: 384,
            vocab: 64,
            seq_len: 128,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            tie_embeddings: false,
        }
    }
}

impl ModelConfig {
    /// Head dimension `d = h / a`.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Checks the relations between the fields.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, value) in [
            ("model.hidden", self.hidden),
            ("model.layers", self.layers),
            ("model.heads", self.heads),
            ("model.kv_heads", self.kv_heads),
            ("model.ffn", self.ffn),
            ("model.vocab", self.vocab),
            ("model.seq_len", self.seq_len),
        ] {
            if value == 0 {
                return Err(invalid(name, "must be at least 1"));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(invalid(
                "model.hidden",
                format!(
                    "hidden={} is not divisible by heads={}: choose hidden as a multiple of heads",
                    self.hidden, self.heads
                ),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(invalid(
                "model.kv_heads",
                format!(
                    "heads={} is not divisible by kv_heads={}: kv_heads must divide heads",
                    self.heads, self.kv_heads
                ),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(invalid(
                "model.hidden",
                format!(
                    "head dimension hidden/heads={} is odd: RoPE needs an even head dimension",
                    self.head_dim()
                ),
            ));
        }
        if !(self.rope_theta > 0.0) {
            return Err(invalid("model.rope_theta", "must be positive"));
        }
        if !(self.rms_eps > 0.0) {
            return Err(invalid("model.rms_eps", "must be positive"));
        }
        if self.vocab > u32::MAX as usize {
            return Err(invalid("model.vocab", "must fit in 32 bits"));
        }
        Ok(())
    }

    /// Exact parameter count Ψ of this model (playbook §2, GQA + SwiGLU + RMSNorm).
    pub fn num_params(&self) -> usize {
        let h = self.hidden;
        let d = self.head_dim();
        let attention = h * (self.heads * d) + 2 * h * (self.kv_heads * d) + (self.heads * d) * h;
        let mlp = 3 * h * self.ffn;
        let per_layer = attention + mlp + 2 * h;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * h
        };
        self.vocab * h + self.layers * per_layer + h + head
    }

    /// Training FLOPs per token, nanotron's exact count (playbook §2): 3 × forward, where the
    /// forward counts every matmul including the LM head, and the attention score and value
    /// products over the **causal half** of the s×s matrix (`causal = true`) or the full
    /// matrix (`causal = false`).
    pub fn train_flops_per_token(&self, causal: bool) -> f64 {
        let h = self.hidden as f64;
        let d = self.head_dim() as f64;
        let a = self.heads as f64;
        let akv = self.kv_heads as f64;
        let s = self.seq_len as f64;
        let qkv = 2.0 * h * (a + 2.0 * akv) * d;
        let out = 2.0 * (a * d) * h;
        let mlp = 6.0 * h * self.ffn as f64;
        // QKᵀ and AV: 2·a·s·d each per token over the full matrix.
        let attn_full = 2.0 * 2.0 * a * s * d;
        let attn = if causal {
            attn_full * (s + 1.0) / (2.0 * s)
        } else {
            attn_full
        };
        let head = 2.0 * h * self.vocab as f64;
        3.0 * (self.layers as f64 * (qkv + out + mlp + attn) + head)
    }
}
