//! Inference through the model and the [`Backend`](ferrotron_tensor::Backend): `generate`'s
//! decoder, one forward per call over new positions, with a key/value cache on the device.
//!
//! Each call runs the new tokens through every block once: RMSNorm, the projections (with
//! Qwen2's biases), RoPE at the tokens' positions, then their keys and values (after RoPE)
//! are written into the layer's cache and the queries attend to every cached position with
//! the ring-attention block kernel (query position `p` sees key positions `0..=p`); the
//! dense SwiGLU MLP or the mixture of experts (routed, gathered, each expert's MLP over its
//! rows, combined). Every kernel is the backend's, so the decoder runs wherever training
//! runs — the CPU, the arena backend, a GPU — and its buffers are counted on the ledger:
//! the cache as activations, the rest as workspace.
//!
//! The decoder needs the whole model on one rank (no tensor-, pipeline- or expert-parallel
//! split); its RoPE table covers the positions it is made for, which may exceed the
//! model's training length.

use ferrotron_tensor::moe::Dispatch;
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::rope::RopeTable;
use ferrotron_tensor::{Buf, Category, Device, DeviceSlice, KvBlock, LinearShape, View};
use ferrotron_tensor::{RouteShape, Routed};

use crate::access::product_weight;
use crate::ctx::TOKEN_IDS;
use crate::{LayerParams, Llama, Mlp, MoeParams, WeightSource};

/// The label of the transfer that brings the logits back to the host.
pub const LOGITS: &str = "logits";

/// Every layer's keys and values so far, `[capacity, kv_heads·d]` each, on the device.
pub struct KvCache {
    keys: Vec<Buf<f32>>,
    values: Vec<Buf<f32>>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// A whole model's forward for inference, over a weight source on a device.
pub struct Decoder<'a> {
    model: &'a Llama,
    weights: &'a dyn WeightSource,
    dev: Device<'a>,
    rope: RopeTable,
    max_len: usize,
}

impl<'a> Decoder<'a> {
    /// A decoder of `model` (whole, on one rank) reading `weights`, for positions below
    /// `max_len`.
    ///
    /// # Panics
    /// When `model` is split over ranks or stages: a caller error, not an input one.
    pub fn new(
        model: &'a Llama,
        weights: &'a dyn WeightSource,
        dev: Device<'a>,
        max_len: usize,
    ) -> Decoder<'a> {
        let lay = &model.layout;
        assert!(
            lay.tp == 1 && lay.embed.is_some() && lay.head.is_some(),
            "Decoder: the model must be whole on one rank"
        );
        assert_eq!(lay.layers.len(), model.cfg.layers, "Decoder: every block");
        let all_experts = |lp: &LayerParams| match lp.mlp {
            Mlp::Moe(mp) => mp.local == model.cfg.experts,
            Mlp::Dense { .. } => true,
        };
        assert!(lay.layers.iter().all(all_experts), "Decoder: every expert");
        let c = &model.cfg;
        let rope = RopeTable::scaled(max_len, c.head_dim(), c.rope_theta, c.rope_scaling);
        Decoder {
            model,
            weights,
            dev,
            rope,
            max_len,
        }
    }

    /// An empty key/value cache with room for the decoder's positions, counted as
    /// activations.
    pub fn cache(&self) -> KvCache {
        let c = &self.model.cfg;
        let len = self.max_len * c.kv_heads * c.head_dim();
        let zeros = || self.dev.ledger.zeros(Category::Activations, len);
        KvCache {
            keys: (0..c.layers).map(|_| zeros()).collect(),
            values: (0..c.layers).map(|_| zeros()).collect(),
            len: 0,
            capacity: self.max_len,
        }
    }

    /// Logits (`[vocab]`) of the last of `tokens`, which take positions `cache.len()..` and
    /// are added to `cache`.
    ///
    /// # Panics
    /// When `tokens` is empty or the cache has no room for them.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Vec<f32> {
        self.run(tokens, cache, tokens.len().saturating_sub(1))
    }

    /// Logits of every one of `tokens` (positions `0..`), `[t, vocab]`.
    pub fn logits(&self, tokens: &[u32]) -> Vec<f32> {
        self.run(tokens, &mut self.cache(), 0)
    }

    /// Logits of `tokens[from..]`.
    fn run(&self, tokens: &[u32], cache: &mut KvCache, from: usize) -> Vec<f32> {
        let (c, lay) = (&self.model.cfg, &self.model.layout);
        let (h, t, start) = (c.hidden, tokens.len(), cache.len);
        assert!(
            t > 0 && start + t <= cache.capacity,
            "Decoder: {t} tokens after {start} in a cache of {}",
            cache.capacity
        );
        let (l, be) = (self.dev.ledger, self.dev.backend);
        let ids = l.upload(Category::Workspace, TOKEN_IDS, tokens);
        let mut x = l.overwritten(Category::Workspace, t * h);
        let table = self.weight(lay.embed.expect("checked in new"));
        be.embedding_forward(&mut x, &table, &ids, h);
        drop((table, ids));
        // Every cached position after this call; the new tokens are its last `t`.
        let kv_pos: Vec<usize> = (0..start + t).collect();
        for (layer, lp) in lay.layers.iter().enumerate() {
            let xn = self.norm(&x, lp.attn_norm);
            let attn = self.attention(lp, &xn, &kv_pos, (layer, cache));
            be.add_assign(&mut x, &attn);
            let xn = self.norm(&x, lp.mlp_norm);
            let y = match lp.mlp {
                Mlp::Dense { gate, up, down } => self.mlp(&xn, [gate, up, down]),
                Mlp::Moe(mp) => self.experts(&mp, &xn),
            };
            be.add_assign(&mut x, &y);
        }
        cache.len += t;
        let xn = self.norm(&x[from * h..], lay.final_norm.expect("checked in new"));
        let n = t - from;
        let logits = self.project(&xn, lay.head.expect("checked in new"), (h, c.vocab));
        debug_assert_eq!(logits.len(), n * c.vocab);
        l.download(LOGITS, &logits)
    }

    /// The weights of parameter `param`.
    fn weight(&self, param: usize) -> View<'_> {
        self.weights.view(self.dev, self.model.layout.range(param))
    }

    /// RMSNorm of the rows of `x` with the weight `param`.
    fn norm(&self, x: &DeviceSlice<f32>, param: usize) -> Buf<f32> {
        let (h, l) = (self.model.cfg.hidden, self.dev.ledger);
        let mut y = l.overwritten(Category::Workspace, x.len());
        let mut rstd = l.overwritten(Category::Workspace, x.len() / h);
        let w = self.weight(param);
        let eps = self.model.cfg.rms_eps as f32;
        self.dev
            .backend
            .rmsnorm_forward(&mut y, &mut rstd, x, &w, h, eps);
        y
    }

    /// `x · Wᵀ` for the weight `param`, `d_in` features to `d_out`.
    fn project(
        &self,
        x: &DeviceSlice<f32>,
        param: usize,
        (d_in, d_out): (usize, usize),
    ) -> Buf<f32> {
        let t = x.len() / d_in;
        let mut y = self.dev.ledger.overwritten(Category::Workspace, t * d_out);
        let range = self.model.layout.range(param);
        let w = product_weight(self.weights, self.dev, range);
        let sh = LinearShape::new(t, d_in, d_out);
        self.dev
            .backend
            .linear_forward(&mut y, x.operand(), w.operand(), sh);
        y
    }

    /// Self-attention of the new tokens (the last of `kv_pos`) over every position of
    /// `kv_pos` in `layer`'s cache.
    fn attention(
        &self,
        lp: &LayerParams,
        xn: &DeviceSlice<f32>,
        kv_pos: &[usize],
        (layer, cache): (usize, &mut KvCache),
    ) -> Buf<f32> {
        let positions = &kv_pos[cache.len..];
        let c = &self.model.cfg;
        let (h, d, t) = (c.hidden, c.head_dim(), positions.len());
        let (qw, kvw) = (c.heads * d, c.kv_heads * d);
        let (l, be) = (self.dev.ledger, self.dev.backend);
        let mut q = self.project(xn, lp.q, (h, qw));
        let mut k = self.project(xn, lp.k, (h, kvw));
        let mut v = self.project(xn, lp.v, (h, kvw));
        if let Some([bq, bk, bv]) = lp.qkv_bias {
            for (y, b) in [(&mut q, bq), (&mut k, bk), (&mut v, bv)] {
                be.bias_forward(y, &self.weight(b));
            }
        }
        be.rope(&mut q, positions, c.heads, &self.rope, false);
        be.rope(&mut k, positions, c.kv_heads, &self.rope, false);
        let start = cache.len;
        let (kv_len, at) = (start + t, start * kvw..(start + t) * kvw);
        be.copy(&mut cache.keys[layer][at.clone()], &k);
        be.copy(&mut cache.values[layer][at], &v);
        drop((k, v));
        let block = KvBlock {
            q_pos: positions,
            kv_pos,
            q_start: None,
            shape: BlockShape {
                batch: 1,
                q_len: t,
                kv_len,
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: d,
            },
        };
        let mut out = l.zeros(Category::Workspace, t * qw);
        let mut lse = l.zeros(Category::Workspace, c.heads * t);
        let (keys, values) = (&cache.keys[layer], &cache.values[layer]);
        let (keys, values) = (&keys[..kv_len * kvw], &values[..kv_len * kvw]);
        be.attention_block_forward(&mut out, &mut lse, &q, keys, values, block);
        drop((q, lse));
        self.project(&out, lp.o, (qw, h))
    }

    /// The SwiGLU MLP `down(silu(gate(x)) ⊙ up(x))` with the weights `[gate, up, down]`.
    fn mlp(&self, x: &DeviceSlice<f32>, [gate, up, down]: [usize; 3]) -> Buf<f32> {
        let (h, f) = (self.model.cfg.hidden, self.model.cfg.ffn);
        let g = self.project(x, gate, (h, f));
        let u = self.project(x, up, (h, f));
        let mut act = self.dev.ledger.overwritten(Category::Workspace, g.len());
        self.dev.backend.swiglu_forward(&mut act, &g, &u);
        drop((g, u));
        self.project(&act, down, (f, h))
    }

    /// A Mixtral block: each token through its `top_k` experts, weighted by the gates.
    fn experts(&self, mp: &MoeParams, xn: &DeviceSlice<f32>) -> Buf<f32> {
        let c = &self.model.cfg;
        let (h, t, l, be) = (
            c.hidden,
            xn.len() / c.hidden,
            self.dev.ledger,
            self.dev.backend,
        );
        let (e, k) = (c.experts, c.top_k);
        let logits = self.project(xn, mp.router, (h, e));
        // A Hugging Face model holds no balancing bias: routed by its probabilities.
        let routing = be.moe_route(
            l,
            &logits,
            None,
            RouteShape {
                t,
                experts: e,
                top_k: k,
            },
        );
        drop(logits);
        let dispatch = Dispatch::new(&routing, t, e, k);
        let mut xg = l.zeros(Category::Workspace, t * k * h);
        be.moe_gather_rows(&mut xg, xn, h, &dispatch);
        let mut ye = l.zeros(Category::Workspace, t * k * h);
        let mut start = 0;
        for (i, &rows) in dispatch.counts().iter().enumerate() {
            let xr = start * h..(start + rows) * h;
            start += rows;
            if rows > 0 {
                let y = self.mlp(&xg[xr.clone()], [mp.w1(i), mp.w3(i), mp.w2(i)]);
                be.copy(&mut ye[xr], &y);
            }
        }
        drop(xg);
        let mut out = l.zeros(Category::Workspace, t * h);
        let routed = Routed {
            routing: &routing,
            dispatch: &dispatch,
        };
        be.moe_combine_forward(&mut out, &ye, h, routed);
        out
    }
}
