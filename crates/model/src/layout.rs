//! The flat parameter layout: named views into one contiguous buffer (llm.c style).
//!
//! A mixture-of-experts block (Mixtral naming) holds its router,
//! `model.layers.{l}.block_sparse_moe.gate.weight` `[E, h]`, with the block's dense
//! parameters, and its experts `model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w2,w3}.weight`
//! (w1 = gate projection `[h_ff, h]`, w3 = up projection `[h_ff, h]`, w2 = down projection
//! `[h, h_ff]`) in a separate unit right after the block, [`Unit::Experts`]: experts are
//! reduced over another group than the dense parameters, so they never share a bucket with
//! them. Under expert parallelism a layout holds only its rank's experts, under their global
//! names; experts and router are replicated over tensor parallelism.

use std::ops::Range;

use ferrotron_config::ModelConfig;

use crate::Unit;

mod builder;

use builder::Builder;

/// How a parameter is divided among tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it (norm weights).
    Replicated,
    /// Rank `r` holds rows `[r·n/t, (r+1)·n/t)`: column-parallel linears (Q, K, V, gate, up;
    /// output dimension) and the vocabulary-parallel embedding and LM head.
    Rows,
    /// Rank `r` holds columns `[r·n/t, (r+1)·n/t)`: row-parallel linears (attention output,
    /// MLP down; input dimension).
    Cols,
}

/// One parameter: its Hugging Face name, shape and place in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// This rank's shape, row-major (`[out, in]` for linear weights).
    pub shape: Vec<usize>,
    /// The unsharded shape.
    pub full_shape: Vec<usize>,
    /// How tensor parallelism divides it.
    pub split: Split,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Whether AdamW weight decay applies (not to norm weights).
    pub decay: bool,
    /// Standard deviation of the initial normal draw (0: zeros, as biases start); `None`
    /// means initialised to ones.
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

/// What a pipeline stage holds: some blocks (global indices, in order), and whether it has
/// the embedding (first stage) and the head (last stage).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageParts {
    /// Global indices of the blocks, in forward order.
    pub layers: Vec<usize>,
    /// Holds the embedding.
    pub embed: bool,
    /// Holds the final norm and LM head.
    pub head: bool,
}

/// How a layout is cut: its tensor-parallel slice and its expert-parallel share of experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Tensor-parallel degree.
    pub tp: usize,
    /// This rank's tensor-parallel index.
    pub tp_rank: usize,
    /// Expert-parallel degree (divides the number of experts).
    pub ep: usize,
    /// This rank's expert-parallel index: it holds experts `[ep_rank·E/ep, (ep_rank+1)·E/ep)`.
    pub ep_rank: usize,
}

impl Shard {
    /// The tensor-parallel slice `tp_rank` of `tp`, holding every expert.
    pub fn tensor_parallel(tp: usize, tp_rank: usize) -> Shard {
        Shard {
            tp,
            tp_rank,
            ep: 1,
            ep_rank: 0,
        }
    }
}

/// The MLP half of a block: a dense SwiGLU MLP or a mixture of experts.
#[derive(Debug, Clone, Copy)]
pub enum Mlp {
    /// `mlp.{gate,up,down}_proj.weight` (indices into [`ParamLayout::params`]).
    Dense {
        /// `mlp.gate_proj.weight` `[h_ff, h]`.
        gate: usize,
        /// `mlp.up_proj.weight` `[h_ff, h]`.
        up: usize,
        /// `mlp.down_proj.weight` `[h, h_ff]`.
        down: usize,
    },
    /// `block_sparse_moe`.
    Moe(MoeParams),
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
    /// `self_attn.{q,k,v}_proj.bias` `[a·d]`, `[a_kv·d]`, `[a_kv·d]` (Qwen2), when the model
    /// has them.
    pub qkv_bias: Option<[usize; 3]>,
    /// `post_attention_layernorm.weight` `[h]`.
    pub mlp_norm: usize,
    /// The dense MLP or the mixture of experts.
    pub mlp: Mlp,
}

/// Every parameter of the model (this tensor-parallel rank's shards of them), laid out
/// embedding first, then block by block, then the final norm and the LM head (absent when
/// tied).
#[derive(Debug, Clone)]
pub struct ParamLayout {
    /// All parameters in buffer order.
    pub params: Vec<ParamSpec>,
    /// Per-block indices, for the blocks this layout holds.
    pub layers: Vec<LayerParams>,
    /// Global index of each block in `layers`.
    pub layer_ids: Vec<usize>,
    /// `model.embed_tokens.weight` `[v, h]`, when this layout holds the embedding.
    pub embed: Option<usize>,
    /// `model.norm.weight` `[h]`, when this layout holds the head.
    pub final_norm: Option<usize>,
    /// `lm_head.weight` `[v, h]` (the embedding when tied), when this layout holds the head.
    pub head: Option<usize>,
    /// Total elements on this rank (Ψ when unsharded).
    pub total: usize,
    /// Tensor-parallel degree the layout is cut for.
    pub tp: usize,
    /// This rank's tensor-parallel index.
    pub tp_rank: usize,
    /// Expert-parallel degree the layout is cut for.
    pub ep: usize,
    /// This rank's expert-parallel index.
    pub ep_rank: usize,
}

/// Standard deviation of weight matrices (GPT-2/Llama practice).
const INIT_STD: f64 = 0.02;

impl ParamLayout {
    /// The layout of `cfg` on one rank.
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::tensor_parallel(cfg, 1, 0)
    }

    /// The layout of tensor-parallel rank `tp_rank` of `tp` (t must divide heads, kv_heads,
    /// ffn and vocab; the config validation says so first), holding the whole model.
    pub fn tensor_parallel(cfg: &ModelConfig, tp: usize, tp_rank: usize) -> Self {
        let all = StageParts {
            layers: (0..cfg.layers).collect(),
            embed: true,
            head: true,
        };
        Self::stage(cfg, tp, tp_rank, &all)
    }

    /// The layout of one pipeline stage (the parts it holds) on tensor-parallel rank
    /// `tp_rank` of `tp`. Parameters keep their global names, so every stage's layout maps
    /// onto the full model's by name.
    pub fn stage(cfg: &ModelConfig, tp: usize, tp_rank: usize, parts: &StageParts) -> Self {
        Self::sharded(cfg, Shard::tensor_parallel(tp, tp_rank), parts)
    }

    /// The layout of one pipeline stage cut by `shard`: its tensor-parallel slices and,
    /// under expert parallelism, only its share of each mixture-of-experts block's experts.
    pub fn sharded(cfg: &ModelConfig, shard: Shard, parts: &StageParts) -> Self {
        let (h, v) = (cfg.hidden, cfg.vocab);
        let mut b = Builder {
            params: Vec::new(),
            offset: 0,
            tp: shard.tp,
        };
        let vocab = (v, h, cfg.vocab_rows(shard.tp));
        let embed = parts
            .embed
            .then(|| b.push_vocab("model.embed_tokens.weight".into(), vocab));
        let layers = parts
            .layers
            .iter()
            .map(|&l| b.layer(cfg, l, shard))
            .collect();
        let final_norm = parts
            .head
            .then(|| b.push("model.norm.weight".into(), vec![h], Split::Replicated, None));
        let head = match (parts.head, cfg.tie_embeddings) {
            (false, _) => None,
            (true, true) => embed,
            (true, false) => Some(b.push_vocab("lm_head.weight".into(), vocab)),
        };
        ParamLayout {
            params: b.params,
            layers,
            layer_ids: parts.layers.clone(),
            embed,
            final_norm,
            head,
            total: b.offset,
            tp: shard.tp,
            tp_rank: shard.tp_rank,
            ep: shard.ep,
            ep_rank: shard.ep_rank,
        }
    }

    /// Copies this rank's slice of a full parameter (`full`, laid out by `full_shape`) into
    /// `out` (laid out by `shape`).
    pub fn slice_into(&self, spec: &ParamSpec, full: &[f32], out: &mut [f32]) {
        let (t, r) = (self.tp, self.tp_rank);
        match spec.split {
            Split::Replicated => out.copy_from_slice(full),
            Split::Rows => {
                // A padded slice (the vocabulary under TP) holds rows past the full shape's:
                // zeros.
                let n = out.len();
                let real = full.len().saturating_sub(r * n).min(n);
                if real > 0 {
                    out[..real].copy_from_slice(&full[r * n..r * n + real]);
                }
                out[real..].fill(0.0);
            }
            Split::Cols => {
                let (rows, cols) = (spec.full_shape[0], spec.full_shape[1]);
                let c = cols / t;
                for i in 0..rows {
                    out[i * c..(i + 1) * c]
                        .copy_from_slice(&full[i * cols + r * c..i * cols + (r + 1) * c]);
                }
            }
        }
    }

    /// Writes rank `rank`'s slice `part` of a parameter into its place in `full`.
    pub fn place_slice(spec: &ParamSpec, tp: usize, rank: usize, part: &[f32], full: &mut [f32]) {
        match spec.split {
            Split::Replicated => full.copy_from_slice(part),
            Split::Rows => {
                // Only the rows within the full shape: a padded slice's others are dropped.
                let n = part.len();
                let real = full.len().saturating_sub(rank * n).min(n);
                if real > 0 {
                    full[rank * n..rank * n + real].copy_from_slice(&part[..real]);
                }
            }
            Split::Cols => {
                let (rows, cols) = (spec.full_shape[0], spec.full_shape[1]);
                let c = cols / tp;
                for i in 0..rows {
                    full[i * cols + rank * c..i * cols + (rank + 1) * c]
                        .copy_from_slice(&part[i * c..(i + 1) * c]);
                }
            }
        }
    }

    /// Indices (into [`ParamLayout::params`]) of the blocks' projection matrices, the ones
    /// Muon orthogonalises: attention's Q, K, V and O, the dense MLP's gate, up and down, and
    /// every held expert's w1, w2 and w3. Not the embedding, the LM head, norms, biases or
    /// routers.
    pub fn muon_matrices(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for lp in &self.layers {
            out.extend([lp.q, lp.k, lp.v, lp.o]);
            match lp.mlp {
                Mlp::Dense { gate, up, down } => out.extend([gate, up, down]),
                Mlp::Moe(moe) => {
                    for i in 0..moe.local {
                        out.extend([moe.w1(i), moe.w2(i), moe.w3(i)]);
                    }
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// Parameter `index`'s element range and tensor-parallel split.
    pub fn range_split(&self, index: usize) -> (Range<usize>, Split) {
        (self.range(index), self.params[index].split)
    }

    /// The parameter called `name`.
    pub fn find(&self, name: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Units this layout holds, in forward order: embedding, blocks, head.
    pub fn units(&self) -> Vec<Unit> {
        let mut u = Vec::new();
        if self.embed.is_some() {
            u.push(Unit::Embed);
        }
        for (lp, &l) in self.layers.iter().zip(&self.layer_ids) {
            u.push(Unit::Block(l));
            if let Mlp::Moe(_) = lp.mlp {
                u.push(Unit::Experts(l));
            }
        }
        if self.final_norm.is_some() {
            u.push(Unit::Head);
        }
        u
    }

    /// Parameter indices of global block `l` (which this layout must hold).
    pub fn block(&self, l: usize) -> &LayerParams {
        let i = self
            .layer_ids
            .iter()
            .position(|&x| x == l)
            .expect("block held by this layout");
        &self.layers[i]
    }

    /// Indices of the parameters a unit owns.
    pub fn unit_params(&self, unit: Unit) -> Vec<usize> {
        match unit {
            Unit::Embed => self.embed.into_iter().collect(),
            Unit::Block(l) => {
                let p = self.block(l);
                let mut v = vec![p.attn_norm, p.q, p.k, p.v];
                v.extend(p.qkv_bias.into_iter().flatten());
                v.extend([p.o, p.mlp_norm]);
                match p.mlp {
                    Mlp::Dense { gate, up, down } => v.extend([gate, up, down]),
                    Mlp::Moe(m) => v.push(m.router),
                }
                v
            }
            Unit::Experts(l) => match self.block(l).mlp {
                Mlp::Moe(m) => (m.first..m.first + 3 * m.local).collect(),
                Mlp::Dense { .. } => Vec::new(),
            },
            Unit::Head => {
                let own_head = self.head.filter(|h| Some(*h) != self.embed);
                self.final_norm.into_iter().chain(own_head).collect()
            }
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

    /// Whether `unit` holds experts, whose gradients are reduced over the expert-data group
    /// instead of the data-parallel group.
    pub fn is_expert_unit(unit: Unit) -> bool {
        matches!(unit, Unit::Experts(_))
    }
}

/// Indices (into [`ParamLayout::params`]) of a mixture-of-experts block's parameters on this
/// rank: the router and this rank's experts, each expert's `w1`, `w2`, `w3` in a row.
#[derive(Debug, Clone, Copy)]
pub struct MoeParams {
    /// Global index of the block.
    pub layer: usize,
    /// `block_sparse_moe.gate.weight` `[E, h]`.
    pub router: usize,
    /// Index of the first held expert's `w1`.
    pub first: usize,
    /// Number of experts held (`E/ep`).
    pub local: usize,
    /// Global index of the first expert held.
    pub expert0: usize,
}

impl MoeParams {
    /// `w1` (gate projection, `[h_ff, h]`) of held expert `i` (0-based among the held ones).
    pub fn w1(&self, i: usize) -> usize {
        self.first + 3 * i
    }
    /// `w2` (down projection, `[h, h_ff]`) of held expert `i`.
    pub fn w2(&self, i: usize) -> usize {
        self.first + 3 * i + 1
    }
    /// `w3` (up projection, `[h_ff, h]`) of held expert `i`.
    pub fn w3(&self, i: usize) -> usize {
        self.first + 3 * i + 2
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

    /// Muon takes exactly the 2-D weights named as projections; a mixture of experts adds
    /// its experts' but not its router.
    #[test]
    fn muon_matrices_are_the_projections() {
        let names = |cfg: &ModelConfig| -> Vec<String> {
            let layout = ParamLayout::new(cfg);
            let ids = layout.muon_matrices();
            ids.iter().map(|&i| layout.params[i].name.clone()).collect()
        };
        let dense = ModelConfig::default();
        let got = names(&dense);
        assert_eq!(got.len(), 7 * dense.layers);
        let projection = [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
        ];
        for n in &got {
            assert!(
                projection.iter().any(|p| n.contains(p)) || n.contains("down_proj"),
                "{n}"
            );
        }
        let moe = ModelConfig {
            experts: 4,
            top_k: 2,
            ..ModelConfig::default()
        };
        let got = names(&moe);
        assert_eq!(got.len(), (4 + 3 * 4) * moe.layers);
        assert!(got
            .iter()
            .all(|n| !n.ends_with("block_sparse_moe.gate.weight")));
        assert!(got.iter().any(|n| n.ends_with("experts.3.w2.weight")));
    }
}
