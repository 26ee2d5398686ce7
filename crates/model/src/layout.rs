//! The flat parameter layout: named views into one contiguous buffer (llm.c style).

use std::ops::Range;

use ferrotron_config::ModelConfig;

use crate::Unit;

/// One parameter: its Hugging Face name, shape and place in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Shape, row-major (`[out, in]` for linear weights).
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Whether AdamW weight decay applies (not to norm weights).
    pub decay: bool,
    /// Standard deviation of the initial normal draw; `None` means initialised to ones.
    pub init_std: Option<f64>,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Element range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// Indices (into [`ParamLayout::params`]) of one block's parameters.
#[derive(Debug, Clone, Copy)]
pub struct LayerParams {
    /// `input_layernorm.weight` `[h]`.
    pub attn_norm: usize,
    /// `self_attn.q_proj.weight` `[a·d, h]`.
    pub q: usize,
    /// `self_attn.k_proj.weight` `[a_kv·d, h]`.
    pub k: usize,
    /// `self_attn.v_proj.weight` `[a_kv·d, h]`.
    pub v: usize,
    /// `self_attn.o_proj.weight` `[h, a·d]`.
    pub o: usize,
    /// `post_attention_layernorm.weight` `[h]`.
    pub mlp_norm: usize,
    /// `mlp.gate_proj.weight` `[h_ff, h]`.
    pub gate: usize,
    /// `mlp.up_proj.weight` `[h_ff, h]`.
    pub up: usize,
    /// `mlp.down_proj.weight` `[h, h_ff]`.
    pub down: usize,
}

/// Every parameter of the model, laid out embedding first, then block by block, then the
/// final norm and the LM head (absent when tied).
#[derive(Debug, Clone)]
pub struct ParamLayout {
    /// All parameters in buffer order.
    pub params: Vec<ParamSpec>,
    /// Per-block indices.
    pub layers: Vec<LayerParams>,
    /// `model.embed_tokens.weight` `[v, h]`.
    pub embed: usize,
    /// `model.norm.weight` `[h]`.
    pub final_norm: usize,
    /// `lm_head.weight` `[v, h]` (the embedding when tied).
    pub head: usize,
    /// Total elements Ψ.
    pub total: usize,
}

/// Standard deviation of weight matrices (GPT-2/Llama practice).
const INIT_STD: f64 = 0.02;

impl ParamLayout {
    /// The layout of `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        let (h, d, f, v) = (cfg.hidden, cfg.head_dim(), cfg.ffn, cfg.vocab);
        // Residual projections are scaled down by √(2L) so the residual stream's variance
        // does not grow with depth.
        let resid_std = INIT_STD / (2.0 * cfg.layers as f64).sqrt();
        let mut params = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, shape: Vec<usize>, init_std: Option<f64>| {
            let spec = ParamSpec {
                name,
                shape,
                offset,
                decay: init_std.is_some(),
                init_std,
            };
            offset += spec.numel();
            params.push(spec);
            params.len() - 1
        };
        let embed = push(
            "model.embed_tokens.weight".into(),
            vec![v, h],
            Some(INIT_STD),
        );
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            layers.push(LayerParams {
                attn_norm: push(p("input_layernorm.weight"), vec![h], None),
                q: push(
                    p("self_attn.q_proj.weight"),
                    vec![cfg.heads * d, h],
                    Some(INIT_STD),
                ),
                k: push(
                    p("self_attn.k_proj.weight"),
                    vec![cfg.kv_heads * d, h],
                    Some(INIT_STD),
                ),
                v: push(
                    p("self_attn.v_proj.weight"),
                    vec![cfg.kv_heads * d, h],
                    Some(INIT_STD),
                ),
                o: push(
                    p("self_attn.o_proj.weight"),
                    vec![h, cfg.heads * d],
                    Some(resid_std),
                ),
                mlp_norm: push(p("post_attention_layernorm.weight"), vec![h], None),
                gate: push(p("mlp.gate_proj.weight"), vec![f, h], Some(INIT_STD)),
                up: push(p("mlp.up_proj.weight"), vec![f, h], Some(INIT_STD)),
                down: push(p("mlp.down_proj.weight"), vec![h, f], Some(resid_std)),
            });
        }
        let final_norm = push("model.norm.weight".into(), vec![h], None);
        let head = if cfg.tie_embeddings {
            embed
        } else {
            push("lm_head.weight".into(), vec![v, h], Some(INIT_STD))
        };
        let total = offset;
        ParamLayout {
            params,
            layers,
            embed,
            final_norm,
            head,
            total,
        }
    }

    /// The parameter called `name`.
    pub fn find(&self, name: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Units in forward order: embedding, blocks, head.
    pub fn units(&self) -> Vec<Unit> {
        let mut u = vec![Unit::Embed];
        u.extend((0..self.layers.len()).map(Unit::Block));
        u.push(Unit::Head);
        u
    }

    /// Indices of the parameters a unit owns.
    pub fn unit_params(&self, unit: Unit) -> Vec<usize> {
        match unit {
            Unit::Embed => vec![self.embed],
            Unit::Block(l) => {
                let p = &self.layers[l];
                vec![
                    p.attn_norm,
                    p.q,
                    p.k,
                    p.v,
                    p.o,
                    p.mlp_norm,
                    p.gate,
                    p.up,
                    p.down,
                ]
            }
            Unit::Head if self.head == self.embed => vec![self.final_norm],
            Unit::Head => vec![self.final_norm, self.head],
        }
    }

    /// The flat range a unit covers (its parameters are contiguous).
    pub fn unit_range(&self, unit: Unit) -> Range<usize> {
        let params = self.unit_params(unit);
        let first = &self.params[params[0]];
        let last = &self.params[*params.last().expect("a unit has parameters")];
        first.offset..last.offset + last.numel()
    }

    /// The unit that owns flat element `index`.
    pub fn unit_of(&self, index: usize) -> Unit {
        self.units()
            .into_iter()
            .find(|u| self.unit_range(*u).contains(&index))
            .expect("index inside the layout")
    }

    /// Element range of parameter `index`.
    pub fn range(&self, index: usize) -> Range<usize> {
        self.params[index].range()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_equals_config_param_count() {
        for tie in [false, true] {
            let cfg = ModelConfig {
                kv_heads: 2,
                tie_embeddings: tie,
                ..ModelConfig::default()
            };
            let layout = ParamLayout::new(&cfg);
            assert_eq!(layout.total, cfg.num_params());
            let last = layout.params.last().unwrap();
            assert_eq!(last.offset + last.numel(), layout.total);
            // Units tile the buffer without gaps, in order.
            let mut next = 0;
            for u in layout.units() {
                let r = layout.unit_range(u);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, layout.total);
        }
    }
}
