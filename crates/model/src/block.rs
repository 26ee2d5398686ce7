//! One transformer block, forward and backward, on one rank or a tensor-parallel group.
//!
//! Tensor-parallel structure (Megatron): norm → `f`/`g` → Q, K, V column-parallel (this rank's
//! heads) → attention → output projection row-parallel → `f̄`/`ḡ` → residual; norm → `f`/`g`
//! → gate, up column-parallel → SwiGLU → down row-parallel → `f̄`/`ḡ` → residual. A
//! mixture-of-experts block replaces the MLP by [`crate::moe`] (replicated over the group).
//!
//! Under context parallelism the block sees this rank's tokens only; attention is the ring of
//! [`crate::cp`], everything else is per token.

use ferrotron_config::Recompute;
use ferrotron_tensor::{Buf, Category, Store};

use crate::attention::widths;
use crate::llama::StepCtx;
use crate::moe::MoeSaved;
use crate::strategy::RingSaved;
use crate::tp;
use crate::{GradSink, HookError, LayerParams, Llama, Mlp, WeightSource};

/// Activations one block saves for its backward (opaque outside the model). Residual-stream
/// tensors hold this rank's tokens (all of them without sequence parallelism); the others
/// this rank's heads/columns.
pub struct BlockActs {
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
    /// Mixture-of-experts blocks: their activations (instead of `gate` and `up`) and routing
    /// statistics.
    pub(crate) moe: MoeSaved,
    /// Full recomputation: only `x_in` is kept.
    input_only: bool,
}

/// A weight gradient `dW += dyᵀ · x` deferred from a backward's input half to its weight
/// half (zero-bubble schedules): its inputs are kept, counted as activations, until then.
pub struct DeferredGrad {
    range: std::ops::Range<usize>,
    dy: Buf<f32>,
    x: Buf<f32>,
    t: usize,
    d_in: usize,
    d_out: usize,
}

impl DeferredGrad {
    /// Computes the gradient into `grads`.
    pub fn apply(self, ctx: &StepCtx<'_>, grads: &mut dyn GradSink) {
        grads.accumulate(self.range, &mut |dw| {
            ctx.backend
                .linear_backward_weight(dw, &self.dy, &self.x, self.t, self.d_in, self.d_out)
        });
    }
}

impl Llama {
    /// `dW += dyᵀ · x` for the parameter at `range`, now or (with `defer`) later.
    #[allow(clippy::too_many_arguments)]
    fn weight_grad(
        &self,
        ctx: &StepCtx<'_>,
        grads: &mut dyn GradSink,
        defer: &mut Option<&mut Vec<DeferredGrad>>,
        range: std::ops::Range<usize>,
        dy: &[f32],
        x: &[f32],
        t: usize,
        d_in: usize,
        d_out: usize,
    ) {
        match defer {
            None => grads.accumulate(range, &mut |dw| {
                ctx.backend
                    .linear_backward_weight(dw, dy, x, t, d_in, d_out)
            }),
            Some(list) => {
                let keep = |v: &[f32]| {
                    let mut b = ctx
                        .ledger
                        .zeros::<f32>(ferrotron_tensor::Category::Activations, v.len());
                    b.copy_from_slice(v);
                    b
                };
                list.push(DeferredGrad {
                    range,
                    dy: keep(dy),
                    x: keep(x),
                    t,
                    d_in,
                    d_out,
                });
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn block_forward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        lp: &LayerParams,
        x_in: Store,
        positions: &[usize],
        batch: usize,
        recompute: Recompute,
    ) -> Result<(Store, BlockActs), HookError> {
        let c = &self.cfg;
        let (h, t) = (c.hidden, positions.len());
        let tr = ctx.local_tokens(t);
        let (qd, kd, f, heads, kv_heads) = widths(self);
        let (be, l, lay) = (ctx.backend, ctx.ledger, &self.layout);
        let w = |i: usize| weights.view(l, lay.range(i));

        // Attention half: x_mid = x + f̄(o_proj(attention(rope(q), rope(k), v))) of f(norm(x)).
        let x = x_in.view_all(l);
        let mut xn1 = ctx.act_buf(tr * h);
        let mut rstd1 = ctx.stats(tr);
        be.rmsnorm_forward(
            &mut xn1,
            &mut rstd1,
            &x,
            &w(lp.attn_norm),
            h,
            c.rms_eps as f32,
        );
        let gathered = tp::enter(ctx.tp(), l, &xn1)?;
        let xin: &[f32] = gathered.as_deref().unwrap_or(&xn1);
        let (mut q, mut k, mut v) = (
            ctx.act_buf(t * qd),
            ctx.act_buf(t * kd),
            ctx.act_buf(t * kd),
        );
        be.linear_forward(&mut q, xin, &w(lp.q), t, h, qd);
        be.linear_forward(&mut k, xin, &w(lp.k), t, h, kd);
        be.linear_forward(&mut v, xin, &w(lp.v), t, h, kd);
        drop(gathered);
        be.rope(&mut q, positions, heads, &self.rope, false);
        be.rope(&mut k, positions, kv_heads, &self.rope, false);
        let mut attn = ctx.act_buf(t * qd);
        let mut lse = ctx.stats(batch * heads * ctx.local_seq(c.seq_len));
        self.attention(ctx, &mut attn, &mut lse, &q, &k, &v, batch)?;
        let mut o = ctx.work(t * h);
        be.linear_forward(&mut o, &attn, &w(lp.o), t, qd, h);
        let o = tp::exit(ctx.tp(), l, o)?;
        let mut x_mid = ctx.act_buf(tr * h);
        x_mid
            .iter_mut()
            .zip(o.iter().zip(x.iter()))
            .for_each(|(m, (o, x))| *m = o + x);
        drop((o, x));

        // MLP half: out = x_mid + f̄(down(silu(gate(xn2)) ⊙ up(xn2))) with xn2 = f(norm(x_mid)).
        let mut xn2 = ctx.act_buf(tr * h);
        let mut rstd2 = ctx.stats(tr);
        be.rmsnorm_forward(
            &mut xn2,
            &mut rstd2,
            &x_mid,
            &w(lp.mlp_norm),
            h,
            c.rms_eps as f32,
        );
        let (down, gate, up, moe) = match lp.mlp {
            Mlp::Dense {
                gate: w_gate,
                up: w_up,
                down: w_down,
            } => {
                let gathered = tp::enter(ctx.tp(), l, &xn2)?;
                let xin: &[f32] = gathered.as_deref().unwrap_or(&xn2);
                let (mut gate, mut up) = (ctx.act_buf(t * f), ctx.act_buf(t * f));
                be.linear_forward(&mut gate, xin, &w(w_gate), t, h, f);
                be.linear_forward(&mut up, xin, &w(w_up), t, h, f);
                drop(gathered);
                let mut act = ctx.work(t * f);
                be.swiglu_forward(&mut act, &gate, &up);
                let mut down = ctx.work(t * h);
                be.linear_forward(&mut down, &act, &w(w_down), t, f, h);
                drop(act);
                (tp::exit(ctx.tp(), l, down)?, gate, up, MoeSaved::default())
            }
            Mlp::Moe(mp) => {
                let (out, acts, stats) = self.moe_forward(ctx, weights, &mp, &xn2)?;
                let moe = MoeSaved {
                    acts: Some(acts),
                    stats: Some(stats),
                };
                (out, ctx.act_buf(0), ctx.act_buf(0), moe)
            }
        };
        let mut out = ctx.act_buf(tr * h);
        out.iter_mut()
            .zip(down.iter().zip(x_mid.iter()))
            .for_each(|(o, (d, m))| *o = d + m);
        drop(down);

        let out = ctx.keep(out);
        if recompute == Recompute::Full {
            drop((gate, up));
            // Keep only the block's input; backward runs this forward again.
            let empty = || ctx.ledger.zeros::<f32>(Category::Activations, 0);
            let none = || ctx.keep(empty());
            let acts = BlockActs {
                x_in,
                rstd1: empty(),
                xn1: none(),
                q: none(),
                k: none(),
                v: none(),
                attn: none(),
                lse: empty(),
                x_mid: none(),
                rstd2: empty(),
                xn2: none(),
                gate: none(),
                up: none(),
                moe: MoeSaved {
                    acts: None,
                    stats: moe.stats,
                },
                input_only: true,
            };
            return Ok((out, acts));
        }
        // Selective: the normed inputs and the attention output are recomputed in backward.
        let (xn1, xn2, attn) = if recompute == Recompute::Selective {
            drop((xn1, xn2, attn));
            let none = || ctx.keep(ctx.ledger.zeros::<f32>(Category::Activations, 0));
            (none(), none(), none())
        } else {
            (ctx.keep(xn1), ctx.keep(xn2), ctx.keep(attn))
        };
        let acts = BlockActs {
            x_in,
            rstd1,
            xn1,
            q: ctx.keep(q),
            k: ctx.keep(k),
            v: ctx.keep(v),
            attn,
            lse,
            x_mid: ctx.keep(x_mid),
            rstd2,
            xn2,
            gate: ctx.keep(gate),
            up: ctx.keep(up),
            moe,
            input_only: false,
        };
        Ok((out, acts))
    }

    /// Recomputes what the forward did not keep: the whole block under full recomputation;
    /// the normed inputs (from the kept input and reciprocal RMS) and the attention output
    /// (a flash-attention forward from Q, K, V) under selective recomputation. The results
    /// are bit-identical to what the forward would have kept.
    fn restore(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        lp: &LayerParams,
        mut a: BlockActs,
        positions: &[usize],
        batch: usize,
    ) -> Result<BlockActs, HookError> {
        if a.input_only {
            let (_, acts) =
                self.block_forward(ctx, weights, lp, a.x_in, positions, batch, Recompute::None)?;
            return Ok(acts);
        }
        let (h, l, lay) = (self.cfg.hidden, ctx.ledger, &self.layout);
        let norm = |x: &Store, rstd: &[f32], w: usize| {
            let (x, w) = (x.view_all(l), weights.view(l, lay.range(w)));
            let mut y = ctx.act_buf(x.len());
            for ((y, x), r) in y.chunks_mut(h).zip(x.chunks(h)).zip(rstd) {
                for ((y, x), w) in y.iter_mut().zip(x).zip(w.iter()) {
                    *y = x * *r * w;
                }
            }
            ctx.keep(y)
        };
        if a.xn1.is_empty() {
            a.xn1 = norm(&a.x_in, &a.rstd1, lp.attn_norm);
            a.xn2 = norm(&a.x_mid, &a.rstd2, lp.mlp_norm);
        }
        if a.attn.is_empty() {
            let (q, k, v) = (a.q.view_all(l), a.k.view_all(l), a.v.view_all(l));
            let mut attn = ctx.act_buf(q.len());
            let mut lse = ctx.work(a.lse.len());
            self.attention(ctx, &mut attn, &mut lse, &q, &k, &v, batch)?;
            drop((q, k, v));
            a.attn = ctx.keep(attn);
        }
        Ok(a)
    }

    /// Takes `d loss/d out` of the block (this rank's tokens), returns `d loss/d x_in`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn block_backward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: &mut dyn GradSink,
        lp: &LayerParams,
        a: BlockActs,
        mut dx: Buf<f32>,
        positions: &[usize],
        batch: usize,
        mut defer: Option<&mut Vec<DeferredGrad>>,
    ) -> Result<Buf<f32>, HookError> {
        let mut a = self.restore(ctx, weights, lp, a, positions, batch)?;
        let c = &self.cfg;
        let (h, t) = (c.hidden, positions.len());
        let (qd, kd, f, heads, kv_heads) = widths(self);
        let (be, l, lay) = (ctx.backend, ctx.ledger, &self.layout);
        let w = |i: usize| weights.view(l, lay.range(i));

        // MLP half. ḡ backward gathers the tokens' output gradient; g backward scatters the
        // input gradient (f̄ / f: identity / all-reduce).
        {
            let dxn2 = match lp.mlp {
                Mlp::Moe(mp) => {
                    let acts = a
                        .moe
                        .acts
                        .take()
                        .expect("a restored block keeps its experts' activations");
                    let xn2 = a.xn2.view_all(l);
                    self.moe_backward(ctx, weights, grads, &mp, acts, &xn2, &dx)?
                }
                Mlp::Dense {
                    gate: w_gate,
                    up: w_up,
                    down: w_down,
                } => {
                    let (gate, up) = (a.gate.view_all(l), a.up.view_all(l));
                    let dy_full = tp::exit_backward(ctx.tp(), l, &dx)?;
                    let dy: &[f32] = dy_full.as_deref().unwrap_or(&dx);
                    let mut act = ctx.work(t * f);
                    be.swiglu_forward(&mut act, &gate, &up);
                    self.weight_grad(ctx, grads, &mut defer, lay.range(w_down), dy, &act, t, f, h);
                    drop(act);
                    let mut dact = ctx.work(t * f);
                    be.linear_backward_input(&mut dact, dy, &w(w_down), t, f, h, false);
                    drop(dy_full);
                    let (mut dgate, mut dup) = (ctx.work(t * f), ctx.work(t * f));
                    be.swiglu_backward(&mut dgate, &mut dup, &dact, &gate, &up);
                    drop(dact);
                    let xn2 = a.xn2.view_all(l);
                    let gathered = tp::enter(ctx.tp(), l, &xn2)?;
                    let xin: &[f32] = gathered.as_deref().unwrap_or(&xn2);
                    self.weight_grad(
                        ctx,
                        grads,
                        &mut defer,
                        lay.range(w_gate),
                        &dgate,
                        xin,
                        t,
                        h,
                        f,
                    );
                    self.weight_grad(ctx, grads, &mut defer, lay.range(w_up), &dup, xin, t, h, f);
                    drop(gathered);
                    let mut dxn2 = ctx.work(t * h);
                    be.linear_backward_input(&mut dxn2, &dgate, &w(w_gate), t, h, f, false);
                    be.linear_backward_input(&mut dxn2, &dup, &w(w_up), t, h, f, true);
                    drop((dgate, dup));
                    tp::enter_backward(ctx.tp(), l, dxn2)?
                }
            };
            let x_mid = a.x_mid.view_all(l);
            let wn = w(lp.mlp_norm);
            // dx becomes d loss/d x_mid: the residual path plus the norm's input gradient.
            ctx.norm_grad(grads, lay.range(lp.mlp_norm), &mut |dw| {
                be.rmsnorm_backward(&mut dx, dw, &dxn2, &x_mid, &a.rstd2, &wn, h, true)
            })?;
        }
        drop((a.gate, a.up, a.xn2, a.x_mid, a.rstd2));

        // Attention half.
        let dy_full = tp::exit_backward(ctx.tp(), l, &dx)?;
        let dy: &[f32] = dy_full.as_deref().unwrap_or(&dx);
        let attn = a.attn.view_all(l);
        self.weight_grad(ctx, grads, &mut defer, lay.range(lp.o), dy, &attn, t, qd, h);
        drop(attn);
        let mut dattn = ctx.work(t * qd);
        be.linear_backward_input(&mut dattn, dy, &w(lp.o), t, qd, h, false);
        drop(dy_full);
        let (mut dq, mut dk, mut dv) = (ctx.work(t * qd), ctx.work(t * kd), ctx.work(t * kd));
        {
            let (q, k, v, out) = (
                a.q.view_all(l),
                a.k.view_all(l),
                a.v.view_all(l),
                a.attn.view_all(l),
            );
            let saved = RingSaved {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &a.lse,
            };
            self.attention_backward(ctx, &mut dq, &mut dk, &mut dv, &dattn, saved, batch)?;
        }
        drop((dattn, a.q, a.k, a.v, a.attn, a.lse));
        be.rope(&mut dq, positions, heads, &self.rope, true);
        be.rope(&mut dk, positions, kv_heads, &self.rope, true);
        let xn1 = a.xn1.view_all(l);
        let gathered = tp::enter(ctx.tp(), l, &xn1)?;
        let xin: &[f32] = gathered.as_deref().unwrap_or(&xn1);
        self.weight_grad(ctx, grads, &mut defer, lay.range(lp.q), &dq, xin, t, h, qd);
        self.weight_grad(ctx, grads, &mut defer, lay.range(lp.k), &dk, xin, t, h, kd);
        self.weight_grad(ctx, grads, &mut defer, lay.range(lp.v), &dv, xin, t, h, kd);
        drop((gathered, xn1));
        let mut dxn1 = ctx.work(t * h);
        be.linear_backward_input(&mut dxn1, &dq, &w(lp.q), t, h, qd, false);
        be.linear_backward_input(&mut dxn1, &dk, &w(lp.k), t, h, kd, true);
        be.linear_backward_input(&mut dxn1, &dv, &w(lp.v), t, h, kd, true);
        drop((dq, dk, dv));
        let dxn1 = tp::enter_backward(ctx.tp(), l, dxn1)?;
        let x_in = a.x_in.view_all(l);
        let wn = w(lp.attn_norm);
        ctx.norm_grad(grads, lay.range(lp.attn_norm), &mut |dw| {
            be.rmsnorm_backward(&mut dx, dw, &dxn1, &x_in, &a.rstd1, &wn, h, true)
        })?;
        Ok(dx)
    }
}
