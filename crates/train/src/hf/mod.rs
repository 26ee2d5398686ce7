//! Hugging Face Llama model directories: `config.json` (LlamaForCausalLM fields) and
//! `model.safetensors` with Hugging Face parameter names, so a model trained here loads in
//! `transformers` and the other way round. A model with q/k/v biases is written as a
//! `Qwen2ForCausalLM`, a mixture-of-experts model as a `MixtralForCausalLM` (`num_local_experts`, `num_experts_per_tok`, `router_aux_loss_coef`;
//! a `moe_every` other than 1, which Mixtral does not have, is written as an extra field).
//!
//! `config.json` is read as transformers 4.x and 5.x write it (`config.rs`) and written in
//! both spellings (`rope_parameters` and `rope_theta`, `dtype` and `torch_dtype`).
//!
//! Saving is deterministic (same weights → same bytes) and atomic per file.

mod config;
pub mod shards;

use std::path::Path;

use ferrotron_config::{DType, ModelConfig};
use ferrotron_data::token_file::write_atomic;
use ferrotron_model::ParamLayout;
use ferrotron_tensor::{bf16, Ledger, Store};

use crate::optim::CHECKPOINT;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde::Serialize;

use crate::{io_err, TrainError};

/// The `config.json` fields of a Hugging Face `LlamaForCausalLM` (or `MixtralForCausalLM`).
#[derive(Debug, Clone, Serialize)]
pub struct HfLlamaConfig {
    /// `["LlamaForCausalLM"]`, `["MixtralForCausalLM"]` with experts, `["Qwen2ForCausalLM"]`
    /// with q/k/v biases.
    pub architectures: Vec<String>,
    /// `"llama"`, `"mixtral"` or `"qwen2"`.
    pub model_type: String,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP inner size.
    pub intermediate_size: usize,
    /// Blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Head dimension.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence (the training `seq_len`).
    pub max_position_embeddings: usize,
    /// RoPE base (transformers 4.x).
    pub rope_theta: f64,
    /// RoPE base, type and scaling (transformers 5.x).
    pub rope_parameters: serde_json::Value,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Whether the LM head shares the embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Always `"silu"`.
    pub hidden_act: String,
    /// `"float32"` or `"bfloat16"` (transformers 4.x).
    pub torch_dtype: String,
    /// The same (transformers 5.x).
    pub dtype: String,
    /// Llama, Mistral, Mixtral: always false here (absent for Qwen2, whose q/k/v biases are
    /// implied by its type).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// The same for the MLP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    /// Qwen2: always false (no sliding window).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    /// Mixtral: experts per block.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_local_experts: Option<usize>,
    /// Mixtral: experts each token is routed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_tok: Option<usize>,
    /// Mixtral: weight of the load-balancing loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_aux_loss_coef: Option<f64>,
    /// ferrotron: every how many blocks one is a mixture of experts (absent: every block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_every: Option<usize>,
}

const CONFIG: &str = "config.json";

fn model_err(dir: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Model {
        dir: dir.to_path_buf(),
        message: message.into(),
    }
}

/// Writes `weights` (laid out by `layout`) as a Hugging Face model directory, in shards of
/// at most `max_shard` bytes with an index when larger ([`shards::DEFAULT_MAX_SHARD`] is
/// transformers' default).
pub fn save_model(
    dir: &Path,
    cfg: &ModelConfig,
    layout: &ParamLayout,
    weights: &Store,
    ledger: &Ledger,
    max_shard: u64,
) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
    let (st_dtype, torch_dtype) = match weights {
        Store::F32(_) => (StDtype::F32, "float32"),
        Store::Bf16(_) => (StDtype::BF16, "bfloat16"),
        Store::F16(_) => (StDtype::F16, "float16"),
    };
    let moe = cfg.experts > 0;
    let (arch, kind) = match (moe, cfg.qkv_bias) {
        (true, _) => ("MixtralForCausalLM", "mixtral"),
        (false, true) => ("Qwen2ForCausalLM", "qwen2"),
        (false, false) => ("LlamaForCausalLM", "llama"),
    };
    let llama_bias = (!cfg.qkv_bias).then_some(false);
    let hf = HfLlamaConfig {
        architectures: vec![arch.into()],
        model_type: kind.into(),
        hidden_size: cfg.hidden,
        intermediate_size: cfg.ffn,
        num_hidden_layers: cfg.layers,
        num_attention_heads: cfg.heads,
        num_key_value_heads: cfg.kv_heads,
        head_dim: Some(cfg.head_dim()),
        vocab_size: cfg.vocab,
        max_position_embeddings: cfg.seq_len,
        rope_theta: cfg.rope_theta,
        rope_parameters: config::rope_parameters(cfg),
        rms_norm_eps: cfg.rms_eps,
        tie_word_embeddings: cfg.tie_embeddings,
        hidden_act: "silu".into(),
        torch_dtype: torch_dtype.into(),
        dtype: torch_dtype.into(),
        attention_bias: llama_bias,
        mlp_bias: llama_bias,
        use_sliding_window: cfg.qkv_bias.then_some(false),
        num_local_experts: moe.then_some(cfg.experts),
        num_experts_per_tok: moe.then_some(cfg.top_k),
        router_aux_loss_coef: moe.then_some(cfg.router_aux_loss_coef),
        moe_every: (moe && cfg.moe_every != 1).then_some(cfg.moe_every),
    };
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = layout
        .params
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                p.shape.clone(),
                weights.to_le_bytes(ledger, CHECKPOINT, p.range()),
            )
        })
        .collect();
    shards::write(dir, &bytes, st_dtype, max_shard)?;
    let mut json = serde_json::to_string_pretty(&hf).expect("config serialises");
    json.push('\n');
    write_atomic(&dir.join(CONFIG), json.as_bytes())?;
    Ok(())
}

/// A model read from a Hugging Face directory.
pub struct LoadedModel {
    /// Shape (its `seq_len` is `max_position_embeddings`).
    pub config: ModelConfig,
    /// Storage dtype of the checkpoint.
    pub dtype: DType,
    /// Every parameter in the layout's order, as f32.
    pub weights: Vec<f32>,
}

/// Reads the model shape of a directory's `config.json`.
pub fn load_config(dir: &Path) -> Result<(ModelConfig, DType), TrainError> {
    let path = dir.join(CONFIG);
    if !dir.is_dir() {
        return Err(model_err(
            dir,
            "is not a directory; pass the directory written by --save-model",
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(io_err("read", &path))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| model_err(dir, format!("{CONFIG}: {e}")))?;
    let shape = config::read(&json).map_err(|e| model_err(dir, format!("{CONFIG}: {e}")))?;
    let (cfg, dtype) = (shape.model, shape.dtype);
    cfg.validate()
        .map_err(|e| model_err(dir, format!("{CONFIG}: {e}")))?;
    Ok((cfg, dtype))
}

/// The end-of-sequence id of model directory `dir`'s `config.json` (`eos_token_id`), if it
/// names one (a list of several: none).
pub fn eos_token_id(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("eos_token_id")?.as_u64().map(|x| x as u32)
}

/// Reads a Hugging Face Llama directory, checking every tensor's presence, dtype and shape
/// against its `config.json`.
pub fn load_model(dir: &Path) -> Result<LoadedModel, TrainError> {
    let (config, dtype) = load_config(dir)?;
    let layout = ParamLayout::new(&config);
    let files = shards::open(dir)?;
    let parsed = files
        .maps
        .iter()
        .map(|(path, map)| {
            SafeTensors::deserialize(map).map_err(|e| {
                model_err(
                    dir,
                    format!(
                        "{} is not a valid safetensors file ({e}); it may be truncated",
                        path.display()
                    ),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut weights = vec![0.0f32; layout.total];
    for spec in &layout.params {
        let missing = || {
            model_err(
                dir,
                format!(
                    "the weights have no tensor `{}`, which config.json implies",
                    spec.name
                ),
            )
        };
        let file = match files.weight_map.is_empty() {
            true => 0,
            false => *files.weight_map.get(&spec.name).ok_or_else(missing)?,
        };
        let t = parsed[file].tensor(&spec.name).map_err(|_| missing())?;
        if t.shape() != spec.shape.as_slice() {
            return Err(model_err(
                dir,
                format!(
                    "`{}` has shape {:?} but config.json implies {:?}",
                    spec.name,
                    t.shape(),
                    spec.shape
                ),
            ));
        }
        let out = &mut weights[spec.range()];
        let data = t.data();
        match t.dtype() {
            StDtype::F32 => out.iter_mut().zip(data.chunks_exact(4)).for_each(|(o, b)| {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }),
            StDtype::BF16 => out.iter_mut().zip(data.chunks_exact(2)).for_each(|(o, b)| {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }),
            StDtype::F16 => out.iter_mut().zip(data.chunks_exact(2)).for_each(|(o, b)| {
                *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }),
            other => {
                return Err(model_err(
                    dir,
                    format!("`{}` has unsupported dtype {other:?}", spec.name),
                ))
            }
        }
    }
    Ok(LoadedModel {
        config,
        dtype,
        weights,
    })
}
