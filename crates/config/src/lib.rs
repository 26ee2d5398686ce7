//! Typed configuration of a ferrotron run.
//!
//! A run is described by one TOML document with the sections `model`, `parallel`, `train`,
//! `data`, `run` and `checkpoint`. Every section rejects unknown keys, every value is type-checked by
//! serde, and [`Config::validate`] checks the relations between fields (divisibility of
//! heads, sequence length against data, …) before anything is allocated. Command-line
//! overrides (`--set section.key=value`) are applied to the TOML tree before it is typed,
//! so they get exactly the same checks as the file.

#![warn(missing_docs)]
// `!(x > 0.0)` is deliberate throughout validation: NaN must fail every range check.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

mod buckets;
mod checkpoint;
mod data;
pub mod flops;
mod memory;
mod model;
mod optimizer;
mod overrides;
mod parallel;
mod run;
mod scratch;
mod validate;

pub use buckets::{bucket_elems, bucket_units, piece, BucketSpan, BucketUnit};
pub use checkpoint::CheckpointConfig;
pub use data::DataConfig;
pub use memory::MemoryCategory;
pub use model::{expert_capacity, ModelConfig, MoeBalance, RopeScaling};
pub use optimizer::{
    newton_schulz_flops, newton_schulz_scratch_elems, MuonConfig, MuonScale, Optimizer,
    MAX_NS_STEPS,
};
pub use overrides::apply_override;
pub use parallel::{CommBackend, CpKind, ParallelConfig, PpSchedule, Recompute};
pub use run::{
    Attention, Config, DType, Device, Fp8, LossScaleConfig, Matmul, OnNonFinite, RunConfig,
    TrainConfig, MAX_COUNT, MAX_SYNTHETIC_VOCAB,
};
pub use scratch::{
    attention_head_ld, attention_score_rows, attention_scratch_per_thread,
    device_attention_score_bytes, device_bf16_operand_bytes, device_bf16_second_operand,
    forward_transposes_weight, linear_pack_bytes, step_gemm_pack_bytes, step_matmul_scratch_bytes,
    LinearProduct, ATTENTION_TILE_KEYS, ATTENTION_TILE_ROWS, BF16_GEMM_COLS, BF16_GEMM_DEPTH,
    BF16_GEMM_PER_THREAD_BYTES, BF16_GEMM_ROWS, BF16_GEMM_SHARED_BYTES, BF16_OPERAND_ALIGN,
    BLAS_BLOCK, BLAS_SCRATCH_PER_THREAD, GEMM_DEPTH_BLOCK, TRANSPOSED_FORWARD_MIN_TOKENS,
};

/// Everything that can be wrong with a configuration, each variant naming the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The TOML text could not be parsed or typed (unknown key, wrong type, …).
    #[error("config: {0}")]
    Parse(String),
    /// A `--set` override was malformed.
    #[error("override `{0}`: {1}")]
    Override(String, String),
    /// A field has a value that is out of range or inconsistent with another field.
    #[error("config field `{field}`: {message}")]
    Invalid {
        /// Dotted path of the offending field, e.g. `model.kv_heads`.
        field: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// Reading the configuration file failed.
    #[error("config file {path}: {source}")]
    Io {
        /// The file that could not be read.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Shorthand for a [`ConfigError::Invalid`].
pub(crate) fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}
