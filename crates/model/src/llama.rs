//! Forward and backward of the Llama model, written out layer by layer.
//!
//! Activation memory per block, in elements, with `T = b·s` tokens (all saved tensors are
//! stored in the run's dtype except the f32 statistics `rstd` and `lse`):
//! `T·(4h + 2·a·d + 2·a_kv·d + 2·h_ff)` stored + `T·2 + b·a·s` f32 statistics —
//! block input, normed inputs of attention and MLP, Q, K, V, attention output, mid-block
//! residual, gate and up. The SwiGLU product is recomputed in backward instead of stored
//! (it is one element-wise pass), and attention keeps only its output and log-sum-exp
//! (flash style), never the `s × s` scores.

use ferrotron_config::ModelConfig;
use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::rope::RopeTable;
use ferrotron_tensor::xent::XentGrads;
use ferrotron_tensor::{Backend, Buf, Category, Ledger, Store, StoreDType};

use crate::{GradSink, HookError, LayerParams, ParamLayout, Phase, Unit, WeightSource};

/// What one forward/backward needs besides weights and gradients.
pub struct StepCtx<'a> {
    /// The ledger every buffer is counted in.
    pub ledger: &'a Ledger,
    /// The kernels.
    pub backend: &'a dyn Backend,
    /// Storage dtype of saved activations.
    pub act_dtype: StoreDType,
    /// Tokens per LM-head/cross-entropy chunk.
    pub loss_chunk: usize,
}

impl StepCtx<'_> {
    /// An f32 buffer that becomes a saved activation: counted as activations in f32 mode
    /// (kept as is), as workspace in bf16 mode (rounded into a bf16 copy, then freed).
    fn act_buf(&self, len: usize) -> Buf<f32> {
        let cat = match self.act_dtype {
            StoreDType::F32 => Category::Activations,
            StoreDType::Bf16 => Category::Workspace,
        };
        self.ledger.zeros(cat, len)
    }
    fn keep(&self, data: Buf<f32>) -> Store {
        Store::keep(self.ledger, Category::Activations, self.act_dtype, data)
    }
    fn work(&self, len: usize) -> Buf<f32> {
        self.ledger.zeros(Category::Workspace, len)
    }
    fn stats(&self, len: usize) -> Buf<f32> {
        self.ledger.zeros(Category::Activations, len)
    }
}

/// Activations one block saves for its backward.
struct BlockActs {
    x_in: Store,
    rstd1: Buf<f32>,
    xn1: Store,
    q: Store,
    k: Store,
    v: Store,
    attn: Store,
    lse: Buf<f32>,
    x_mid: Store,
    rstd2: Buf<f32>,
    xn2: Store,
    gate: Store,
    up: Store,
}

/// The model: shape, parameter layout, RoPE table.
pub struct Llama {
    /// Shape.
    pub cfg: ModelConfig,
    /// Parameter layout.
    pub layout: ParamLayout,
    rope: RopeTable,
}

impl Llama {
    /// The model of `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        Llama {
            cfg: cfg.clone(),
            layout: ParamLayout::new(cfg),
            rope: RopeTable::new(cfg.seq_len, cfg.head_dim(), cfg.rope_theta),
        }
    }

    /// Runs forward over `batch` sequences (`inputs`, `targets`: `[batch·seq_len]`) and
    /// returns the **sum** of token losses. With `grads`, runs backward too and adds the
    /// gradient of `loss_scale × sum` into `grads`. Units are entered and left on `weights`
    /// around their use and reported done to `grads` once their gradients are final.
    pub fn forward_backward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: Option<&mut dyn GradSink>,
        inputs: &[u32],
        targets: &[u32],
        loss_scale: f32,
    ) -> Result<f64, HookError> {
        let c = &self.cfg;
        let (h, v) = (c.hidden, c.vocab);
        let t = inputs.len();
        let batch = t / c.seq_len;
        let positions: Vec<usize> = (0..t).map(|i| i % c.seq_len).collect();
        let lay = &self.layout;
        let tied = lay.head == lay.embed;
        let w = |i: usize| weights.view(ctx.ledger, lay.range(i));
        let fwd = Phase::Forward;

        weights.enter(Unit::Embed, fwd)?;
        let mut x = ctx.act_buf(t * h);
        ctx.backend
            .embedding_forward(&mut x, &w(lay.embed), inputs, h);
        if !tied {
            weights.leave(Unit::Embed, fwd)?;
        }
        let mut x = ctx.keep(x);
        let mut saved = Vec::with_capacity(c.layers);
        for (l, lp) in lay.layers.iter().enumerate() {
            weights.enter(Unit::Block(l), fwd)?;
            let (out, acts) = self.block_forward(ctx, weights, lp, x, &positions, batch);
            weights.leave(Unit::Block(l), fwd)?;
            x = out;
            if grads.is_some() {
                saved.push(acts);
            }
        }
        // The head's forward and backward run together: the loss gradient is known as soon as
        // each chunk's logits are.
        weights.enter(Unit::Head, fwd)?;
        let xf = x.view_all(ctx.ledger);
        let mut xnf = ctx.work(t * h);
        let mut rstdf = ctx.stats(t);
        let wf = w(lay.final_norm);
        ctx.backend
            .rmsnorm_forward(&mut xnf, &mut rstdf, &xf, &wf, h, c.rms_eps as f32);
        let head = w(lay.head);
        let Some(grads) = grads else {
            let loss = ctx.backend.lm_head_xent(
                ctx.ledger,
                &xnf,
                &head,
                targets,
                h,
                v,
                ctx.loss_chunk,
                None,
            );
            drop((head, wf));
            weights.leave(Unit::Head, fwd)?;
            if tied {
                weights.leave(Unit::Embed, fwd)?;
            }
            return Ok(loss);
        };

        let mut dxn = ctx.work(t * h);
        let mut loss = 0.0;
        grads.accumulate(lay.range(lay.head), &mut |dw| {
            let g = XentGrads {
                dx: &mut dxn,
                dw,
                scale: loss_scale,
            };
            loss = ctx.backend.lm_head_xent(
                ctx.ledger,
                &xnf,
                &head,
                targets,
                h,
                v,
                ctx.loss_chunk,
                Some(g),
            );
        });
        drop((head, xnf));
        let mut dx = ctx.work(t * h);
        grads.accumulate(lay.range(lay.final_norm), &mut |dw| {
            ctx.backend
                .rmsnorm_backward(&mut dx, dw, &dxn, &xf, &rstdf, &wf, h, false)
        });
        drop((dxn, xf, rstdf, wf));
        drop(x);
        weights.leave(Unit::Head, fwd)?;
        if tied {
            weights.leave(Unit::Embed, fwd)?;
        }
        grads.unit_done(Unit::Head)?;
        for (l, (lp, acts)) in lay.layers.iter().zip(saved).enumerate().rev() {
            weights.enter(Unit::Block(l), Phase::Backward)?;
            dx = self.block_backward(ctx, weights, grads, lp, acts, dx, &positions, batch);
            weights.leave(Unit::Block(l), Phase::Backward)?;
            grads.unit_done(Unit::Block(l))?;
        }
        // The embedding's backward reads no weights.
        grads.accumulate(lay.range(lay.embed), &mut |dw| {
            ctx.backend.embedding_backward(dw, &dx, inputs, h)
        });
        grads.unit_done(Unit::Embed)?;
        Ok(loss)
    }

    fn attn_shape(&self, batch: usize) -> AttnShape {
        let c = &self.cfg;
        AttnShape {
            batch,
            seq: c.seq_len,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn block_forward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        lp: &LayerParams,
        x_in: Store,
        positions: &[usize],
        batch: usize,
    ) -> (Store, BlockActs) {
        let c = &self.cfg;
        let (h, f, t) = (c.hidden, c.ffn, positions.len());
        let (qd, kd) = (c.heads * c.head_dim(), c.kv_heads * c.head_dim());
        let be = ctx.backend;
        let lay = &self.layout;
        let w = |i: usize| weights.view(ctx.ledger, lay.range(i));

        // Attention half: x_mid = x + o_proj(attention(rope(q), rope(k), v)).
        let x = x_in.view_all(ctx.ledger);
        let mut xn1 = ctx.act_buf(t * h);
        let mut rstd1 = ctx.stats(t);
        be.rmsnorm_forward(
            &mut xn1,
            &mut rstd1,
            &x,
            &w(lp.attn_norm),
            h,
            c.rms_eps as f32,
        );
        let (mut q, mut k, mut v) = (
            ctx.act_buf(t * qd),
            ctx.act_buf(t * kd),
            ctx.act_buf(t * kd),
        );
        be.linear_forward(&mut q, &xn1, &w(lp.q), t, h, qd);
        be.linear_forward(&mut k, &xn1, &w(lp.k), t, h, kd);
        be.linear_forward(&mut v, &xn1, &w(lp.v), t, h, kd);
        be.rope(&mut q, positions, c.heads, &self.rope, false);
        be.rope(&mut k, positions, c.kv_heads, &self.rope, false);
        let mut attn = ctx.act_buf(t * qd);
        let mut lse = ctx.stats(batch * c.heads * c.seq_len);
        be.attention_forward(&mut attn, &mut lse, &q, &k, &v, self.attn_shape(batch));
        let mut x_mid = ctx.act_buf(t * h);
        be.linear_forward(&mut x_mid, &attn, &w(lp.o), t, qd, h);
        x_mid.iter_mut().zip(x.iter()).for_each(|(m, x)| *m += x);
        drop(x);

        // MLP half: out = x_mid + down(silu(gate(xn2)) ⊙ up(xn2)).
        let mut xn2 = ctx.act_buf(t * h);
        let mut rstd2 = ctx.stats(t);
        be.rmsnorm_forward(
            &mut xn2,
            &mut rstd2,
            &x_mid,
            &w(lp.mlp_norm),
            h,
            c.rms_eps as f32,
        );
        let (mut gate, mut up) = (ctx.act_buf(t * f), ctx.act_buf(t * f));
        be.linear_forward(&mut gate, &xn2, &w(lp.gate), t, h, f);
        be.linear_forward(&mut up, &xn2, &w(lp.up), t, h, f);
        let mut act = ctx.work(t * f);
        be.swiglu_forward(&mut act, &gate, &up);
        let mut out = ctx.act_buf(t * h);
        be.linear_forward(&mut out, &act, &w(lp.down), t, f, h);
        drop(act);
        out.iter_mut().zip(x_mid.iter()).for_each(|(o, m)| *o += m);

        let acts = BlockActs {
            x_in,
            rstd1,
            xn1: ctx.keep(xn1),
            q: ctx.keep(q),
            k: ctx.keep(k),
            v: ctx.keep(v),
            attn: ctx.keep(attn),
            lse,
            x_mid: ctx.keep(x_mid),
            rstd2,
            xn2: ctx.keep(xn2),
            gate: ctx.keep(gate),
            up: ctx.keep(up),
        };
        (ctx.keep(out), acts)
    }

    /// Takes `d loss/d out` of the block, returns `d loss/d x_in`.
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: &mut dyn GradSink,
        lp: &LayerParams,
        a: BlockActs,
        mut dx: Buf<f32>,
        positions: &[usize],
        batch: usize,
    ) -> Buf<f32> {
        let c = &self.cfg;
        let (h, f, t) = (c.hidden, c.ffn, positions.len());
        let (qd, kd) = (c.heads * c.head_dim(), c.kv_heads * c.head_dim());
        let be = ctx.backend;
        let lay = &self.layout;
        let l = ctx.ledger;
        let w = |i: usize| weights.view(l, lay.range(i));

        // MLP half.
        {
            let (gate, up, xn2) = (a.gate.view_all(l), a.up.view_all(l), a.xn2.view_all(l));
            let mut act = ctx.work(t * f);
            be.swiglu_forward(&mut act, &gate, &up);
            grads.accumulate(lay.range(lp.down), &mut |dw| {
                be.linear_backward_weight(dw, &dx, &act, t, f, h)
            });
            drop(act);
            let mut dact = ctx.work(t * f);
            be.linear_backward_input(&mut dact, &dx, &w(lp.down), t, f, h, false);
            let (mut dgate, mut dup) = (ctx.work(t * f), ctx.work(t * f));
            be.swiglu_backward(&mut dgate, &mut dup, &dact, &gate, &up);
            drop(dact);
            grads.accumulate(lay.range(lp.gate), &mut |dw| {
                be.linear_backward_weight(dw, &dgate, &xn2, t, h, f)
            });
            grads.accumulate(lay.range(lp.up), &mut |dw| {
                be.linear_backward_weight(dw, &dup, &xn2, t, h, f)
            });
            let mut dxn2 = ctx.work(t * h);
            be.linear_backward_input(&mut dxn2, &dgate, &w(lp.gate), t, h, f, false);
            be.linear_backward_input(&mut dxn2, &dup, &w(lp.up), t, h, f, true);
            let x_mid = a.x_mid.view_all(l);
            let wn = w(lp.mlp_norm);
            // dx becomes d loss/d x_mid: the residual path plus the norm's input gradient.
            grads.accumulate(lay.range(lp.mlp_norm), &mut |dw| {
                be.rmsnorm_backward(&mut dx, dw, &dxn2, &x_mid, &a.rstd2, &wn, h, true)
            });
        }
        drop((a.gate, a.up, a.xn2, a.x_mid, a.rstd2));

        // Attention half.
        let attn = a.attn.view_all(l);
        grads.accumulate(lay.range(lp.o), &mut |dw| {
            be.linear_backward_weight(dw, &dx, &attn, t, qd, h)
        });
        drop(attn);
        let mut dattn = ctx.work(t * qd);
        be.linear_backward_input(&mut dattn, &dx, &w(lp.o), t, qd, h, false);
        let (mut dq, mut dk, mut dv) = (ctx.work(t * qd), ctx.work(t * kd), ctx.work(t * kd));
        {
            let (q, k, v, out) = (
                a.q.view_all(l),
                a.k.view_all(l),
                a.v.view_all(l),
                a.attn.view_all(l),
            );
            let saved = AttnSaved {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &a.lse,
            };
            be.attention_backward(
                &mut dq,
                &mut dk,
                &mut dv,
                &dattn,
                saved,
                self.attn_shape(batch),
            );
        }
        drop((dattn, a.q, a.k, a.v, a.attn, a.lse));
        be.rope(&mut dq, positions, c.heads, &self.rope, true);
        be.rope(&mut dk, positions, c.kv_heads, &self.rope, true);
        let xn1 = a.xn1.view_all(l);
        grads.accumulate(lay.range(lp.q), &mut |dw| {
            be.linear_backward_weight(dw, &dq, &xn1, t, h, qd)
        });
        grads.accumulate(lay.range(lp.k), &mut |dw| {
            be.linear_backward_weight(dw, &dk, &xn1, t, h, kd)
        });
        grads.accumulate(lay.range(lp.v), &mut |dw| {
            be.linear_backward_weight(dw, &dv, &xn1, t, h, kd)
        });
        drop(xn1);
        let mut dxn1 = ctx.work(t * h);
        be.linear_backward_input(&mut dxn1, &dq, &w(lp.q), t, h, qd, false);
        be.linear_backward_input(&mut dxn1, &dk, &w(lp.k), t, h, kd, true);
        be.linear_backward_input(&mut dxn1, &dv, &w(lp.v), t, h, kd, true);
        drop((dq, dk, dv));
        let x_in = a.x_in.view_all(l);
        let wn = w(lp.attn_norm);
        grads.accumulate(lay.range(lp.attn_norm), &mut |dw| {
            be.rmsnorm_backward(&mut dx, dw, &dxn1, &x_in, &a.rstd1, &wn, h, true)
        });
        dx
    }
}
