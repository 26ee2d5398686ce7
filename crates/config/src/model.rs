//! The Llama model shape, optionally with Mixtral-style mixture-of-experts blocks.

use serde::{Deserialize, Serialize};

use crate::{invalid, ConfigError};

mod moe;

pub use moe::{expert_capacity, MoeBalance};

/// RoPE frequency scaling for long contexts (Hugging Face `rope_parameters.rope_type`, or
/// `rope_scaling` in 4.x configs), applied to each inverse frequency as transformers does.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type = "default"`).
    #[default]
    None,
    /// Every frequency divided by `factor` (`"linear"`).
    Linear {
        /// Context extension factor.
        factor: f64,
    },
    /// Llama 3.1's scaling (`"llama3"`): low frequencies divided by `factor`, high ones kept,
    /// the band between interpolated.
    Llama3 {
        /// Context extension factor (8 for Llama 3.1).
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was pretrained with.
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// The scaled inverse frequency of an unscaled one, `inv` (transformers'
    /// `_compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters`).
    pub fn apply(&self, inv: f64) -> f64 {
        match *self {
            RopeScaling::None => inv,
            RopeScaling::Linear { factor } => inv / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            } => {
                let original = original as f64;
                let wavelen = 2.0 * std::f64::consts::PI / inv;
                let (low_wavelen, high_wavelen) = (original / low, original / high);
                let scaled = if wavelen > low_wavelen {
                    inv / factor
                } else {
                    inv
                };
                let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                if medium {
                    let smooth = (original / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                } else {
                    scaled
                }
            }
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let positive = |name: &str, x: f64| {
            if x > 0.0 && x.is_finite() {
                Ok(())
            } else {
                Err(invalid(
                    "model.rope_scaling",
                    format!("{name} = {x}: must be a positive number"),
                ))
            }
        };
        match *self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", factor)?;
                positive("low_freq_factor", low_freq_factor)?;
                positive("high_freq_factor", high_freq_factor)?;
                positive(
                    "original_max_position_embeddings",
                    original_max_position_embeddings as f64,
                )?;
                if high_freq_factor <= low_freq_factor {
                    return Err(invalid(
                        "model.rope_scaling",
                        format!(
                            "high_freq_factor = {high_freq_factor} must exceed low_freq_factor = \
                             {low_freq_factor}"
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

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
    /// Head dimension `d` when it is not `hidden / heads` (Hugging Face `head_dim`): the
    /// query projection is then `[heads·d, hidden]`. Absent: `hidden / heads`.
    pub head_dim: Option<usize>,
    /// MLP inner size `h_ff`.
    pub ffn: usize,
    /// Vocabulary size `v`.
    pub vocab: usize,
    /// Under tensor parallelism the embedding and the LM head are padded to
    /// `vocab.next_multiple_of(vocab_multiple × tp)` rows, split evenly over the ranks
    /// (Megatron's `--make-vocab-size-divisible-by`, default 128), so any vocabulary runs
    /// under any `tp`. Padded rows stay zero, take no gradient and never enter the softmax
    /// or the loss; checkpoints and exported models hold the `vocab` real rows only. Without
    /// tensor parallelism nothing is padded.
    pub vocab_multiple: usize,
    /// Sequence length `s` (tokens per sample).
    pub seq_len: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RoPE frequency scaling (`[model.rope_scaling] type = "llama3"`, …); none by default.
    pub rope_scaling: RopeScaling,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Share the embedding matrix with the LM head.
    pub tie_embeddings: bool,
    /// Biases on the query, key and value projections (Qwen2; Hugging Face
    /// `Qwen2ForCausalLM`), initialised to zero and not weight-decayed. The output projection
    /// and the MLP keep none.
    pub qkv_bias: bool,
    /// Experts per mixture-of-experts block `E` (Hugging Face `num_local_experts`); 0 means a
    /// dense model, where every block has the SwiGLU MLP.
    pub experts: usize,
    /// Experts each token is routed to `k` (Hugging Face `num_experts_per_tok`).
    pub top_k: usize,
    /// Block `l` is a mixture-of-experts block when `(l + 1) % moe_every == 0`: 1 makes every
    /// block one (Mixtral), 2 every second block, and so on.
    pub moe_every: usize,
    /// Weight of the load-balancing loss in the training loss (Hugging Face
    /// `router_aux_loss_coef`).
    pub router_aux_loss_coef: f64,
    /// How the experts' loads are balanced besides that loss: see [`MoeBalance`].
    pub moe_balance: MoeBalance,
    /// With `moe_balance = "bias"`: how far each expert's bias moves per step (DeepSeek-V3's
    /// bias update speed γ).
    pub moe_bias_rate: f64,
    /// Expert capacity as a multiple of the balanced load, with token dropping (GShard,
    /// Switch, Megatron's `moe_expert_capacity_factor`); absent: dropless. See
    /// [`ModelConfig::expert_capacity`].
    pub moe_capacity_factor: Option<f64>,
}

impl Default for ModelConfig {
    /// The built-in tiny model that trains on the embedded synthetic corpus.
    fn default() -> Self {
        ModelConfig {
            hidden: 128,
            layers: 4,
            heads: 4,
            kv_heads: 4,
            head_dim: None,
            ffn: 384,
            vocab: 64,
            vocab_multiple: 128,
            seq_len: 128,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            rms_eps: 1e-5,
            tie_embeddings: false,
            qkv_bias: false,
            experts: 0,
            top_k: 2,
            moe_every: 1,
            router_aux_loss_coef: 0.001,
            moe_balance: MoeBalance::AuxLoss,
            moe_bias_rate: 0.001,
            moe_capacity_factor: None,
        }
    }
}

impl ModelConfig {
    /// Rows of the embedding and the LM head each of `tp` tensor-parallel ranks holds: the
    /// vocabulary padded to a multiple of `vocab_multiple × tp`, divided by `tp` (the whole
    /// vocabulary, unpadded, at `tp = 1`). See [`ModelConfig::vocab_multiple`].
    pub fn vocab_rows(&self, tp: usize) -> usize {
        match tp {
            0 | 1 => self.vocab,
            _ => self.vocab.next_multiple_of(self.vocab_multiple.max(1) * tp) / tp,
        }
    }

    /// Real (unpadded) vocabulary rows among the [`ModelConfig::vocab_rows`] that
    /// tensor-parallel rank `rank` of `tp` holds: its rows `[rank·r, (rank+1)·r)` that are
    /// below `vocab` (none on a rank holding only padding).
    pub fn vocab_valid_rows(&self, tp: usize, rank: usize) -> usize {
        let rows = self.vocab_rows(tp);
        self.vocab.saturating_sub(rank * rows).min(rows)
    }

    /// Head dimension `d`: [`ModelConfig::head_dim`] when set, else `h / a`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads.max(1))
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
            ("model.vocab_multiple", self.vocab_multiple),
            ("model.seq_len", self.seq_len),
        ] {
            if value == 0 {
                return Err(invalid(name, "must be at least 1"));
            }
        }
        if self.head_dim == Some(0) {
            return Err(invalid(
                "model.head_dim",
                "must be at least 1 (or absent: hidden/heads)",
            ));
        }
        if self.head_dim.is_none() && !self.hidden.is_multiple_of(self.heads) {
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
                match self.head_dim {
                    Some(d) => format!(
                        "head dimension {d} (model.head_dim) is odd: RoPE needs an even head \
                         dimension; set model.head_dim to {}",
                        if d > 1 {
                            format!("{} or {}", d - 1, d + 1)
                        } else {
                            "2".to_string()
                        }
                    ),
                    None => format!(
                        "head dimension {} (hidden / heads = {} / {}) is odd: RoPE needs an \
                         even head dimension; set model.hidden to {} or {}, or model.heads so \
                         that hidden / heads is even",
                        self.head_dim(),
                        self.hidden,
                        self.heads,
                        self.hidden - self.heads,
                        self.hidden + self.heads
                    ),
                },
            ));
        }
        if !(self.rope_theta > 0.0) {
            return Err(invalid("model.rope_theta", "must be positive"));
        }
        self.rope_scaling.validate()?;
        if !(self.rms_eps > 0.0) {
            return Err(invalid("model.rms_eps", "must be positive"));
        }
        if self.vocab_multiple > 65_536 {
            return Err(invalid(
                "model.vocab_multiple",
                format!(
                    "{} pads too much: at most 65536 (Megatron's rule is 128)",
                    self.vocab_multiple
                ),
            ));
        }
        if self.vocab > u32::MAX as usize {
            return Err(invalid("model.vocab", "must fit in 32 bits"));
        }
        self.validate_moe()
    }

    /// Whether block `l` is a mixture-of-experts block.
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.experts > 0 && self.moe_every > 0 && (l + 1).is_multiple_of(self.moe_every)
    }

    /// Number of mixture-of-experts blocks (0 for a dense model).
    pub fn moe_layers(&self) -> usize {
        (0..self.layers).filter(|&l| self.is_moe_layer(l)).count()
    }

    /// Parameters of one expert: gate, up and down projections, `3·h·h_ff`.
    pub fn expert_params(&self) -> usize {
        3 * self.hidden * self.ffn
    }

    /// Exact parameter count Ψ of this model (playbook §2, GQA + SwiGLU + RMSNorm).
    pub fn num_params(&self) -> usize {
        let h = self.hidden;
        let d = self.head_dim();
        let attention = h * (self.heads * d)
            + 2 * h * (self.kv_heads * d)
            + (self.heads * d) * h
            + self.qkv_bias_params();
        let mlp = 3 * h * self.ffn;
        let per_layer = attention + mlp + 2 * h;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * h
        };
        // A mixture-of-experts block has E experts and the router `[E, h]` instead of one MLP.
        let moe =
            self.moe_layers() * (self.experts * self.expert_params() + self.experts * h - mlp);
        self.vocab * h + self.layers * per_layer + h + head + moe
    }

    /// Elements of one block's query, key and value biases (0 without [`Self::qkv_bias`]).
    pub fn qkv_bias_params(&self) -> usize {
        match self.qkv_bias {
            true => (self.heads + 2 * self.kv_heads) * self.head_dim(),
            false => 0,
        }
    }

    /// Parameters of every expert of every mixture-of-experts block (0 for a dense model).
    pub fn num_expert_params(&self) -> usize {
        self.moe_layers() * self.experts * self.expert_params()
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    fn err(sets: &[&str]) -> String {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::load(None, &sets).unwrap_err().to_string()
    }

    /// Megatron's rule: under TP the vocabulary is padded to a multiple of
    /// `vocab_multiple × tp` rows, split evenly; any vocabulary runs under any tp.
    #[test]
    fn the_vocabulary_is_padded_under_tp() {
        let sets = ["parallel.tp=2".to_string(), "model.vocab=65".to_string()];
        let config = Config::load(None, &sets).unwrap();
        assert_eq!(config.model.vocab_rows(2), 128);
        assert_eq!(config.model.vocab_valid_rows(2, 0), 65);
        assert_eq!(config.model.vocab_valid_rows(2, 1), 0);
        let mut gpt2 = config.model.clone();
        gpt2.vocab = 50257;
        assert_eq!(gpt2.vocab_rows(1), 50257, "nothing padded without TP");
        assert_eq!(
            2 * gpt2.vocab_rows(2),
            50432,
            "Megatron's 50,432 rows at tp = 2"
        );
        assert_eq!(8 * gpt2.vocab_rows(8), 51200);
        assert_eq!(gpt2.vocab_valid_rows(8, 7), 50257 - 7 * 6400);
        gpt2.vocab_multiple = 1;
        assert_eq!(gpt2.vocab_rows(2), 25129);
        assert_eq!(gpt2.vocab_valid_rows(2, 1), 25128);
        assert!(err(&["model.vocab_multiple=0"]).contains("model.vocab_multiple"));
        assert!(err(&["model.vocab_multiple=65537"]).contains("at most 65536"));
    }

    #[test]
    fn dense_default_is_unchanged() {
        let c = Config::default();
        assert_eq!(c.model.experts, 0);
        assert_eq!(c.model.moe_layers(), 0);
        assert_eq!(c.model.num_expert_params(), 0);
    }

    #[test]
    fn moe_fields_are_validated_with_the_field_named() {
        assert!(err(&["model.experts=4", "model.top_k=5"])
            .starts_with("config field `model.top_k`: top_k=5 with experts=4"));
        assert!(err(&["model.experts=4", "model.moe_every=0"])
            .starts_with("config field `model.moe_every`"));
        assert!(err(&["model.experts=4", "model.moe_every=5"])
            .starts_with("config field `model.moe_every`"));
        assert!(err(&["model.experts=4", "model.router_aux_loss_coef=-1.0"])
            .starts_with("config field `model.router_aux_loss_coef`"));
        assert!(err(&["parallel.ep=2", "parallel.dp=2"])
            .starts_with("config field `parallel.ep`: ep=2 needs a mixture-of-experts model"));
        assert!(err(&["model.experts=6", "parallel.ep=4", "parallel.dp=4"])
            .contains("ep=4 does not divide experts=6"));
        assert!(err(&["model.experts=4", "parallel.ep=4", "parallel.dp=2"])
            .contains("ep=4 does not divide dp=2"));
        Config::load(
            None,
            &[
                "model.experts=4".into(),
                "parallel.ep=2".into(),
                "parallel.dp=4".into(),
            ],
        )
        .unwrap();
    }

    #[test]
    fn moe_param_count_replaces_the_mlp_of_moe_blocks() {
        let mut c = Config::default().model;
        (c.experts, c.top_k, c.moe_every) = (4, 2, 2);
        let dense = Config::default().model.num_params();
        let (h, f, e) = (c.hidden, c.ffn, 4);
        // Blocks 1 and 3 of 4: the MLP becomes 4 experts and a router.
        assert_eq!(c.moe_layers(), 2);
        assert_eq!(
            c.num_params(),
            dense + 2 * (e * 3 * h * f + e * h - 3 * h * f)
        );
        assert_eq!(c.num_expert_params(), 2 * e * 3 * h * f);
    }
}
