//! The whole run configuration: model, parallel layout, training, data and output.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod dtype;
mod fp8;
mod loss_scale;

pub use dtype::DType;
pub use fp8::Fp8;
pub use loss_scale::LossScaleConfig;

use crate::{
    apply_override, ConfigError, DataConfig, ModelConfig, MuonConfig, Optimizer, ParallelConfig,
};

/// What a step whose loss or gradient norm is not finite does; either way it is not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// The run stops with an error naming the step, the value and what to change.
    #[default]
    Stop,
    /// The step's batch is skipped (gradients dropped, the data and schedule move on) and
    /// the run continues; its metrics row says `"skipped": true`.
    Skip,
}

/// Where a run's kernels and buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// The host: `gemm` and rayon (every build).
    #[default]
    Cpu,
    /// NVIDIA GPUs through CUDA (a build with `--features cuda`); rank `r` of the threads
    /// launcher uses GPU `r mod count`, an MPI rank its node-local rank's GPU.
    Cuda,
}

/// How a GPU runs attention over whole sequences (`train.attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// Flash attention in the backend's own tiled kernels (every device).
    #[default]
    Tiles,
    /// With `device = "cuda"`: the scores of each chunk of query rows as batched cuBLASLt
    /// products (TF32 tensor cores with `tf32`), a causal softmax kernel between them, in a
    /// counted workspace ([`crate::device_attention_score_bytes`]).
    Products,
}

/// The library that runs the linear layers' products on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Matmul {
    /// The `gemm` crate (every build; no system library).
    #[default]
    Gemm,
    /// OpenBLAS's `cblas_sgemm`, loaded at run time from a threaded `libopenblas.so.0`
    /// (Debian/Ubuntu: `libopenblas0-pthread`); faster than `gemm` on AVX2 machines.
    #[serde(rename = "openblas")]
    OpenBlas,
    /// With `dtype = "bf16"`: the products in bf16 with f32 sums, the linear layers' and the
    /// LM head's: on the CPU with AVX-512 BF16 (`vdpbf16ps`; needs `avx512_bf16`), on a GPU
    /// through cuBLASLt's tensor cores (`device = "cuda"`).
    Bf16,
}

impl Matmul {
    /// The value as `train.matmul` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Matmul::Gemm => "gemm",
            Matmul::OpenBlas => "openblas",
            Matmul::Bf16 => "bf16",
        }
    }
}

/// Optimisation and loop settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps (0 is allowed: load, evaluate, save).
    pub steps: usize,
    /// Sequences per micro-batch on each data-parallel rank `b`.
    pub micro_batch: usize,
    /// Micro-batches per step `m` (gradient accumulation).
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning-rate floor reached at the end of the cosine decay.
    pub min_lr: f64,
    /// Linear warmup steps.
    pub warmup_steps: usize,
    /// Adam β1.
    pub beta1: f64,
    /// Adam β2.
    pub beta2: f64,
    /// Adam ε.
    pub eps: f64,
    /// Decoupled weight decay (not applied to norm weights).
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables clipping.
    pub grad_clip: f64,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Storage precision.
    pub dtype: DType,
    /// With `dtype = "bf16"`: accumulate gradients over micro-batches in an fp32 buffer
    /// (`"fp16"` always does).
    pub fp32_grad_accum: bool,
    /// Compute threads per rank; 0 = the machine's cores shared among the ranks of one
    /// pipeline stage ([`crate::ParallelConfig::default_threads_per_rank`]).
    pub threads: usize,
    /// Tokens of the LM-head/cross-entropy chunk: full logits never exist at once.
    pub loss_chunk: usize,
    /// A step whose loss or gradient norm is not finite: `stop` (default) or `skip`.
    pub on_nonfinite: OnNonFinite,
    /// Where the kernels run: `"cpu"` or `"cuda"`.
    pub device: Device,
    /// With `device = "cuda"`: let f32 matmuls use TF32 tensor cores (faster, 10-bit
    /// mantissa products; off by default so f32 runs match the CPU to f32 rounding).
    pub tf32: bool,
    /// With `device = "cpu"`: the library of the linear layers' products, `"gemm"` (default)
    /// or `"openblas"`; with `dtype = "bf16"` also `"bf16"` (bf16 products, f32 sums).
    pub matmul: Matmul,
    /// With `device = "cuda"`: attention in the tiled kernels (`"tiles"`, default) or as
    /// batched products (`"products"`).
    pub attention: Attention,
    /// `"adamw"` (default) or `"muon"` (the blocks' matrices; AdamW for the rest).
    pub optimizer: Optimizer,
    /// Muon's settings, read with `optimizer = "muon"`.
    pub muon: MuonConfig,
    /// FP8 linear layers in the blocks: `"off"` (default), `"tensorwise"` or `"rowwise"`.
    pub fp8: Fp8,
    /// With `fp8 = "tensorwise"`: scale each operand by its largest magnitude over this many
    /// past steps (delayed scaling); 0 (default): by its own.
    pub fp8_amax_history: usize,
    /// Dynamic loss scaling, read with `dtype = "fp16"`.
    pub loss_scale: LossScaleConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 400,
            micro_batch: 8,
            grad_accum: 1,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 30,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 1234,
            dtype: DType::F32,
            fp32_grad_accum: false,
            threads: 0,
            loss_chunk: 256,
            on_nonfinite: OnNonFinite::Stop,
            device: Device::Cpu,
            tf32: false,
            matmul: Matmul::Gemm,
            attention: Attention::Tiles,
            optimizer: Optimizer::AdamW,
            muon: MuonConfig::default(),
            fp8: Fp8::Off,
            fp8_amax_history: 0,
            loss_scale: LossScaleConfig::default(),
        }
    }
}

/// Output settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Directory receiving `metrics.jsonl` and the run summary.
    pub dir: PathBuf,
    /// Log a line to the terminal every this many steps (the progress bar is always live).
    pub log_every: usize,
    /// Seconds a run may take, after SIGTERM, SIGINT or SIGUSR1, to finish its step and
    /// save a checkpoint before the process exits anyway (a second signal exits at once).
    pub signal_grace_s: f64,
    /// Write TensorBoard event files in `<dir>/tensorboard/` (the leader, as steps finish).
    pub tensorboard: bool,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            dir: PathBuf::from("runs/default"),
            log_every: 50,
            signal_grace_s: 60.0,
            tensorboard: true,
        }
    }
}

/// A complete, typed run configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Model shape.
    pub model: ModelConfig,
    /// Parallel layout.
    pub parallel: ParallelConfig,
    /// Optimisation.
    pub train: TrainConfig,
    /// Data source.
    pub data: DataConfig,
    /// Output.
    pub run: RunConfig,
    /// Periodic checkpoints.
    pub checkpoint: crate::CheckpointConfig,
}

/// The largest value of a count setting (degrees, micro-batch, accumulation, chunk): the
/// engine's validation and the planner's use the same bound.
pub const MAX_COUNT: usize = 1 << 20;

/// The largest vocabulary the built-in synthetic corpus is built for: its table takes time
/// and memory linear in the vocabulary (about 10 s and 1 GiB at this size).
pub const MAX_SYNTHETIC_VOCAB: usize = 1 << 20;

impl Config {
    /// Parses TOML text, applies `section.key=value` overrides, then validates.
    pub fn from_toml_with_overrides(text: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        for item in overrides {
            apply_override(&mut table, item)?;
        }
        let config: Config = table
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(crate::overrides::explain(&e)))?;
        config.validate()?;
        Ok(config)
    }

    /// This configuration with `section.key=value` overrides applied, validated again (e.g.
    /// a checkpoint's configuration, changed by the `--set` of a resumed run).
    pub fn with_overrides(&self, overrides: &[String]) -> Result<Self, ConfigError> {
        let text = toml::to_string(self).map_err(|e| ConfigError::Parse(e.to_string()))?;
        Self::from_toml_with_overrides(&text, overrides)
    }

    /// Reads a TOML file (or the defaults when `path` is `None`) and applies overrides.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|source| ConfigError::Io {
                path: p.display().to_string(),
                source,
            })?,
            None => String::new(),
        };
        Self::from_toml_with_overrides(&text, overrides)
    }

    /// Blocks of each virtual stage, in pipeline order ([`ferrotron_schedule::stage_sizes`]).
    pub fn stage_layers(&self) -> Vec<usize> {
        let p = &self.parallel;
        ferrotron_schedule::stage_sizes(
            self.model.layers,
            p.pp,
            p.chunks_per_rank(),
            p.pp_layers.as_deref(),
        )
    }

    /// The blocks pipeline rank `rank` holds, one global range per chunk in chunk order
    /// ([`ferrotron_schedule::rank_chunks`]).
    pub fn rank_chunks(&self, rank: usize) -> Vec<std::ops::Range<usize>> {
        let p = &self.parallel;
        ferrotron_schedule::rank_chunks(&self.stage_layers(), p.pp, rank, p.pp_schedule.placement())
    }

    /// The layout with its batch shape, as every command prints it
    /// ([`ParallelConfig::describe`]).
    pub fn describe_layout(&self) -> String {
        self.parallel
            .describe(self.train.micro_batch, self.train.grad_accum)
    }

    /// Sequences of one optimizer step's global batch: `b · m · N_d`.
    pub fn samples_per_step(&self) -> usize {
        self.train.micro_batch * self.train.grad_accum * self.parallel.dp
    }

    /// Tokens predicted per optimizer step (global batch): `b · m · N_d · s`.
    pub fn tokens_per_step(&self) -> usize {
        self.train.micro_batch * self.train.grad_accum * self.parallel.dp * self.model.seq_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn evaluation_with_pipeline_or_context_parallelism_is_refused_up_front() {
        for layout in ["parallel.pp=2", "parallel.cp=2"] {
            let sets = [layout.to_string(), "data.eval_path=\"x.bin\"".to_string()];
            let msg = Config::from_toml_with_overrides("", &sets)
                .unwrap_err()
                .to_string();
            assert!(msg.contains("data.eval_path"), "{layout}: {msg}");
        }
    }

    #[test]
    fn the_matmul_library_is_read_and_checked_against_the_device() {
        let c = Config::from_toml_with_overrides("[train]\nmatmul = \"openblas\"\n", &[]).unwrap();
        assert_eq!(c.train.matmul, Matmul::OpenBlas);
        let sets = [
            "train.matmul=\"openblas\"".into(),
            "train.device=\"cuda\"".into(),
        ];
        let msg = Config::from_toml_with_overrides("", &sets)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("train.matmul") && msg.contains("cuda"),
            "{msg}"
        );
        let msg = Config::from_toml_with_overrides("[train]\nmatmul = \"mkl\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("matmul") && msg.contains("openblas"), "{msg}");
        // bf16 products only in the bf16 regime: f32 stays f32.
        let bf16 = "[train]\nmatmul = \"bf16\"\n";
        let msg = Config::from_toml_with_overrides(bf16, &[])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("train.matmul") && msg.contains("train.dtype = \"bf16\""),
            "{msg}"
        );
        let c = Config::from_toml_with_overrides(bf16, &["train.dtype=\"bf16\"".into()]).unwrap();
        assert_eq!(c.train.matmul, Matmul::Bf16);
        // On a GPU, bf16 products are cuBLASLt's, in the bf16 regime only as well.
        let gpu = [
            "train.dtype=\"bf16\"".into(),
            "train.device=\"cuda\"".into(),
        ];
        let c = Config::from_toml_with_overrides(bf16, &gpu).unwrap();
        assert_eq!(c.train.matmul, Matmul::Bf16);
        let msg = Config::from_toml_with_overrides(bf16, &gpu[1..])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("train.dtype = \"bf16\""), "{msg}");
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml_with_overrides("[model]\nhiden = 3\n", &[]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("hiden"), "{msg}");
    }

    #[test]
    fn wrong_type_is_named() {
        let err = Config::from_toml_with_overrides("[train]\nsteps = \"many\"\n", &[]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("steps") || msg.contains("invalid type"),
            "{msg}"
        );
        assert!(msg.contains("invalid type"), "{msg}");
    }

    #[test]
    fn kv_heads_must_divide_heads() {
        let err = Config::load(None, &["model.kv_heads=3".into()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config field `model.kv_heads`: heads=4 is not divisible by kv_heads=3: kv_heads must divide heads"
        );
    }

    #[test]
    fn hidden_must_divide_by_heads() {
        let err = Config::load(None, &["model.hidden=130".into()]).unwrap_err();
        assert!(
            err.to_string()
                .contains("hidden=130 is not divisible by heads=4"),
            "{err}"
        );
    }

    #[test]
    fn tp_must_divide_heads_kv_heads_and_ffn_not_vocab() {
        let err = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::load(None, &sets).unwrap_err().to_string()
        };
        assert_eq!(
            err(&["parallel.tp=3", "model.heads=12", "model.hidden=96"]),
            "config field `model.kv_heads`: tp=3 does not divide kv_heads=4: choose tp among the divisors of kv_heads"
        );
        assert!(err(&["parallel.tp=8"]).contains("tp=8 does not divide heads=4"));
        assert!(err(&["parallel.tp=2", "model.ffn=383"]).contains("tp=2 does not divide ffn=383"));
        // The vocabulary is padded instead: see `model::tests::the_vocabulary_is_padded_under_tp`.
        assert!(err(&[
            "parallel.tp=4",
            "parallel.sequence_parallel=true",
            "train.micro_batch=1",
            "model.seq_len=6"
        ])
        .contains("sequence parallelism splits tokens evenly"));
        Config::load(
            None,
            &[
                "parallel.tp=2".into(),
                "parallel.sequence_parallel=true".into(),
            ],
        )
        .unwrap();
    }

    #[test]
    fn context_parallelism_needs_seq_len_divisible_by_twice_cp() {
        let err = Config::load(None, &["parallel.cp=3".into(), "model.seq_len=64".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.seq_len"), "{err}");
        assert!(err.contains("2 × parallel.cp = 6"), "{err}");
        Config::load(None, &["parallel.cp=4".into(), "model.seq_len=64".into()]).unwrap();
        let err = Config::load(
            None,
            &[
                "parallel.cp=2".into(),
                "parallel.tp=4".into(),
                "parallel.sequence_parallel=true".into(),
                "train.micro_batch=1".into(),
                "model.seq_len=12".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("micro_batch × seq_len / cp"), "{err}");
        let err = Config::load(None, &["parallel.ep=2".into(), "parallel.dp=2".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`parallel.ep`: ep=2 needs a mixture-of-experts model"),
            "{err}"
        );
    }

    #[test]
    fn override_sets_nested_values() {
        let c = Config::load(
            None,
            &[
                "train.dtype=bf16".into(),
                "model.layers=2".into(),
                "run.dir=/tmp/x".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.train.dtype, DType::Bf16);
        assert_eq!(c.model.layers, 2);
        assert_eq!(c.run.dir, PathBuf::from("/tmp/x"));
    }

    #[test]
    fn param_count_matches_hand_count() {
        let m = ModelConfig::default();
        // 4 layers × (4·128² attention + 3·128·384 MLP + 2·128 norms) + 2·64·128 + 128.
        let expected = 4 * (4 * 128 * 128 + 3 * 128 * 384 + 256) + 2 * 64 * 128 + 128;
        assert_eq!(m.num_params(), expected);
    }
}
