//! Building a [`ParamLayout`](super::ParamLayout): parameters appended one after another to
//! the flat buffer, block by block in Hugging Face order, each with its tensor-parallel split
//! and its initialisation.

use ferrotron_config::ModelConfig;

use super::{LayerParams, Mlp, MoeParams, ParamSpec, Shard, Split, INIT_STD};

/// Lays parameters out one after another in the flat buffer.
pub(super) struct Builder {
    pub params: Vec<ParamSpec>,
    pub offset: usize,
    /// Tensor-parallel degree: split parameters keep `1/tp` of their rows or columns.
    pub tp: usize,
}

impl Builder {
    /// Appends parameter `name` (full shape `full_shape`, this rank's part by `split`;
    /// decayed and drawn with `init_std` when given, ones otherwise); returns its index.
    pub fn push(
        &mut self,
        name: String,
        full_shape: Vec<usize>,
        split: Split,
        init_std: Option<f64>,
    ) -> usize {
        let mut shape = full_shape.clone();
        match split {
            Split::Replicated => {}
            Split::Rows => shape[0] /= self.tp,
            Split::Cols => shape[1] /= self.tp,
        }
        self.push_shaped(name, (full_shape, shape), split, init_std)
    }

    /// Appends parameter `name` whose part on this rank has shape `shape` (of the full
    /// `full_shape`); returns its index.
    fn push_shaped(
        &mut self,
        name: String,
        (full_shape, shape): (Vec<usize>, Vec<usize>),
        split: Split,
        init_std: Option<f64>,
    ) -> usize {
        let spec = ParamSpec {
            name,
            shape,
            full_shape,
            split,
            offset: self.offset,
            decay: init_std.is_some(),
            init_std,
        };
        self.offset += spec.numel();
        self.params.push(spec);
        self.params.len() - 1
    }

    /// Appends the vocabulary matrix `name` (the embedding or the LM head, full shape
    /// `[vocab, h]`), split by rows into `rows` rows per rank: the vocabulary padded under
    /// tensor parallelism ([`ModelConfig::vocab_rows`]).
    pub fn push_vocab(&mut self, name: String, (vocab, h, rows): (usize, usize, usize)) -> usize {
        let shapes = (vec![vocab, h], vec![rows, h]);
        self.push_shaped(name, shapes, Split::Rows, Some(INIT_STD))
    }

    /// Appends the bias `name` of a column-parallel linear with `width` outputs: split like
    /// its weight's rows, initialised to zero (transformers' Qwen2), not decayed.
    pub fn push_bias(&mut self, name: String, width: usize) -> usize {
        let i = self.push(name, vec![width], Split::Rows, Some(0.0));
        self.params[i].decay = false;
        i
    }

    /// Block `l`'s parameters, in Hugging Face order.
    pub fn layer(&mut self, cfg: &ModelConfig, l: usize, shard: Shard) -> LayerParams {
        use Split::{Cols, Replicated, Rows};
        let (h, d, f) = (cfg.hidden, cfg.head_dim(), cfg.ffn);
        let std = Some(INIT_STD);
        let resid = Some(resid_std(cfg));
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let attn_norm = self.push(p("input_layernorm.weight"), vec![h], Replicated, None);
        let q = self.push(
            p("self_attn.q_proj.weight"),
            vec![cfg.heads * d, h],
            Rows,
            std,
        );
        let k = self.push(
            p("self_attn.k_proj.weight"),
            vec![cfg.kv_heads * d, h],
            Rows,
            std,
        );
        let v = self.push(
            p("self_attn.v_proj.weight"),
            vec![cfg.kv_heads * d, h],
            Rows,
            std,
        );
        let qkv_bias = cfg.qkv_bias.then(|| {
            let (qd, kd) = (cfg.heads * d, cfg.kv_heads * d);
            [("q", qd), ("k", kd), ("v", kd)]
                .map(|(n, width)| self.push_bias(p(&format!("self_attn.{n}_proj.bias")), width))
        });
        let o = self.push(
            p("self_attn.o_proj.weight"),
            vec![h, cfg.heads * d],
            Cols,
            resid,
        );
        let mlp_norm = self.push(
            p("post_attention_layernorm.weight"),
            vec![h],
            Replicated,
            None,
        );
        let mlp = if cfg.is_moe_layer(l) {
            Mlp::Moe(self.experts(cfg, l, shard))
        } else {
            Mlp::Dense {
                gate: self.push(p("mlp.gate_proj.weight"), vec![f, h], Rows, std),
                up: self.push(p("mlp.up_proj.weight"), vec![f, h], Rows, std),
                down: self.push(p("mlp.down_proj.weight"), vec![h, f], Cols, resid),
            }
        };
        LayerParams {
            attn_norm,
            q,
            k,
            v,
            o,
            qkv_bias,
            mlp_norm,
            mlp,
        }
    }

    /// Block `l`'s router and this rank's share of its experts.
    fn experts(&mut self, cfg: &ModelConfig, l: usize, shard: Shard) -> MoeParams {
        let (h, f, e) = (cfg.hidden, cfg.ffn, cfg.experts);
        let std = Some(INIT_STD);
        let p = |s: &str| format!("model.layers.{l}.block_sparse_moe.{s}");
        let router = self.push(p("gate.weight"), vec![e, h], Split::Replicated, std);
        let local = e / shard.ep;
        let expert0 = shard.ep_rank * local;
        let mut first = None;
        for x in expert0..expert0 + local {
            let w = |n: &str| p(&format!("experts.{x}.{n}.weight"));
            let w1 = self.push(w("w1"), vec![f, h], Split::Replicated, std);
            self.push(w("w2"), vec![h, f], Split::Replicated, Some(resid_std(cfg)));
            self.push(w("w3"), vec![f, h], Split::Replicated, std);
            first.get_or_insert(w1);
        }
        MoeParams {
            layer: l,
            router,
            first: first.expect("ep divides experts, so a rank holds at least one"),
            local,
            expert0,
        }
    }
}

/// Residual projections are scaled down by √(2L) so the residual stream's variance does not
/// grow with depth.
fn resid_std(cfg: &ModelConfig) -> f64 {
    INIT_STD / (2.0 * cfg.layers as f64).sqrt()
}
