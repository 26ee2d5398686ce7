//! `config.json` as transformers 4.x and 5.x write it, read into a [`ModelConfig`].
//!
//! Both spellings are read: `rope_theta` (4.x) or `rope_parameters.rope_theta` (5.x),
//! `rope_scaling` (4.x) or `rope_parameters` (5.x) for the RoPE scaling, and `torch_dtype`
//! (4.x) or `dtype` (5.x). Architectures: `LlamaForCausalLM`, `MistralForCausalLM` (with no
//! sliding window, or one at least as long as the context), `MixtralForCausalLM` and
//! `Qwen2ForCausalLM` (its q/k/v projection biases: [`ModelConfig::qkv_bias`]).
//!
//! Every field that would change the math and is not implemented is refused with its key and
//! value rather than ignored: another activation, another RoPE type, attention or MLP biases
//! on Llama (`attention_bias` would add one to the output projection too), an active sliding
//! window or another layer type, dropout, router jitter, and the soft-capping and
//! scaling fields of other families. A `head_dim` other than `hidden_size /
//! num_attention_heads` is implemented.

use ferrotron_config::{DType, ModelConfig, RopeScaling};
use serde_json::{Map, Value};

/// The model types read, with their `architectures` entry and default RoPE base.
const FAMILIES: [(&str, &str, f64); 4] = [
    ("llama", "LlamaForCausalLM", 10000.0),
    ("mistral", "MistralForCausalLM", 10000.0),
    ("mixtral", "MixtralForCausalLM", 1e6),
    ("qwen2", "Qwen2ForCausalLM", 10000.0),
];

/// The model type whose query, key and value projections have biases.
const QKV_BIAS_FAMILY: &str = "qwen2";

/// Keys that change the math and are not implemented, with their neutral value (`None`: any
/// value but null or false is refused).
const UNSUPPORTED: [(&str, Option<f64>); 12] = [
    ("attention_dropout", Some(0.0)),
    ("router_jitter_noise", Some(0.0)),
    ("attn_logit_softcapping", None),
    ("final_logit_softcapping", None),
    ("query_pre_attn_scalar", None),
    ("use_qk_norm", None),
    ("qk_layernorm", None),
    ("attention_multiplier", None),
    ("logits_scaling", Some(1.0)),
    ("embedding_multiplier", Some(1.0)),
    ("residual_multiplier", Some(1.0)),
    ("partial_rotary_factor", Some(1.0)),
];

/// What a `config.json` says: the model, its stored dtype, and its longest trained context.
pub struct HfShape {
    /// The model (its `seq_len` is `max_position_embeddings`).
    pub model: ModelConfig,
    /// Storage dtype (`float16` is read as f32).
    pub dtype: DType,
}

fn field<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn count(o: &Map<String, Value>, key: &str) -> Result<usize, String> {
    let v = field(o, key).ok_or_else(|| format!("missing field `{key}`"))?;
    v.as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| format!("`{key}` = {v} is not a non-negative integer"))
}

fn number(o: &Map<String, Value>, key: &str, default: f64) -> Result<f64, String> {
    match field(o, key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| format!("`{key}` = {v} is not a number")),
    }
}

fn flag(o: &Map<String, Value>, key: &str) -> bool {
    field(o, key).and_then(Value::as_bool).unwrap_or(false)
}

/// Refuses `key` when set to anything but null, false or its `neutral` value.
fn refuse_if_set(o: &Map<String, Value>, key: &str, neutral: Option<f64>) -> Result<(), String> {
    match field(o, key) {
        Some(v) if v.as_bool() != Some(false) && (neutral.is_none() || v.as_f64() != neutral) => {
            Err(format!(
                "`{key}` = {v} changes the model's math and is not implemented"
            ))
        }
        _ => Ok(()),
    }
}

/// Reads the model of a `config.json`'s JSON.
pub fn read(json: &Value) -> Result<HfShape, String> {
    let o = json.as_object().ok_or("is not a JSON object")?;
    let kind = field(o, "model_type")
        .and_then(Value::as_str)
        .unwrap_or("llama");
    let Some(&(_, _, default_theta)) = FAMILIES.iter().find(|f| f.0 == kind) else {
        return Err(format!(
            "`model_type` = {kind:?}: ferrotron reads llama, mistral, mixtral and qwen2 models"
        ));
    };
    if let Some(archs) = field(o, "architectures").and_then(Value::as_array) {
        for a in archs {
            if !FAMILIES.iter().any(|f| Some(f.1) == a.as_str()) {
                return Err(format!(
                    "`architectures` holds {a}: ferrotron reads LlamaForCausalLM, \
                     MistralForCausalLM, MixtralForCausalLM and Qwen2ForCausalLM"
                ));
            }
        }
    }
    check_math(o)?;
    let heads = count(o, "num_attention_heads")?;
    let hidden = count(o, "hidden_size")?;
    // A head dimension other than hidden / heads is kept (the query projection is then
    // [heads·d, hidden]).
    let head_dim = match field(o, "head_dim").map(|v| (v, v.as_u64())) {
        None => None,
        Some((_, Some(d))) if heads > 0 && d as usize == hidden / heads => None,
        Some((_, Some(d))) => Some(d as usize),
        Some((v, None)) => return Err(format!("`head_dim` = {v} is not a positive integer")),
    };
    let (rope_theta, rope_scaling) = rope(o, default_theta)?;
    let max_positions = count(o, "max_position_embeddings")?;
    check_window(o, max_positions)?;
    let model = ModelConfig {
        hidden,
        layers: count(o, "num_hidden_layers")?,
        heads,
        head_dim,
        kv_heads: field(o, "num_key_value_heads")
            .map_or(Ok(heads), |_| count(o, "num_key_value_heads"))?,
        ffn: count(o, "intermediate_size")?,
        vocab: count(o, "vocab_size")?,
        vocab_multiple: ModelConfig::default().vocab_multiple,
        seq_len: max_positions,
        rope_theta,
        rope_scaling,
        rms_eps: number(o, "rms_norm_eps", 1e-6)?,
        tie_embeddings: flag(o, "tie_word_embeddings"),
        qkv_bias: kind == QKV_BIAS_FAMILY,
        experts: field(o, "num_local_experts").map_or(Ok(0), |_| count(o, "num_local_experts"))?,
        top_k: field(o, "num_experts_per_tok")
            .map_or(Ok(2), |_| count(o, "num_experts_per_tok"))?,
        moe_every: field(o, "moe_every").map_or(Ok(1), |_| count(o, "moe_every"))?,
        router_aux_loss_coef: number(o, "router_aux_loss_coef", 0.001)?,
        moe_balance: ModelConfig::default().moe_balance,
        moe_bias_rate: ModelConfig::default().moe_bias_rate,
        moe_capacity_factor: None,
    };
    let dtype_key = if field(o, "dtype").is_some() {
        "dtype"
    } else {
        "torch_dtype"
    };
    let dtype = match field(o, dtype_key).and_then(Value::as_str) {
        Some("bfloat16") => DType::Bf16,
        None | Some("float32") | Some("float16") | Some("auto") => DType::F32,
        Some(other) => return Err(format!("`{dtype_key}` = {other:?} is not a float dtype")),
    };
    Ok(HfShape { model, dtype })
}

/// Refuses the fields that change the math and are not implemented.
fn check_math(o: &Map<String, Value>) -> Result<(), String> {
    if let Some(act) = field(o, "hidden_act") {
        if act.as_str() != Some("silu") {
            return Err(format!(
                "`hidden_act` = {act}: only silu (SwiGLU) is implemented"
            ));
        }
    }
    for (key, what) in [
        ("attention_bias", "a bias in the attention projections"),
        ("mlp_bias", "a bias in the MLP projections"),
    ] {
        if flag(o, key) {
            return Err(format!("`{key}` = true: {what} is not implemented"));
        }
    }
    for (key, neutral) in UNSUPPORTED {
        refuse_if_set(o, key, neutral)?;
    }
    Ok(())
}

/// An active sliding window (shorter than the context) is refused, and so is any layer type
/// but full attention.
fn check_window(o: &Map<String, Value>, max_positions: usize) -> Result<(), String> {
    if let Some(types) = field(o, "layer_types").and_then(Value::as_array) {
        if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
            return Err(format!(
                "`layer_types` holds {t}: only full_attention layers are implemented"
            ));
        }
    }
    if field(o, "use_sliding_window").and_then(Value::as_bool) == Some(false) {
        return Ok(());
    }
    match field(o, "sliding_window").map(|v| (v, v.as_u64())) {
        Some((_, Some(w))) if w as usize >= max_positions => Ok(()),
        None => Ok(()),
        Some((v, _)) => Err(format!(
            "`sliding_window` = {v} is shorter than max_position_embeddings = {max_positions}: \
             sliding-window attention is not implemented"
        )),
    }
}

/// RoPE base and scaling from `rope_parameters` (5.x) or `rope_theta` / `rope_scaling` (4.x).
fn rope(o: &Map<String, Value>, default_theta: f64) -> Result<(f64, RopeScaling), String> {
    let (key, params) = match (field(o, "rope_parameters"), field(o, "rope_scaling")) {
        (Some(p), _) => ("rope_parameters", p.as_object()),
        (None, Some(p)) => ("rope_scaling", p.as_object()),
        (None, None) => ("rope_parameters", None),
    };
    let empty = Map::new();
    let p = params.unwrap_or(&empty);
    let theta = match field(p, "rope_theta") {
        Some(_) => number(p, "rope_theta", default_theta)?,
        None => number(o, "rope_theta", default_theta)?,
    };
    refuse_if_set(p, "partial_rotary_factor", Some(1.0))?;
    let kind = field(p, "rope_type")
        .or_else(|| field(p, "type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |name: &str| {
        number(p, name, f64::NAN).and_then(|x| {
            if x.is_nan() {
                Err(format!("`{key}.{name}` is missing for rope type {kind:?}"))
            } else {
                Ok(x)
            }
        })
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: need("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")? as usize,
        },
        other => {
            return Err(format!(
                "`{key}.rope_type` = {other:?}: only default, linear and llama3 RoPE are \
                 implemented"
            ))
        }
    };
    Ok((theta, scaling))
}

/// The `rope_parameters` object transformers 5 writes for `cfg`.
pub fn rope_parameters(cfg: &ModelConfig) -> Value {
    let mut p = Map::new();
    p.insert("rope_theta".into(), cfg.rope_theta.into());
    match cfg.rope_scaling {
        RopeScaling::None => {
            p.insert("rope_type".into(), "default".into());
        }
        RopeScaling::Linear { factor } => {
            p.insert("rope_type".into(), "linear".into());
            p.insert("factor".into(), factor.into());
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            p.insert("rope_type".into(), "llama3".into());
            p.insert("factor".into(), factor.into());
            p.insert("low_freq_factor".into(), low_freq_factor.into());
            p.insert("high_freq_factor".into(), high_freq_factor.into());
            p.insert(
                "original_max_position_embeddings".into(),
                original_max_position_embeddings.into(),
            );
        }
    }
    Value::Object(p)
}
