//! The passes over the model on one rank: a micro-batch's whole forward and backward, and
//! the forward and backward of a run of blocks (what a pipeline stage's chunk runs).

use std::sync::atomic::Ordering;

use ferrotron_tensor::{Buf, DeviceSlice, Store};

use crate::attention::token_positions;
use crate::block::{DeferredGrad, WeightGrads};
use crate::ctx::{BlockCall, StepCtx};
use crate::documents::TokenPlaces;
use crate::layout::Mlp;
use crate::llama::{Llama, LossTargets};
use crate::recompute::BlockActs;
use crate::{GradSink, HookError, Phase, Unit, WeightSource};

/// Blocks whose backward runs together: their local indices, what their forward saved, and
/// the micro-batch's tokens on this rank.
pub struct BlockRun {
    /// Indices into this layout's blocks.
    pub local: std::ops::Range<usize>,
    /// What each block's forward saved, in forward order.
    pub saved: Vec<BlockActs>,
    /// Tokens of the micro-batch on this rank.
    pub t: usize,
}

impl Llama {
    /// Runs forward over `batch` sequences (`inputs`, `targets`: `[batch·seq_len]`, the same
    /// on every tensor-parallel rank; `[batch·seq_len/cp]`, this rank's zig-zag positions of
    /// each sequence, under context parallelism) and returns the **sum** of token losses. With `grads`,
    /// runs backward too and adds the gradient of `loss_scale × sum` into `grads`. Units are
    /// entered and left on `weights` around their use and reported done to `grads` once their
    /// gradients are final. The layout must hold the whole model (one pipeline stage).
    ///
    /// With mixture-of-experts blocks, the gradient also includes `ctx.moe.aux_weight ×` this
    /// micro-batch's load-balancing loss, whose value goes to `ctx.moe`'s report; the returned
    /// sum is the cross-entropy alone.
    pub fn forward_backward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: Option<&mut dyn GradSink>,
        inputs: &DeviceSlice<u32>,
        targets: &DeviceSlice<u32>,
        loss_scale: f32,
    ) -> Result<f64, HookError> {
        let loss = LossTargets {
            targets,
            scale: loss_scale,
        };
        let keep = grads.is_some();
        let all = 0..self.layout.layers.len();
        let x = self.embed_forward(ctx, weights, inputs)?;
        let (x, saved) = self.blocks_forward(ctx, weights, all.clone(), x, inputs.len(), keep)?;
        let mb = ctx.micro_batch.load(Ordering::Relaxed);
        ctx.finish_moe_forward(mb, inputs.len())?;
        let Some(grads) = grads else {
            ctx.end_micro_batch(mb);
            return Ok(self.head_step(ctx, weights, None, x, loss)?.0);
        };
        let (loss, dx) = self.head_step(ctx, weights, Some(&mut *grads), x, loss)?;
        let dx = dx.expect("the head returns its input gradient when given a sink");
        let blocks = BlockRun {
            local: all,
            saved,
            t: inputs.len(),
        };
        let dx = self.blocks_backward(ctx, weights, grads, blocks, dx, None)?;
        self.embed_backward(ctx, grads, inputs, dx)?;
        ctx.end_micro_batch(mb);
        Ok(loss)
    }

    /// Forward of the blocks `local` (indices into this layout's blocks) over `t` tokens;
    /// returns the output and, when `keep`, what each block's backward needs. Mixture-of-
    /// experts blocks add their routing statistics to `ctx.moe` for the current micro-batch.
    pub fn blocks_forward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        local: std::ops::Range<usize>,
        mut x: Store,
        t: usize,
        keep: bool,
    ) -> Result<(Store, Vec<BlockActs>), HookError> {
        let places = self.places(ctx, t);
        let batch = t / ctx.local_seq(self.cfg.seq_len);
        let mut saved = Vec::with_capacity(local.len());
        for i in local {
            let unit = Unit::Block(self.layout.layer_ids[i]);
            weights.enter(unit, Phase::Forward)?;
            let (out, mut acts) = ctx.span(
                "forward",
                || format!("forward block {}", self.layout.layer_ids[i]),
                || {
                    let call = self.block_call((ctx, weights), i, &places, batch);
                    self.block_forward(&call, x, ctx.recompute)
                },
            )?;
            weights.leave(unit, Phase::Forward)?;
            x = out;
            if let Some((stats, dropped)) = acts.take_moe_stats() {
                let (mb, layer) = (
                    ctx.micro_batch.load(Ordering::Relaxed),
                    self.layout.layer_ids[i],
                );
                ctx.moe.add_layer(mb, layer, &stats);
                ctx.moe.add_dropped(layer, dropped);
            }
            if keep {
                saved.push(acts);
            }
        }
        Ok((x, saved))
    }

    /// Backward of the blocks `blocks.local` (in reverse), from the gradient of their output;
    /// returns the gradient of their input. With `defer`, the linear layers' weight gradients
    /// are not computed but queued (zero-bubble's input half); the blocks are still reported
    /// done.
    pub fn blocks_backward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: &mut dyn GradSink,
        blocks: BlockRun,
        mut dx: Buf<f32>,
        mut defer: Option<&mut Vec<DeferredGrad>>,
    ) -> Result<Buf<f32>, HookError> {
        let BlockRun { local, saved, t } = blocks;
        let places = self.places(ctx, t);
        let batch = t / ctx.local_seq(self.cfg.seq_len);
        for (i, acts) in local.zip(saved).rev() {
            let unit = Unit::Block(self.layout.layer_ids[i]);
            weights.enter(unit, Phase::Backward)?;
            let mut wg = WeightGrads {
                sink: &mut *grads,
                defer: defer.as_deref_mut(),
            };
            dx = ctx.span(
                "backward",
                || format!("backward block {}", self.layout.layer_ids[i]),
                || {
                    let call = self.block_call((ctx, weights), i, &places, batch);
                    self.block_backward(&call, &mut wg, acts, dx)
                },
            )?;
            weights.leave(unit, Phase::Backward)?;
            if let Mlp::Moe(mp) = self.layout.layers[i].mlp {
                grads.unit_done(Unit::Experts(mp.layer))?;
            }
            grads.unit_done(unit)?;
        }
        Ok(dx)
    }

    /// Where this rank's `t` tokens of the current micro-batch sit: RoPE and the causal mask
    /// use each token's global position, and document masking each token's document.
    fn places(&self, ctx: &StepCtx<'_>, t: usize) -> TokenPlaces {
        let global = token_positions(ctx.cp(), self.cfg.seq_len, t);
        TokenPlaces::new(global, ctx.document_starts(), self.cfg.seq_len)
    }

    /// How local block `i` is called in this pass.
    fn block_call<'c, 'a>(
        &'c self,
        (ctx, weights): (&'c StepCtx<'a>, &'c dyn WeightSource),
        i: usize,
        places: &'c TokenPlaces,
        batch: usize,
    ) -> BlockCall<'c, 'a> {
        BlockCall {
            ctx,
            weights,
            lp: &self.layout.layers[i],
            positions: &places.rope,
            starts: places.starts.as_deref(),
            window_starts: places.window_starts.as_deref().map(|s| &s[..]),
            batch,
        }
    }
}
