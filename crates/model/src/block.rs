//! One transformer block, forward and backward, on one rank or a tensor-parallel group.
//!
//! Tensor-parallel structure (Megatron): norm → `f`/`g` → Q, K, V column-parallel (this rank's
//! heads, with this rank's slice of their biases when the model has them) → attention → output projection row-parallel → `f̄`/`ḡ` → residual; norm → `f`/`g`
//! → gate, up column-parallel → SwiGLU → down row-parallel → `f̄`/`ḡ` → residual. A
//! mixture-of-experts block replaces the MLP by [`crate::moe`] (replicated over the group).
//!
//! Under context parallelism the block sees this rank's tokens only; attention is the
//! [`crate::ContextParallel`] ring, everything else is per token. What the forward keeps for
//! the backward is the recomputation policy's ([`crate::recompute`]).

use std::ops::Range;

use ferrotron_config::Recompute;
use ferrotron_tensor::{Buf, DeviceSlice, LinearShape, NormSaved, Store};

use crate::access::product_weight;
use crate::attention::widths;
use crate::ctx::{BlockCall, StepCtx};
use crate::fp8::Fp8Layer;
use crate::layout::Split;
use crate::moe::MoeSaved;
use crate::recompute::{AttnActs, BlockActs, MlpActs, Saved};
use crate::strategy::{AttnOut, QkvGrads, RingSaved};
use crate::tp;
use crate::{GradSink, HookError, Llama, Mlp};

/// The weights of parameter `param` as the block's weight source gives them.
fn weight<'c>(
    call: &'c BlockCall<'_, '_>,
    model: &Llama,
    param: usize,
) -> ferrotron_tensor::View<'c> {
    call.weights
        .view(call.ctx.device(), model.layout.range(param))
}

impl Llama {
    /// `y = x · Wᵀ` with the weight `param` as the backend's products read it
    /// ([`crate::access::product_weight`]).
    fn project(
        &self,
        call: &BlockCall<'_, '_>,
        y: &mut DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        param: usize,
        sh: LinearShape,
    ) -> Result<(), HookError> {
        let dev = call.ctx.device();
        let w = product_weight(call.weights, dev, self.layout.range(param));
        crate::fp8::forward(
            call.ctx,
            y,
            (x.operand(), w.operand(), self.fp8_layer(param)),
            sh,
        )
    }

    /// `dx (+)= dy · W` (`accumulate`: add) with the weight `param` as the products read it.
    fn project_back(
        &self,
        call: &BlockCall<'_, '_>,
        (dx, accumulate): (&mut DeviceSlice<f32>, bool),
        dy: &DeviceSlice<f32>,
        param: usize,
        sh: LinearShape,
    ) -> Result<(), HookError> {
        let dev = call.ctx.device();
        let w = product_weight(call.weights, dev, self.layout.range(param));
        let operands = (dy.operand(), w.operand(), self.fp8_layer(param));
        crate::fp8::backward_input(call.ctx, (dx, accumulate), operands, sh)
    }

    /// The linear weight `param` as FP8 sees it.
    fn fp8_layer(&self, param: usize) -> Fp8Layer {
        Fp8Layer {
            split: self.layout.params[param].split,
            at: self.layout.range(param).start,
        }
    }
}

/// A weight gradient `dW += dyᵀ · x` deferred from a backward's input half to its weight
/// half (zero-bubble schedules): its inputs are kept, counted as activations, until then.
pub struct DeferredGrad {
    range: Range<usize>,
    layer: Fp8Layer,
    dy: Buf<f32>,
    x: Buf<f32>,
    sh: LinearShape,
}

impl DeferredGrad {
    /// Computes the gradient into `grads`.
    pub fn apply(self, ctx: &StepCtx<'_>, grads: &mut dyn GradSink) -> Result<(), HookError> {
        let mut done = Ok(());
        grads.accumulate(ctx.device(), self.range, &mut |dw| {
            let operands = (self.dy.operand(), self.x.operand(), self.layer);
            done = crate::fp8::backward_weight(ctx, dw, operands, self.sh);
        });
        done
    }
}

/// Where a block's weight gradients go: into the sink now, or (zero bubble's input half)
/// queued with their inputs for later.
pub(crate) struct WeightGrads<'g> {
    pub(crate) sink: &'g mut dyn GradSink,
    pub(crate) defer: Option<&'g mut Vec<DeferredGrad>>,
}

impl WeightGrads<'_> {
    /// `dW += dyᵀ · x` for the parameter at `range` (split `split` over TP), now or later.
    fn linear(
        &mut self,
        ctx: &StepCtx<'_>,
        (range, split): (Range<usize>, Split),
        dy: &DeviceSlice<f32>,
        x: &DeviceSlice<f32>,
        sh: LinearShape,
    ) -> Result<(), HookError> {
        let layer = Fp8Layer {
            split,
            at: range.start,
        };
        match &mut self.defer {
            None => {
                let mut done = Ok(());
                self.sink.accumulate(ctx.device(), range, &mut |dw| {
                    done = crate::fp8::backward_weight(
                        ctx,
                        dw,
                        (dy.operand(), x.operand(), layer),
                        sh,
                    );
                });
                done
            }
            Some(list) => {
                let keep = |v: &DeviceSlice<f32>| {
                    let mut b = ctx
                        .ledger
                        .zeros::<f32>(ferrotron_tensor::Category::Activations, v.len());
                    ctx.backend.copy(&mut b, v);
                    b
                };
                list.push(DeferredGrad {
                    range,
                    layer,
                    dy: keep(dy),
                    x: keep(x),
                    sh,
                });
                Ok(())
            }
        }
    }
}

/// The residual add `a + b` into a new saved-activation buffer.
fn residual(ctx: &StepCtx<'_>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>) -> Buf<f32> {
    let mut out = ctx.act_out(a.len());
    ctx.backend.add(&mut out, a, b);
    out
}

impl Llama {
    /// Forward of one block on `x_in`; returns its output and what its backward needs under
    /// the recomputation policy `recompute`.
    pub(crate) fn block_forward(
        &self,
        call: &BlockCall<'_, '_>,
        x_in: Store,
        recompute: Recompute,
    ) -> Result<(Store, BlockActs), HookError> {
        let attn = self.attention_half(call, &x_in)?;
        let (out, mlp) = self.mlp_half(call, &attn.x_mid)?;
        let ctx = call.ctx;
        let out = ctx.keep(out);
        let saved = Saved { x_in, attn, mlp };
        Ok((out, saved.keep(ctx, recompute)))
    }

    /// x_mid = x + f̄(o_proj(attention(rope(q), rope(k), v))) of f(norm(x)).
    fn attention_half(
        &self,
        call: &BlockCall<'_, '_>,
        x_in: &Store,
    ) -> Result<crate::recompute::AttnHalf, HookError> {
        let (ctx, lp, c) = (call.ctx, call.lp, &self.cfg);
        let (h, t) = (c.hidden, call.positions.len());
        let tr = ctx.local_tokens(t);
        let (qd, kd, _, heads, kv_heads) = widths(self);
        let (be, l) = (ctx.backend, ctx.device());
        let x = x_in.view_all(l);
        let mut xn1 = ctx.act_out(tr * h);
        let mut rstd1 = ctx.stats(tr);
        let wn = weight(call, self, lp.attn_norm);
        be.rmsnorm_forward(&mut xn1, &mut rstd1, &x, &wn, h, c.rms_eps as f32);
        drop(wn);
        let gathered = tp::enter(ctx.tp(), l, &xn1)?;
        let xin: &DeviceSlice<f32> = gathered.as_deref().unwrap_or(&xn1);
        let (to_q, to_kv) = (LinearShape::new(t, h, qd), LinearShape::new(t, h, kd));
        let (mut q, mut k, mut v) = (
            ctx.act_out(t * qd),
            ctx.act_out(t * kd),
            ctx.act_out(t * kd),
        );
        self.project(call, &mut q, xin, lp.q, to_q)?;
        self.project(call, &mut k, xin, lp.k, to_kv)?;
        self.project(call, &mut v, xin, lp.v, to_kv)?;
        drop(gathered);
        if let Some([bq, bk, bv]) = lp.qkv_bias {
            for (y, b) in [(&mut q, bq), (&mut k, bk), (&mut v, bv)] {
                be.bias_forward(y, &weight(call, self, b));
            }
        }
        be.rope(&mut q, call.positions, heads, &self.rope, false);
        be.rope(&mut k, call.positions, kv_heads, &self.rope, false);
        let mut attn = ctx.act_buf(t * qd);
        let mut lse = ctx.stats(call.batch * heads * ctx.local_seq(c.seq_len));
        let out = AttnOut {
            out: &mut attn,
            lse: &mut lse,
        };
        self.attention(call, out, (&q, &k, &v))?;
        let mut o = ctx.work_out(t * h);
        let from_q = LinearShape::new(t, qd, h);
        self.project(call, &mut o, &attn, lp.o, from_q)?;
        let o = tp::exit(ctx.tp(), l, o)?;
        let x_mid = residual(ctx, &o, &x);
        Ok(crate::recompute::AttnHalf {
            rstd1,
            xn1,
            q,
            k,
            v,
            attn,
            lse,
            x_mid,
        })
    }

    /// out = x_mid + f̄(down(silu(gate(xn2)) ⊙ up(xn2))) with xn2 = f(norm(x_mid)), or the
    /// mixture of experts on xn2. Returns the output and the MLP half's tensors.
    fn mlp_half(
        &self,
        call: &BlockCall<'_, '_>,
        x_mid: &DeviceSlice<f32>,
    ) -> Result<(Buf<f32>, crate::recompute::MlpHalf), HookError> {
        let (ctx, lp, c) = (call.ctx, call.lp, &self.cfg);
        let (h, t) = (c.hidden, call.positions.len());
        let tr = ctx.local_tokens(t);
        let (_, _, f, _, _) = widths(self);
        let (be, l) = (ctx.backend, ctx.device());
        let mut xn2 = ctx.act_out(tr * h);
        let mut rstd2 = ctx.stats(tr);
        let wn = weight(call, self, lp.mlp_norm);
        be.rmsnorm_forward(&mut xn2, &mut rstd2, x_mid, &wn, h, c.rms_eps as f32);
        drop(wn);
        let (down, gate, up, moe) = match lp.mlp {
            Mlp::Dense {
                gate: w_gate,
                up: w_up,
                down: w_down,
            } => {
                let gathered = tp::enter(ctx.tp(), l, &xn2)?;
                let xin: &DeviceSlice<f32> = gathered.as_deref().unwrap_or(&xn2);
                let (mut gate, mut up) = (ctx.act_out(t * f), ctx.act_out(t * f));
                let (to_f, to_h) = (LinearShape::new(t, h, f), LinearShape::new(t, f, h));
                self.project(call, &mut gate, xin, w_gate, to_f)?;
                self.project(call, &mut up, xin, w_up, to_f)?;
                drop(gathered);
                let mut act = ctx.work_out(t * f);
                be.swiglu_forward(&mut act, &gate, &up);
                let mut down = ctx.work_out(t * h);
                self.project(call, &mut down, &act, w_down, to_h)?;
                drop(act);
                (tp::exit(ctx.tp(), l, down)?, gate, up, MoeSaved::default())
            }
            Mlp::Moe(mp) => {
                let (out, acts, counted) = self.moe_forward(ctx, call.weights, &mp, &xn2)?;
                let moe = MoeSaved {
                    acts: Some(acts),
                    ..counted
                };
                (out, ctx.act_buf(0), ctx.act_buf(0), moe)
            }
        };
        let out = residual(ctx, &down, x_mid);
        drop(down);
        let half = crate::recompute::MlpHalf {
            rstd2,
            xn2,
            gate,
            up,
            moe,
        };
        Ok((out, half))
    }

    /// Takes `d loss/d out` of the block (this rank's tokens), returns `d loss/d x_in`.
    pub(crate) fn block_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut WeightGrads<'_>,
        acts: BlockActs,
        dx: Buf<f32>,
    ) -> Result<Buf<f32>, HookError> {
        let BlockActs { attn, mlp, .. } = self.restore(call, acts)?;
        let dx = self.mlp_backward(call, grads, mlp, dx)?;
        self.attention_backward_half(call, grads, attn, dx)
    }

    /// The MLP half's backward: `dx` (d loss/d out) becomes d loss/d x_mid, the residual path
    /// plus the norm's input gradient. ḡ backward gathers the tokens' output gradient; g
    /// backward scatters the input gradient (f̄ / f: identity / all-reduce).
    fn mlp_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut WeightGrads<'_>,
        mut a: MlpActs,
        mut dx: Buf<f32>,
    ) -> Result<Buf<f32>, HookError> {
        let (ctx, lp, h) = (call.ctx, call.lp, self.cfg.hidden);
        let l = ctx.device();
        let dxn2 = match lp.mlp {
            Mlp::Moe(_) => {
                let acts = a
                    .moe
                    .acts
                    .take()
                    .expect("a restored block keeps its experts' activations");
                let xn2 = a.xn2.view_all(l);
                self.moe_backward(call, grads.sink, acts, (&xn2, &dx))?
            }
            Mlp::Dense { .. } => self.dense_mlp_backward(call, grads, &a, &dx)?,
        };
        let x_mid = a.x_mid.view_all(l);
        let wn = weight(call, self, lp.mlp_norm);
        let be = ctx.backend;
        let (rstd, w) = (&a.rstd2, &wn);
        let saved = NormSaved {
            x: &x_mid,
            rstd,
            w,
            h,
        };
        ctx.norm_grad(grads.sink, self.layout.range(lp.mlp_norm), &mut |dw| {
            be.rmsnorm_backward(&mut dx, dw, &dxn2, saved, true)
        })?;
        Ok(dx)
    }

    /// The dense MLP's backward from `dx` (d loss/d out): returns d loss/d xn2 (this rank's
    /// tokens), the gate, up and down weight gradients into `grads`.
    fn dense_mlp_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut WeightGrads<'_>,
        a: &MlpActs,
        dx: &DeviceSlice<f32>,
    ) -> Result<Buf<f32>, HookError> {
        let Mlp::Dense {
            gate: w_gate,
            up: w_up,
            down: w_down,
        } = call.lp.mlp
        else {
            unreachable!("called for dense blocks")
        };
        let (ctx, lay) = (call.ctx, &self.layout);
        let (h, t) = (self.cfg.hidden, call.positions.len());
        let (_, _, f, _, _) = widths(self);
        let (be, l) = (ctx.backend, ctx.device());
        let (gate, up) = (a.gate.view_all(l), a.up.view_all(l));
        let dy_full = tp::exit_backward(ctx.tp(), l, dx)?;
        let dy: &DeviceSlice<f32> = dy_full.as_deref().unwrap_or(dx);
        let mut act = ctx.work_out(t * f);
        be.swiglu_forward(&mut act, &gate, &up);
        let (to_f, to_h) = (LinearShape::new(t, h, f), LinearShape::new(t, f, h));
        grads.linear(ctx, lay.range_split(w_down), dy, &act, to_h)?;
        drop(act);
        let mut dact = ctx.work_out(t * f);
        self.project_back(call, (&mut dact, false), dy, w_down, to_h)?;
        drop(dy_full);
        let (mut dgate, mut dup) = (ctx.work_out(t * f), ctx.work_out(t * f));
        be.swiglu_backward(&mut dgate, &mut dup, &dact, &gate, &up);
        drop(dact);
        let xn2 = a.xn2.view_all(l);
        let gathered = tp::enter(ctx.tp(), l, &xn2)?;
        let xin: &DeviceSlice<f32> = gathered.as_deref().unwrap_or(&xn2);
        grads.linear(ctx, lay.range_split(w_gate), &dgate, xin, to_f)?;
        grads.linear(ctx, lay.range_split(w_up), &dup, xin, to_f)?;
        drop(gathered);
        let mut dxn2 = ctx.work_out(t * h);
        self.project_back(call, (&mut dxn2, false), &dgate, w_gate, to_f)?;
        self.project_back(call, (&mut dxn2, true), &dup, w_up, to_f)?;
        drop((dgate, dup));
        tp::enter_backward(ctx.tp(), l, dxn2)
    }

    /// The attention half's backward: `dx` (d loss/d x_mid) becomes d loss/d x_in.
    fn attention_backward_half(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut WeightGrads<'_>,
        a: AttnActs,
        dx: Buf<f32>,
    ) -> Result<Buf<f32>, HookError> {
        let (ctx, lp, lay) = (call.ctx, call.lp, &self.layout);
        let (h, t) = (self.cfg.hidden, call.positions.len());
        let (qd, kd, _, _, _) = widths(self);
        let l = ctx.device();
        let dy_full = tp::exit_backward(ctx.tp(), l, &dx)?;
        let dy: &DeviceSlice<f32> = dy_full.as_deref().unwrap_or(&dx);
        let attn = a.attn.view_all(l);
        let from_q = LinearShape::new(t, qd, h);
        grads.linear(ctx, lay.range_split(lp.o), dy, &attn, from_q)?;
        drop(attn);
        let mut dattn = ctx.work_out(t * qd);
        self.project_back(call, (&mut dattn, false), dy, lp.o, from_q)?;
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
            let qkv = QkvGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
            };
            self.attention_backward(call, qkv, &dattn, saved)?;
        }
        drop((dattn, a.q, a.k, a.v, a.attn, a.lse));
        self.qkv_backward(call, grads, (a.x_in, a.rstd1, a.xn1), [dq, dk, dv], dx)
    }

    /// From the query, key and value gradients (before RoPE's inverse): their weight
    /// gradients, the attention norm's, and `dx` (d loss/d x_mid) made d loss/d x_in.
    fn qkv_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut WeightGrads<'_>,
        (x_in, rstd1, xn1): (Store, Buf<f32>, Store),
        [mut dq, mut dk, dv]: [Buf<f32>; 3],
        mut dx: Buf<f32>,
    ) -> Result<Buf<f32>, HookError> {
        let (ctx, lp, lay) = (call.ctx, call.lp, &self.layout);
        let (h, t) = (self.cfg.hidden, call.positions.len());
        let (qd, kd, _, heads, kv_heads) = widths(self);
        let (be, l) = (ctx.backend, ctx.device());
        be.rope(&mut dq, call.positions, heads, &self.rope, true);
        be.rope(&mut dk, call.positions, kv_heads, &self.rope, true);
        if let Some([bq, bk, bv]) = lp.qkv_bias {
            // The biases' gradients: column sums of the projections' output gradients, over
            // every token the projection saw (under sequence parallelism, the gathered ones).
            for (dy, b) in [(&dq, bq), (&dk, bk), (&dv, bv)] {
                grads
                    .sink
                    .accumulate(l, lay.range(b), &mut |db| be.bias_backward(db, dy));
            }
        }
        let xn1 = xn1.view_all(l);
        let gathered = tp::enter(ctx.tp(), l, &xn1)?;
        let xin: &DeviceSlice<f32> = gathered.as_deref().unwrap_or(&xn1);
        let (to_q, to_kv) = (LinearShape::new(t, h, qd), LinearShape::new(t, h, kd));
        grads.linear(ctx, lay.range_split(lp.q), &dq, xin, to_q)?;
        grads.linear(ctx, lay.range_split(lp.k), &dk, xin, to_kv)?;
        grads.linear(ctx, lay.range_split(lp.v), &dv, xin, to_kv)?;
        drop((gathered, xn1));
        let mut dxn1 = ctx.work_out(t * h);
        self.project_back(call, (&mut dxn1, false), &dq, lp.q, to_q)?;
        self.project_back(call, (&mut dxn1, true), &dk, lp.k, to_kv)?;
        self.project_back(call, (&mut dxn1, true), &dv, lp.v, to_kv)?;
        drop((dq, dk, dv));
        let dxn1 = tp::enter_backward(ctx.tp(), l, dxn1)?;
        let x_in = x_in.view_all(l);
        let wn = weight(call, self, lp.attn_norm);
        let saved = NormSaved {
            x: &x_in,
            rstd: &rstd1,
            w: &wn,
            h,
        };
        ctx.norm_grad(grads.sink, lay.range(lp.attn_norm), &mut |dw| {
            be.rmsnorm_backward(&mut dx, dw, &dxn1, saved, true)
        })?;
        Ok(dx)
    }
}
