//! Inference of a loaded model on the host (`generate`), one position at a time, with a
//! key/value cache:
//! each new token runs through the blocks once, its keys and values (after RoPE) are appended
//! to every layer's cache, and its query attends to the cache with the ring-attention kernel
//! (query position `p` against key positions `0..=p`). Without the cache every step
//! recomputes the whole sequence; both give the same logits.
//!
//! The math is the training model's (the same CPU kernels): RMSNorm, RoPE with the model's
//! scaling, grouped-query causal attention, SwiGLU or a Mixtral mixture of experts. Weights
//! are a plain host vector in the layout's order (as [`crate::hf::load_model`] reads them),
//! not the engine's device buffers.

use ferrotron_config::ModelConfig;
use ferrotron_model::ParamLayout;
use ferrotron_tensor::linear::{bias_forward, linear_forward};
use ferrotron_tensor::moe::route;
use ferrotron_tensor::ring_attention::{block_forward, BlockShape};
use ferrotron_tensor::rmsnorm::rmsnorm_forward;
use ferrotron_tensor::rope::{rope_apply, RopeTable};
use ferrotron_tensor::swiglu::swiglu_forward;

/// A model's weights by Hugging Face name, and its RoPE table.
pub struct Decoder {
    cfg: ModelConfig,
    layout: ParamLayout,
    weights: Vec<f32>,
    rope: RopeTable,
}

/// Every layer's keys and values so far, `[positions, kv_heads·d]` each.
#[derive(Default)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self, kv_width: usize) -> usize {
        self.keys.first().map_or(0, |k| k.len() / kv_width)
    }
}

impl Decoder {
    /// A decoder for `weights` (the layout's order) of `cfg`, for positions below `max_len`.
    pub fn new(cfg: ModelConfig, weights: Vec<f32>, max_len: usize) -> Decoder {
        let layout = ParamLayout::new(&cfg);
        let rope = RopeTable::scaled(max_len, cfg.head_dim(), cfg.rope_theta, cfg.rope_scaling);
        Decoder {
            cfg,
            layout,
            weights,
            rope,
        }
    }

    fn w(&self, name: &str) -> &[f32] {
        let spec = self
            .layout
            .find(name)
            .unwrap_or_else(|| panic!("the layout has no {name}"));
        &self.weights[spec.range()]
    }

    fn has(&self, name: &str) -> bool {
        self.layout.find(name).is_some()
    }

    /// Logits of the last of `tokens`, which sit at positions `cache.len()..` and are added
    /// to `cache`.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Vec<f32> {
        self.run(tokens, cache, tokens.len().saturating_sub(1))
    }

    /// Logits of every one of `tokens` (positions `0..`), `[t, vocab]`.
    pub fn logits(&self, tokens: &[u32]) -> Vec<f32> {
        self.run(tokens, &mut KvCache::default(), 0)
    }

    /// Logits of `tokens[from..]`.
    fn run(&self, tokens: &[u32], cache: &mut KvCache, from: usize) -> Vec<f32> {
        let c = &self.cfg;
        let (h, t) = (c.hidden, tokens.len());
        let kv_width = c.kv_heads * c.head_dim();
        if cache.keys.is_empty() {
            cache.keys = vec![Vec::new(); c.layers];
            cache.values = vec![Vec::new(); c.layers];
        }
        let start = cache.len(kv_width);
        let table = self.w("model.embed_tokens.weight");
        let mut x: Vec<f32> = tokens
            .iter()
            .flat_map(|&tok| {
                table[tok as usize * h..(tok as usize + 1) * h]
                    .iter()
                    .copied()
            })
            .collect();
        let positions: Vec<usize> = (start..start + t).collect();
        for l in 0..c.layers {
            let p = format!("model.layers.{l}");
            let xn = self.norm(&x, &format!("{p}.input_layernorm.weight"));
            let attn = self.attention(&p, &xn, &positions, l, cache);
            add(&mut x, &attn);
            let xn = self.norm(&x, &format!("{p}.post_attention_layernorm.weight"));
            let mlp = if self.has(&format!("{p}.block_sparse_moe.gate.weight")) {
                self.experts(&p, &xn)
            } else {
                self.mlp(
                    &format!("{p}.mlp"),
                    &xn,
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                )
            };
            add(&mut x, &mlp);
        }
        let rows = self.norm(&x[from * h..], "model.norm.weight");
        let head = if c.tie_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let n = t - from;
        let mut logits = vec![0.0; n * c.vocab];
        linear_forward(&mut logits, &rows, self.w(head), n, h, c.vocab);
        logits
    }

    fn norm(&self, x: &[f32], name: &str) -> Vec<f32> {
        let h = self.cfg.hidden;
        let mut y = vec![0.0; x.len()];
        let mut rstd = vec![0.0; x.len() / h];
        rmsnorm_forward(
            &mut y,
            &mut rstd,
            x,
            self.w(name),
            h,
            self.cfg.rms_eps as f32,
        );
        y
    }

    fn project(&self, x: &[f32], name: &str, d_in: usize, d_out: usize) -> Vec<f32> {
        let t = x.len() / d_in;
        let mut y = vec![0.0; t * d_out];
        linear_forward(&mut y, x, self.w(name), t, d_in, d_out);
        y
    }

    /// A query, key or value projection `name` of `xn`, with its bias when the model has one.
    fn qkv(&self, xn: &[f32], name: &str, d_out: usize) -> Vec<f32> {
        let mut y = self.project(xn, &format!("{name}.weight"), self.cfg.hidden, d_out);
        if self.cfg.qkv_bias {
            bias_forward(&mut y, self.w(&format!("{name}.bias")));
        }
        y
    }

    fn attention(
        &self,
        p: &str,
        xn: &[f32],
        positions: &[usize],
        layer: usize,
        cache: &mut KvCache,
    ) -> Vec<f32> {
        let c = &self.cfg;
        let (h, d) = (c.hidden, c.head_dim());
        let (qw, kvw) = (c.heads * d, c.kv_heads * d);
        let mut q = self.qkv(xn, &format!("{p}.self_attn.q_proj"), qw);
        let mut k = self.qkv(xn, &format!("{p}.self_attn.k_proj"), kvw);
        let v = self.qkv(xn, &format!("{p}.self_attn.v_proj"), kvw);
        rope_apply(&mut q, positions, c.heads, &self.rope, false);
        rope_apply(&mut k, positions, c.kv_heads, &self.rope, false);
        cache.keys[layer].extend_from_slice(&k);
        cache.values[layer].extend_from_slice(&v);
        let (keys, values) = (&cache.keys[layer], &cache.values[layer]);
        let kv_len = keys.len() / kvw;
        let kv_pos: Vec<usize> = (0..kv_len).collect();
        let sh = BlockShape {
            batch: 1,
            q_len: positions.len(),
            kv_len,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: d,
        };
        let mut out = vec![0.0; q.len()];
        let mut lse = vec![0.0; c.heads * positions.len()];
        block_forward(&mut out, &mut lse, &q, keys, values, positions, &kv_pos, sh);
        self.project(&out, &format!("{p}.self_attn.o_proj.weight"), qw, h)
    }

    fn mlp(&self, p: &str, xn: &[f32], gate: &str, up: &str, down: &str) -> Vec<f32> {
        let (h, f) = (self.cfg.hidden, self.cfg.ffn);
        let g = self.project(xn, &format!("{p}.{gate}.weight"), h, f);
        let u = self.project(xn, &format!("{p}.{up}.weight"), h, f);
        let mut act = vec![0.0; g.len()];
        swiglu_forward(&mut act, &g, &u);
        self.project(&act, &format!("{p}.{down}.weight"), f, h)
    }

    /// A Mixtral block: each token through its `top_k` experts, weighted by the gates.
    fn experts(&self, p: &str, xn: &[f32]) -> Vec<f32> {
        let c = &self.cfg;
        let h = c.hidden;
        let t = xn.len() / h;
        let logits = self.project(
            xn,
            &format!("{p}.block_sparse_moe.gate.weight"),
            h,
            c.experts,
        );
        let routing = route(&logits, t, c.experts, c.top_k);
        let mut out = vec![0.0; xn.len()];
        for tok in 0..t {
            let row = &xn[tok * h..(tok + 1) * h];
            for s in 0..c.top_k {
                let (e, g) = (
                    routing.ids[tok * c.top_k + s],
                    routing.gates[tok * c.top_k + s],
                );
                let y = self.mlp(
                    &format!("{p}.block_sparse_moe.experts.{e}"),
                    row,
                    "w1",
                    "w3",
                    "w2",
                );
                for (o, y) in out[tok * h..(tok + 1) * h].iter_mut().zip(&y) {
                    *o += g * y;
                }
            }
        }
        out
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}
