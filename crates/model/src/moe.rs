//! Mixture-of-experts blocks (Mixtral's `block_sparse_moe`): the router, `top_k` of `E`
//! SwiGLU experts per token, and the load-balancing loss — forward and backward, with the
//! experts spread over an expert-parallel group ([`Exchange`] over the
//! [`crate::ExpertParallel`] strategy).
//!
//! The layer is **dropless** by default: every (token, expert) assignment is computed however
//! unbalanced the routing is. With `model.moe_capacity_factor`, each expert takes at most
//! [`ferrotron_config::ModelConfig::expert_capacity`] of the micro-batch's assignments (the
//! most probable) and drops the rest: a dropped slot adds nothing to its token, which keeps
//! its residual and its other slots. The capacity counts the micro-batch's tokens as this
//! rank routes them (all of them under tensor parallelism, its own under expert
//! parallelism), so every layout drops what the single rank drops.
//!
//! Tensor parallelism: the router and the experts are replicated over the tensor-parallel
//! group and every member computes the block on the micro-batch's full token set (gathered
//! first under sequence parallelism, whose members then keep their own rows of the output and
//! of the input gradient). The members' results are identical, so the weight gradients need
//! no tensor-parallel reduction and the routing statistics are those of the whole micro-batch.
//!
//! Load-balancing loss. For every micro-batch of `b` sequences (`T = b·s` tokens) on every
//! data-parallel rank, `aux` is Hugging Face's `load_balancing_loss_func` over the router
//! logits of all mixture-of-experts blocks concatenated: the [`AuxStats`] of every block
//! summed, with `L_moe·T` tokens. The training loss is the mean token cross-entropy plus
//! `router_aux_loss_coef ×` the mean of `aux` over all (data-parallel rank, micro-batch)
//! pairs, which is the same for every layout of the same global batch. Its gradient needs
//! the statistics of all blocks (the counts), known once the micro-batch's forward has passed
//! the last block: [`MoeStep`] collects them per micro-batch (and the pipeline carries them
//! between stages with the activations and gradients, see [`MoeStep::write_message`]).

use std::sync::atomic::Ordering;

use ferrotron_tensor::moe::{AuxStats, Dispatch, Routing};
use ferrotron_tensor::{
    AuxLoss, Buf, Category, DeviceSlice, Held, LinearShape, RouteShape, Routed, Store,
};

use crate::access::product_weight;
use crate::ctx::{BlockCall, StepCtx};
use crate::layout::MoeParams;
use crate::tp;
use crate::{GradSink, HookError, Llama, Mlp, Phase, Unit, WeightSource};

mod exchange;
pub(crate) mod step;

pub use exchange::Exchange;
pub use step::{MoeReport, MoeStep};

/// What a mixture-of-experts block keeps for its backward (opaque outside the model).
pub struct MoeActs {
    routing: Routing,
    dispatch: Dispatch,
    exchange: Exchange,
    /// Rows this rank's experts processed, expert-major, `[n, h]`.
    xe: Store,
    /// The experts' gate and up projections of them, `[n, h_ff]`.
    gate: Store,
    up: Store,
    /// The experts' outputs back on this rank, in grouped order, `[t·k, h]`.
    y: Store,
    /// The routing, dispatch and exchange tables above, counted as activations.
    _tables: Held,
}

/// The mixture-of-experts part of a block's saved state: the activations (absent under full
/// recomputation) and the block's routing statistics, which the forward hands to [`MoeStep`].
#[derive(Default)]
pub struct MoeSaved {
    pub(crate) acts: Option<MoeActs>,
    pub(crate) stats: Option<AuxStats>,
    /// Assignments the block dropped over capacity.
    pub(crate) dropped: usize,
}

/// This rank's rows of a full-token tensor: all of them, or its contiguous piece under
/// sequence parallelism.
fn local_rows(ctx: &StepCtx<'_>, full: Buf<f32>, h: usize) -> Buf<f32> {
    match ctx.tp() {
        Some(tp) if tp.sequence_parallel() => {
            let rows = full.len() / h / tp.size();
            let start = tp.index() * rows * h;
            let mut out = ctx.work(rows * h);
            ctx.backend.copy(&mut out, &full[start..start + rows * h]);
            out
        }
        _ => full,
    }
}

impl Llama {
    /// The mixture-of-experts half of a block on the normed input `xn` (this rank's rows):
    /// returns the block output to add to the residual (this rank's rows), what backward
    /// needs and the routing statistics of the micro-batch's tokens.
    pub(crate) fn moe_forward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        mp: &MoeParams,
        xn: &DeviceSlice<f32>,
    ) -> Result<(Buf<f32>, MoeActs, MoeSaved), HookError> {
        let c = &self.cfg;
        let (h, e, k) = (c.hidden, c.experts, c.top_k);
        let (be, l, lay) = (ctx.backend, ctx.device(), &self.layout);
        let ep = ctx.moe.ep;
        let gathered = tp::enter(ctx.tp(), l, xn)?;
        let x: &DeviceSlice<f32> = gathered.as_deref().unwrap_or(xn);
        let t = x.len() / h;
        let mut logits = ctx.work(t * e);
        let router = product_weight(weights, l, lay.range(mp.router));
        let to_e = LinearShape::new(t, h, e);
        be.linear_forward(&mut logits, x.operand(), router.operand(), to_e);
        drop(router);
        let routes = RouteShape {
            t,
            experts: e,
            top_k: k,
        };
        let routing = be.moe_route(ctx.ledger, &logits, ctx.moe.bias(mp.layer), routes);
        drop(logits);
        let stats = be.moe_aux_stats(&routing, routes);
        let dispatch = Dispatch::with_capacity(&routing, (t, e, k), c.expert_capacity(t));
        let mut xg = ctx.work(dispatch.len() * h);
        be.moe_gather_rows(&mut xg, x, h, &dispatch);
        drop(gathered);
        let exchange = Exchange::plan(ep, l, dispatch.counts(), mp.local)?;
        let xe = exchange.dispatch(ep, l, xg, h)?;
        let [gate, up, ye] = self.experts_forward(ctx, weights, mp, &exchange, &xe)?;
        let y = exchange.combine(ep, l, ye, h)?;
        let mut out = ctx.work(t * h);
        let routed = Routed {
            routing: &routing,
            dispatch: &dispatch,
        };
        be.moe_combine_forward(&mut out, &y, h, routed);
        let table_bytes = routing.heap_bytes() + dispatch.heap_bytes() + exchange.heap_bytes();
        // The routing and dispatch tables, built on the host, are the MoE kernels' arguments
        // here and in the backward.
        let args = routing.heap_bytes() + dispatch.heap_bytes();
        ctx.ledger.count_to_device(crate::ROUTING, args);
        let counted = MoeSaved {
            acts: None,
            stats: Some(stats),
            dropped: dispatch.dropped(),
        };
        let acts = MoeActs {
            _tables: ctx.ledger.hold(Category::Activations, table_bytes),
            routing,
            dispatch,
            exchange,
            xe: ctx.keep(xe),
            gate: ctx.keep(gate),
            up: ctx.keep(up),
            y: ctx.keep(y),
        };
        Ok((local_rows(ctx, out, h), acts, counted))
    }

    /// Each held expert's SwiGLU MLP on its rows `xe` (expert-major): returns the gate and
    /// up projections (kept for the backward) and the experts' outputs.
    fn experts_forward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        mp: &MoeParams,
        exchange: &Exchange,
        xe: &DeviceSlice<f32>,
    ) -> Result<[Buf<f32>; 3], HookError> {
        let (h, f) = (self.cfg.hidden, self.cfg.ffn);
        let (be, l, lay) = (ctx.backend, ctx.device(), &self.layout);
        let n = exchange.received();
        let (mut gate, mut up, mut ye) = (ctx.act_buf(n * f), ctx.act_buf(n * f), ctx.work(n * h));
        weights.enter(Unit::Experts(mp.layer), Phase::Forward)?;
        let mut start = 0;
        for (i, rows) in exchange.expert_rows().into_iter().enumerate() {
            let (xr, fr) = (start * h..(start + rows) * h, start * f..(start + rows) * f);
            start += rows;
            if rows == 0 {
                continue;
            }
            let w = |p: usize| product_weight(weights, l, lay.range(p));
            let (to_f, to_h) = (LinearShape::new(rows, h, f), LinearShape::new(rows, f, h));
            let x = &xe[xr.clone()];
            let (x, w1, w3) = (x.operand(), w(mp.w1(i)), w(mp.w3(i)));
            be.linear_forward(&mut gate[fr.clone()], x, w1.operand(), to_f);
            be.linear_forward(&mut up[fr.clone()], x, w3.operand(), to_f);
            let mut act = ctx.work(rows * f);
            be.swiglu_forward(&mut act, &gate[fr.clone()], &up[fr]);
            be.linear_forward(&mut ye[xr], act.operand(), w(mp.w2(i)).operand(), to_h);
        }
        weights.leave(Unit::Experts(mp.layer), Phase::Forward)?;
        Ok([gate, up, ye])
    }

    /// Backward of [`Llama::moe_forward`] for the block of `call`: from `dy` (the gradient of
    /// its output, this rank's rows) and its normed input `xn`, accumulates the router's and
    /// the held experts' gradients and returns the gradient of `xn` (this rank's rows).
    pub(crate) fn moe_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut dyn GradSink,
        a: MoeActs,
        (xn, dy): (&DeviceSlice<f32>, &DeviceSlice<f32>),
    ) -> Result<Buf<f32>, HookError> {
        let Mlp::Moe(mp) = call.lp.mlp else {
            unreachable!("called for mixture-of-experts blocks")
        };
        let (ctx, c) = (call.ctx, &self.cfg);
        let (h, k) = (c.hidden, c.top_k);
        let (l, ep) = (ctx.device(), ctx.moe.ep);
        let dy_full = tp::exit_backward(ctx.tp(), l, dy)?;
        let d_out: &DeviceSlice<f32> = dy_full.as_deref().unwrap_or(dy);
        let t = d_out.len() / h;
        let mut dyg = ctx.work(a.dispatch.len() * h);
        let mut dgates = ctx.work(t * k);
        {
            let y = a.y.view_all(l);
            let be = ctx.backend;
            let routed = Routed {
                routing: &a.routing,
                dispatch: &a.dispatch,
            };
            be.moe_combine_backward(&mut dyg, &mut dgates, d_out, &y, h, routed);
        }
        drop((dy_full, a.y));
        let dye = a.exchange.dispatch(ep, l, dyg, h)?;
        let dxe =
            self.experts_backward(call, grads, &mp, (&a.exchange, &a.xe, &a.gate, &a.up), &dye)?;
        drop((dye, a.xe, a.gate, a.up));
        let dxg = a.exchange.combine(ep, l, dxe, h)?;
        let mut dx = ctx.work(t * h);
        ctx.backend
            .moe_scatter_add_rows(&mut dx, &dxg, h, &a.dispatch);
        drop(dxg);
        self.router_backward(call, grads, &mp, (&a.routing, &dgates), xn, &mut dx)?;
        Ok(local_rows(ctx, dx, h))
    }

    /// Each held expert's backward on its rows: its `w1`, `w2`, `w3` gradients, and the
    /// gradient of its input rows (returned, expert-major like `xe`).
    fn experts_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut dyn GradSink,
        mp: &MoeParams,
        (exchange, xe, gate, up): (&Exchange, &Store, &Store, &Store),
        dye: &DeviceSlice<f32>,
    ) -> Result<Buf<f32>, HookError> {
        let (ctx, weights) = (call.ctx, call.weights);
        let (h, f) = (self.cfg.hidden, self.cfg.ffn);
        let (be, l, lay) = (ctx.backend, ctx.device(), &self.layout);
        let mut dxe = ctx.work(exchange.received() * h);
        let (xe, gate, up) = (xe.view_all(l), gate.view_all(l), up.view_all(l));
        weights.enter(Unit::Experts(mp.layer), Phase::Backward)?;
        let mut start = 0;
        for (i, rows) in exchange.expert_rows().into_iter().enumerate() {
            let (xr, fr) = (start * h..(start + rows) * h, start * f..(start + rows) * f);
            start += rows;
            if rows == 0 {
                continue;
            }
            let w = |p: usize| product_weight(weights, l, lay.range(p));
            let (to_f, to_h) = (LinearShape::new(rows, h, f), LinearShape::new(rows, f, h));
            let (g, u, x, d) = (
                &gate[fr.clone()],
                &up[fr],
                &xe[xr.clone()],
                &dye[xr.clone()],
            );
            let mut act = ctx.work(rows * f);
            be.swiglu_forward(&mut act, g, u);
            grads.accumulate(ctx.device(), lay.range(mp.w2(i)), &mut |dw| {
                be.linear_backward_weight(dw, d.operand(), act.operand(), to_h)
            });
            drop(act);
            let mut dact = ctx.work(rows * f);
            be.linear_backward_input(&mut dact, d.operand(), w(mp.w2(i)).operand(), to_h, false);
            let (mut dg, mut du) = (ctx.work(rows * f), ctx.work(rows * f));
            be.swiglu_backward(&mut dg, &mut du, &dact, g, u);
            drop(dact);
            grads.accumulate(ctx.device(), lay.range(mp.w1(i)), &mut |dw| {
                be.linear_backward_weight(dw, dg.operand(), x.operand(), to_f)
            });
            grads.accumulate(ctx.device(), lay.range(mp.w3(i)), &mut |dw| {
                be.linear_backward_weight(dw, du.operand(), x.operand(), to_f)
            });
            let dx = &mut dxe[xr];
            be.linear_backward_input(dx, dg.operand(), w(mp.w1(i)).operand(), to_f, false);
            be.linear_backward_input(dx, du.operand(), w(mp.w3(i)).operand(), to_f, true);
        }
        weights.leave(Unit::Experts(mp.layer), Phase::Backward)?;
        Ok(dxe)
    }

    /// The router's backward: the gate weights' gradient plus the load-balancing loss's,
    /// into the router's weight gradient and (added) into `dx`.
    fn router_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: &mut dyn GradSink,
        mp: &MoeParams,
        (routing, dgates): (&Routing, &DeviceSlice<f32>),
        xn: &DeviceSlice<f32>,
        dx: &mut DeviceSlice<f32>,
    ) -> Result<(), HookError> {
        let ctx = call.ctx;
        let (h, e, k) = (self.cfg.hidden, self.cfg.experts, self.cfg.top_k);
        let (be, l, lay) = (ctx.backend, ctx.device(), &self.layout);
        let t = dx.len() / h;
        let mut dlogits = ctx.work(t * e);
        let routes = RouteShape {
            t,
            experts: e,
            top_k: k,
        };
        be.moe_route_backward(&mut dlogits, dgates, routing, routes);
        let mb = ctx.micro_batch.load(Ordering::Relaxed);
        // The statistics are those of the whole micro-batch, every context-parallel share.
        let tokens = ctx.moe.moe_layers * t * ctx.cp().map_or(1, |cp| cp.size());
        let total = ctx.moe.total(mb, tokens);
        let aux = ctx.moe.aux_weight;
        let aux = AuxLoss {
            coef: aux,
            stats: &total,
            tokens,
        };
        be.moe_aux_loss_backward(&mut dlogits, aux, routing, routes);
        let gathered = tp::enter(ctx.tp(), l, xn)?;
        let x: &DeviceSlice<f32> = gathered.as_deref().unwrap_or(xn);
        grads.accumulate(ctx.device(), lay.range(mp.router), &mut |dw| {
            be.linear_backward_weight(
                dw,
                dlogits.operand(),
                x.operand(),
                LinearShape::new(t, h, e),
            )
        });
        drop(gathered);
        let wr = call.weights.view(l, lay.range(mp.router));
        be.linear_backward_input(
            dx,
            dlogits.operand(),
            wr.operand(),
            LinearShape::new(t, h, e),
            true,
        );
        Ok(())
    }
}
