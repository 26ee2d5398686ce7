//! Forward and backward of the Llama model, written out layer by layer, on one rank or on a
//! tensor-parallel group (see [`crate::tp`] and [`crate::strategy`]). The blocks live in [`crate::block`].
//!
//! Activation memory per block, in elements, with `T = b·s` tokens of the micro-batch, `t` the
//! tensor-parallel degree and `T_r = T/t` with sequence parallelism (`T` without): all saved
//! tensors are stored in the run's dtype except the f32 statistics `rstd` and `lse`:
//! `T_r·4h + T·(2·a·d + 2·a_kv·d + 2·h_ff)/t` stored + `2·T_r + b·a·s/t` f32 statistics —
//! block input, normed inputs of attention and MLP, mid-block residual (replicated over the
//! group unless sequence-parallel), then Q, K, V, attention output, gate and up (this rank's
//! heads and MLP columns). The SwiGLU product is recomputed in backward instead of stored (one
//! element-wise pass), and attention keeps only its output and log-sum-exp (flash style),
//! never the `s × s` scores. With t = 1 this is `T·(4h + 2·a·d + 2·a_kv·d + 2·h_ff)` +
//! `2T + b·a·s`. This is the playbook's `s·b·h·(10 + 24/t + 5as/(ht))` adapted: SwiGLU keeps
//! two `h_ff` inputs instead of GELU's four-`h` activations, there is no dropout mask, and
//! flash attention replaces the `5as/h` score terms by `a/(h·t)` of log-sum-exp.
//!
//! Under context parallelism (see [`crate::ContextParallel`]) a rank holds `s/c` tokens of each sequence:
//! `T = b·s/c` and the log-sum-exp is `b·a·s/(c·t)`, so every term above divides by `c`.

use ferrotron_config::ModelConfig;
use ferrotron_tensor::rope::RopeTable;
use ferrotron_tensor::xent::XentGrads;
use ferrotron_tensor::{Buf, DeviceSlice, HeadShape, NormSaved, Store};

use crate::access::{product_weight, Weight};
use crate::strategy::{VocabHead, VpGrads};
use crate::tp;
use crate::{GradSink, HookError, ParamLayout, Phase, Shard, Unit, WeightSource};

pub use crate::ctx::StepCtx;

/// The targets of a micro-batch's loss and the multiplier of each token's loss.
#[derive(Clone, Copy)]
pub struct LossTargets<'a> {
    /// Next-token targets, one per token of this rank.
    pub targets: &'a DeviceSlice<u32>,
    /// Multiplier of every token's loss (1 / tokens of the global batch).
    pub scale: f32,
}

/// The model on one rank: shape, this rank's parameter layout, RoPE table.
pub struct Llama {
    /// Shape.
    pub cfg: ModelConfig,
    /// Parameter layout (this tensor-parallel rank's shards).
    pub layout: ParamLayout,
    pub(crate) rope: RopeTable,
}

impl Llama {
    /// The model of `cfg` on one rank.
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::tensor_parallel(cfg, 1, 0)
    }

    /// One pipeline stage's part of the model, on tensor-parallel rank `tp_rank` of `tp`.
    pub fn stage(cfg: &ModelConfig, tp: usize, tp_rank: usize, parts: &crate::StageParts) -> Self {
        Self::sharded(cfg, Shard::tensor_parallel(tp, tp_rank), parts)
    }

    /// The model of `cfg` on tensor-parallel rank `tp_rank` of `tp`.
    pub fn tensor_parallel(cfg: &ModelConfig, tp: usize, tp_rank: usize) -> Self {
        let all = crate::StageParts {
            layers: (0..cfg.layers).collect(),
            embed: true,
            head: true,
        };
        Self::stage(cfg, tp, tp_rank, &all)
    }

    /// One pipeline stage's part of the model cut by `shard`: its tensor-parallel slices and
    /// its share of every mixture-of-experts block's experts.
    pub fn sharded(cfg: &ModelConfig, shard: Shard, parts: &crate::StageParts) -> Self {
        Llama {
            cfg: cfg.clone(),
            layout: ParamLayout::sharded(cfg, shard, parts),
            rope: RopeTable::scaled(
                cfg.seq_len,
                cfg.head_dim(),
                cfg.rope_theta,
                cfg.rope_scaling,
            ),
        }
    }

    /// First vocabulary row this rank holds (its rows are [`ModelConfig::vocab_rows`]).
    fn vocab_start(&self) -> usize {
        self.layout.tp_rank * self.cfg.vocab_rows(self.layout.tp)
    }

    /// Elements of this rank's vocabulary slice (embedding or head) holding real rows, the
    /// padding after them excluded.
    fn vocab_valid(&self) -> usize {
        let (tp, r) = (self.layout.tp, self.layout.tp_rank);
        self.cfg.vocab_valid_rows(tp, r) * self.cfg.hidden
    }

    /// Positions (within their sequence) of `t` flattened tokens of whole sequences.
    pub fn positions(&self, t: usize) -> Vec<usize> {
        (0..t).map(|i| i % self.cfg.seq_len).collect()
    }

    fn tied(&self) -> bool {
        self.layout.head.is_some() && self.layout.head == self.layout.embed
    }

    /// The embedding of `inputs` (this rank's tokens of the residual stream): each
    /// tensor-parallel rank looks up its vocabulary slice, and `f̄` / `ḡ` sums them.
    pub fn embed_forward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        inputs: &DeviceSlice<u32>,
    ) -> Result<Store, HookError> {
        ctx.span(
            "forward",
            || "forward embedding".into(),
            || self.embed_forward_inner(ctx, weights, inputs),
        )
    }

    fn embed_forward_inner(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        inputs: &DeviceSlice<u32>,
    ) -> Result<Store, HookError> {
        let (h, t, l) = (self.cfg.hidden, inputs.len(), ctx.device());
        let embed = self
            .layout
            .embed
            .expect("the embedding lives on this stage");
        weights.enter(Unit::Embed, Phase::Forward)?;
        let table = weights.view(l, self.layout.range(embed));
        let x = match ctx.tp() {
            None => {
                let mut x = ctx.act_out(t * h);
                ctx.backend.embedding_forward(&mut x, &table, inputs, h);
                x
            }
            Some(_) => {
                let mut partial = ctx.work(t * h);
                ctx.backend.embedding_forward_slice(
                    &mut partial,
                    &table,
                    inputs,
                    h,
                    self.vocab_start(),
                );
                let summed = tp::exit(ctx.tp(), l, partial)?;
                let mut x = ctx.act_buf(ctx.local_tokens(t) * h);
                ctx.backend.copy(&mut x, &summed);
                x
            }
        };
        drop(table);
        if !self.tied() {
            weights.leave(Unit::Embed, Phase::Forward)?;
        }
        Ok(ctx.keep(x))
    }

    /// Final norm, then (`g`) all tokens into the vocabulary-parallel LM head fused with the
    /// loss: returns the sum of token losses and, with `grads`, the gradient of the head's
    /// input (this rank's tokens). Its forward and backward run together: the loss gradient is
    /// known as soon as each chunk's logits are.
    pub fn head_step(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: Option<&mut dyn GradSink>,
        x: Store,
        loss: LossTargets<'_>,
    ) -> Result<(f64, Option<Buf<f32>>), HookError> {
        ctx.span(
            "forward",
            || "loss head (forward and backward)".into(),
            || self.head_step_inner(ctx, weights, grads, x, loss),
        )
    }

    /// Sum of the token losses of `xin` (every token's normed final hidden state) through the
    /// LM head `head`: on one rank, or over the tensor-parallel group's vocabulary slices.
    /// With `grads` = (dx, dW), adds the input and weight gradients.
    fn head_loss(
        &self,
        ctx: &StepCtx<'_>,
        (xin, head): (&DeviceSlice<f32>, &Weight<'_>),
        loss: LossTargets<'_>,
        grads: Option<(&mut DeviceSlice<f32>, &mut DeviceSlice<f32>)>,
    ) -> Result<f64, HookError> {
        let (h, l, targets) = (self.cfg.hidden, ctx.ledger, loss.targets);
        Ok(match ctx.tp() {
            None => {
                let g = grads.map(|(dx, dw)| XentGrads {
                    dx,
                    dw,
                    scale: loss.scale,
                });
                let (v, chunk) = (self.cfg.vocab, ctx.loss_chunk);
                let sh = HeadShape { h, v, chunk };
                ctx.backend
                    .lm_head_xent(l, xin, head.operand(), targets, sh, g)
            }
            Some(tp) => {
                // Padded vocabulary rows take no gradient: the head's products see the real
                // rows only.
                let valid = self.vocab_valid();
                let g = grads.map(|(dx, dw)| VpGrads {
                    dx,
                    dw: &mut dw[..valid],
                    scale: loss.scale,
                });
                let Weight::View(w) = head else {
                    unreachable!("a vocabulary-parallel head is read as an f32 view")
                };
                let head = VocabHead {
                    w,
                    hidden: h,
                    v0: self.vocab_start(),
                    chunk: ctx.loss_chunk,
                };
                tp.vocab_parallel_xent(ctx.device(), head, xin, targets, g)?
            }
        })
    }

    fn head_step_inner(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: Option<&mut dyn GradSink>,
        x: Store,
        loss: LossTargets<'_>,
    ) -> Result<(f64, Option<Buf<f32>>), HookError> {
        let (c, lay, l) = (&self.cfg, &self.layout, ctx.device());
        let (h, t) = (c.hidden, loss.targets.len());
        let tr = ctx.local_tokens(t);
        let (final_norm, head_param) = match (lay.final_norm, lay.head) {
            (Some(n), Some(w)) => (n, w),
            _ => unreachable!("the head lives on this stage"),
        };
        weights.enter(Unit::Head, Phase::Forward)?;
        let xf = x.view_all(l);
        let mut xnf = ctx.work_out(tr * h);
        let mut rstdf = ctx.stats(tr);
        let wf = weights.view(l, lay.range(final_norm));
        ctx.backend
            .rmsnorm_forward(&mut xnf, &mut rstdf, &xf, &wf, h, c.rms_eps as f32);
        let xnf_full = tp::enter(ctx.tp(), l, &xnf)?;
        let xin: &DeviceSlice<f32> = xnf_full.as_deref().unwrap_or(&xnf);
        // One rank's head goes to the fused head-and-loss kernel as the products read it; the
        // vocabulary-parallel head's pieces take an f32 view of its real rows (padded rows
        // never enter the softmax or the loss).
        let head = match ctx.tp() {
            None => product_weight(weights, l, lay.range(head_param)),
            Some(_) => {
                let start = lay.range(head_param).start;
                Weight::View(weights.view(l, start..start + self.vocab_valid()))
            }
        };
        let leave = |weights: &dyn WeightSource| -> Result<(), HookError> {
            weights.leave(Unit::Head, Phase::Forward)?;
            if self.tied() {
                weights.leave(Unit::Embed, Phase::Forward)?;
            }
            Ok(())
        };
        let Some(grads) = grads else {
            let total = self.head_loss(ctx, (xin, &head), loss, None)?;
            drop((head, wf, xnf_full));
            leave(weights)?;
            return Ok((total, None));
        };
        let mut dxn = ctx.work(t * h);
        let mut result = Ok(0.0);
        grads.accumulate(ctx.device(), lay.range(head_param), &mut |dw| {
            result = self.head_loss(ctx, (xin, &head), loss, Some((&mut dxn, dw)))
        });
        let total = result?;
        drop((head, xnf, xnf_full));
        // f / g backward: each rank holds a partial input gradient of the head.
        let dxn = tp::enter_backward(ctx.tp(), l, dxn)?;
        let mut dx = ctx.work_out(tr * h);
        let saved = NormSaved {
            x: &xf,
            rstd: &rstdf,
            w: &wf,
            h,
        };
        ctx.norm_grad(grads, lay.range(final_norm), &mut |dw| {
            ctx.backend
                .rmsnorm_backward(&mut dx, dw, &dxn, saved, false)
        })?;
        drop((dxn, xf, rstdf, wf));
        drop(x);
        leave(weights)?;
        grads.unit_done(Unit::Head)?;
        Ok((total, Some(dx)))
    }

    /// The embedding's backward (it reads no weights; `ḡ` backward gathers the tokens).
    pub fn embed_backward(
        &self,
        ctx: &StepCtx<'_>,
        grads: &mut dyn GradSink,
        inputs: &DeviceSlice<u32>,
        dx: Buf<f32>,
    ) -> Result<(), HookError> {
        ctx.span(
            "backward",
            || "backward embedding".into(),
            || self.embed_backward_inner(ctx, grads, inputs, dx),
        )
    }

    fn embed_backward_inner(
        &self,
        ctx: &StepCtx<'_>,
        grads: &mut dyn GradSink,
        inputs: &DeviceSlice<u32>,
        dx: Buf<f32>,
    ) -> Result<(), HookError> {
        let (h, l) = (self.cfg.hidden, ctx.device());
        let embed = self
            .layout
            .embed
            .expect("the embedding lives on this stage");
        let dx_full = tp::exit_backward(ctx.tp(), l, &dx)?;
        let dx_all: &DeviceSlice<f32> = dx_full.as_deref().unwrap_or(&dx);
        let v0 = self.vocab_start();
        grads.accumulate(
            ctx.device(),
            self.layout.range(embed),
            &mut |dw| match ctx.tp() {
                None => ctx.backend.embedding_backward(dw, dx_all, inputs, h),
                Some(_) => ctx
                    .backend
                    .embedding_backward_slice(dw, dx_all, inputs, h, v0),
            },
        );
        grads.unit_done(Unit::Embed)?;
        Ok(())
    }
}
