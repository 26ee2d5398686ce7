//! Mixture-of-experts blocks (Mixtral's `block_sparse_moe`): the router, `top_k` of `E`
//! SwiGLU experts per token, and the load-balancing loss — forward and backward, with the
//! experts spread over an expert-parallel group ([`crate::ep`]).
//!
//! The layer is **dropless**: no expert capacity, every (token, expert) assignment is
//! computed however unbalanced the routing is.
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

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use ferrotron_comm::{CommBuf, ReduceOp};
use ferrotron_config::ModelConfig;
use ferrotron_tensor::moe::{
    aux_loss, aux_loss_backward, aux_stats, combine_backward, combine_forward, gather_rows, route,
    route_backward, scatter_add_rows, AuxStats, Dispatch, Routing,
};
use ferrotron_tensor::{Buf, Store};

use crate::ep::{EpComm, Exchange};
use crate::llama::StepCtx;
use crate::tp;
use crate::{GradSink, HookError, Llama, Phase, Unit, WeightSource};

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
}

/// The mixture-of-experts part of a block's saved state: the activations (absent under full
/// recomputation) and the block's routing statistics, which the forward hands to [`MoeStep`].
#[derive(Default)]
pub struct MoeSaved {
    pub(crate) acts: Option<MoeActs>,
    pub(crate) stats: Option<AuxStats>,
}

/// Load-balancing statistics of one micro-batch: summed over the blocks seen so far, then
/// (after the last block's forward) over all blocks.
#[derive(Default)]
struct MicroAux {
    sum: Option<AuxStats>,
    total: Option<AuxStats>,
}

/// What one step's mixture-of-experts blocks measured on this rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeReport {
    /// Sum of `aux` over the micro-batches whose forward finished on this rank.
    pub aux_sum: f64,
    /// Assignments per expert of every mixture-of-experts block (global index) this rank
    /// computed, summed over micro-batches.
    pub counts: BTreeMap<usize, Vec<f64>>,
}

/// The mixture-of-experts state of one step: the expert-parallel group, the weight of the
/// load-balancing loss and the routing statistics of each micro-batch in flight (keyed by
/// [`StepCtx::micro_batch`]).
pub struct MoeStep<'a> {
    /// The expert-parallel group (None: this rank holds every expert).
    pub ep: Option<EpComm<'a>>,
    /// Weight of one micro-batch's `aux` in the training loss: `router_aux_loss_coef /
    /// (data-parallel ranks × micro-batches per step)`.
    pub aux_weight: f64,
    experts: usize,
    moe_layers: usize,
    micro: Mutex<HashMap<usize, MicroAux>>,
    report: Mutex<MoeReport>,
}

impl<'a> MoeStep<'a> {
    /// The state of a step of `cfg` (any model; inert for a dense one).
    pub fn new(cfg: &ModelConfig, ep: Option<EpComm<'a>>, aux_weight: f64) -> Self {
        MoeStep {
            ep,
            aux_weight,
            experts: cfg.experts,
            moe_layers: cfg.moe_layers(),
            micro: Mutex::new(HashMap::new()),
            report: Mutex::new(MoeReport::default()),
        }
    }

    fn with<R>(&self, mb: usize, f: impl FnOnce(&mut MicroAux) -> R) -> R {
        let mut map = self.micro.lock().expect("moe state lock");
        f(map.entry(mb).or_default())
    }

    /// Adds block `layer`'s statistics to micro-batch `mb`'s.
    pub(crate) fn add_layer(&self, mb: usize, layer: usize, stats: &AuxStats) {
        self.with(mb, |m| match &mut m.sum {
            Some(s) => s.add(stats),
            None => m.sum = Some(stats.clone()),
        });
        let mut r = self.report.lock().expect("moe report lock");
        let c = r
            .counts
            .entry(layer)
            .or_insert_with(|| vec![0.0; self.experts]);
        c.iter_mut().zip(&stats.counts).for_each(|(a, b)| *a += b);
    }

    /// Micro-batch `mb`'s statistics summed over the blocks (None for a dense model).
    fn take_sum(&self, mb: usize) -> Option<AuxStats> {
        if self.moe_layers == 0 {
            return None;
        }
        Some(
            self.with(mb, |m| m.sum.take())
                .unwrap_or_else(|| self.zeros()),
        )
    }

    /// Micro-batch `mb` (`tokens` tokens) has passed every block and its statistics over all
    /// of them and all its tokens are `total`: the backward uses them, and its `aux` is added
    /// to the report.
    fn set_total(&self, mb: usize, total: AuxStats, tokens: usize) {
        let aux = aux_loss(&total, self.moe_layers * tokens);
        self.with(mb, |m| m.total = Some(total));
        self.report.lock().expect("moe report lock").aux_sum += aux;
    }

    /// Micro-batch `mb` is done on this rank: forgets its statistics.
    pub fn end_micro_batch(&self, mb: usize) {
        self.micro.lock().expect("moe state lock").remove(&mb);
    }

    /// What this rank measured so far.
    pub fn report(&self) -> MoeReport {
        self.report.lock().expect("moe report lock").clone()
    }

    fn zeros(&self) -> AuxStats {
        AuxStats {
            counts: vec![0.0; self.experts],
            prob_sums: vec![0.0; self.experts],
        }
    }

    /// The all-block statistics of micro-batch `mb` (`tokens = L_moe·T` of them).
    fn total(&self, mb: usize, tokens: usize) -> AuxStats {
        let total = self.with(mb, |m| m.total.clone());
        total.unwrap_or_else(|| {
            panic!("micro-batch {mb} ({tokens} tokens): backward before its forward finished")
        })
    }

    /// Floats a pipeline message carries besides the activations or gradients: 0 for a dense
    /// model, else `3E` (counts, and the probability sums as f32 high and low parts).
    pub fn message_len(&self) -> usize {
        if self.moe_layers == 0 {
            0
        } else {
            3 * self.experts
        }
    }

    /// Writes micro-batch `mb`'s statistics into a message tail of [`MoeStep::message_len`]
    /// floats: the running sum after this stage's blocks (`total = false`, sent with the
    /// activations) or the total (`total = true`, sent back with the gradients).
    pub fn write_message(&self, mb: usize, total: bool, out: &mut [f32]) {
        if out.is_empty() {
            return;
        }
        let stats = self.with(mb, |m| {
            if total {
                m.total.clone()
            } else {
                m.sum.clone()
            }
        });
        encode(&stats.unwrap_or_else(|| self.zeros()), out);
    }

    /// Reads a message tail written by [`MoeStep::write_message`] on the neighbouring stage.
    pub fn read_message(&self, mb: usize, total: bool, msg: &[f32]) {
        if msg.is_empty() {
            return;
        }
        let stats = decode(msg);
        self.with(mb, |m| {
            if total {
                m.total = Some(stats);
            } else {
                m.sum = Some(stats);
            }
        });
    }
}

/// `stats` as `3E` floats: the counts (integers, exact in f32), and the probability sums as
/// f32 high and low parts (their sum keeps the f64 to about 2⁻⁴⁸).
fn encode(stats: &AuxStats, out: &mut [f32]) {
    let e = stats.counts.len();
    for i in 0..e {
        out[i] = stats.counts[i] as f32;
        let p = stats.prob_sums[i];
        out[e + i] = p as f32;
        out[2 * e + i] = (p - (p as f32) as f64) as f32;
    }
}

/// The inverse of [`encode`] (also of a sum of encodings).
fn decode(msg: &[f32]) -> AuxStats {
    let e = msg.len() / 3;
    AuxStats {
        counts: msg[..e].iter().map(|&c| c as f64).collect(),
        prob_sums: (0..e)
            .map(|i| msg[e + i] as f64 + msg[2 * e + i] as f64)
            .collect(),
    }
}

impl StepCtx<'_> {
    /// Micro-batch `mb` (`t` tokens on this rank) has passed every mixture-of-experts block:
    /// its routing statistics become the total its backward uses and its load-balancing loss
    /// is recorded (no-op for a dense model). Under context parallelism each rank routed its
    /// share of every sequence, so the statistics are summed over the ring first.
    pub fn finish_moe_forward(&self, mb: usize, t: usize) -> Result<(), HookError> {
        let Some(sum) = self.moe.take_sum(mb) else {
            return Ok(());
        };
        let Some(cp) = self.cp() else {
            self.moe.set_total(mb, sum, t);
            return Ok(());
        };
        let mut msg = vec![0.0f32; 3 * sum.counts.len()];
        encode(&sum, &mut msg);
        let reduced = cp
            .comm
            .all_reduce(
                cp.group,
                CommBuf::from_f32_slice(self.ledger, &msg),
                ReduceOp::Sum,
            )
            .wait_in(cp.trace, "context-parallel")?;
        self.moe
            .set_total(mb, decode(&reduced.to_f32_vec()), t * cp.size());
        Ok(())
    }
}

/// This rank's rows of a full-token tensor: all of them, or its contiguous piece under
/// sequence parallelism.
fn local_rows(ctx: &StepCtx<'_>, full: Buf<f32>, h: usize) -> Buf<f32> {
    match ctx.tp() {
        Some(tp) if tp.sequence_parallel => {
            let rows = full.len() / h / tp.group.size();
            let start = tp.group.index * rows * h;
            let mut out = ctx.work(rows * h);
            out.copy_from_slice(&full[start..start + rows * h]);
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
        xn: &[f32],
    ) -> Result<(Buf<f32>, MoeActs, AuxStats), HookError> {
        let c = &self.cfg;
        let (h, f, e, k) = (c.hidden, c.ffn, c.experts, c.top_k);
        let (be, l, lay) = (ctx.backend, ctx.ledger, &self.layout);
        let ep = ctx.moe.ep.as_ref();
        let gathered = tp::enter(ctx.tp(), l, xn)?;
        let x: &[f32] = gathered.as_deref().unwrap_or(xn);
        let t = x.len() / h;
        let mut logits = ctx.work(t * e);
        be.linear_forward(
            &mut logits,
            x,
            &weights.view(l, lay.range(mp.router)),
            t,
            h,
            e,
        );
        let routing = route(&logits, t, e, k);
        drop(logits);
        let stats = aux_stats(&routing, t, e, k);
        let dispatch = Dispatch::new(&routing, t, e, k);
        let mut xg = ctx.work(t * k * h);
        gather_rows(&mut xg, x, h, &dispatch);
        drop(gathered);
        let exchange = Exchange::plan(ep, l, dispatch.counts(), mp.local)?;
        let xe = exchange.dispatch(ep, l, &xg, h)?;
        drop(xg);
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
            let w = |p: usize| weights.view(l, lay.range(p));
            be.linear_forward(
                &mut gate[fr.clone()],
                &xe[xr.clone()],
                &w(mp.w1(i)),
                rows,
                h,
                f,
            );
            be.linear_forward(
                &mut up[fr.clone()],
                &xe[xr.clone()],
                &w(mp.w3(i)),
                rows,
                h,
                f,
            );
            let mut act = ctx.work(rows * f);
            be.swiglu_forward(&mut act, &gate[fr.clone()], &up[fr]);
            be.linear_forward(&mut ye[xr], &act, &w(mp.w2(i)), rows, f, h);
        }
        weights.leave(Unit::Experts(mp.layer), Phase::Forward)?;
        let y = exchange.combine(ep, l, &ye, h)?;
        drop(ye);
        let mut out = ctx.work(t * h);
        combine_forward(&mut out, &y, h, &routing, &dispatch);
        let acts = MoeActs {
            routing,
            dispatch,
            exchange,
            xe: ctx.keep(xe),
            gate: ctx.keep(gate),
            up: ctx.keep(up),
            y: ctx.keep(y),
        };
        Ok((local_rows(ctx, out, h), acts, stats))
    }

    /// Backward of [`Llama::moe_forward`]: from `dy` (the gradient of its output, this
    /// rank's rows) and its normed input `xn`, accumulates the router's and the held
    /// experts' gradients and returns the gradient of `xn` (this rank's rows).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_backward(
        &self,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: &mut dyn GradSink,
        mp: &MoeParams,
        a: MoeActs,
        xn: &[f32],
        dy: &[f32],
    ) -> Result<Buf<f32>, HookError> {
        let c = &self.cfg;
        let (h, f, e, k) = (c.hidden, c.ffn, c.experts, c.top_k);
        let (be, l, lay) = (ctx.backend, ctx.ledger, &self.layout);
        let ep = ctx.moe.ep.as_ref();
        let dy_full = tp::exit_backward(ctx.tp(), l, dy)?;
        let d_out: &[f32] = dy_full.as_deref().unwrap_or(dy);
        let t = d_out.len() / h;
        let mut dyg = ctx.work(t * k * h);
        let mut dgates = ctx.work(t * k);
        {
            let y = a.y.view_all(l);
            combine_backward(&mut dyg, &mut dgates, d_out, &y, h, &a.routing, &a.dispatch);
        }
        drop((dy_full, a.y));
        let dye = a.exchange.dispatch(ep, l, &dyg, h)?;
        drop(dyg);
        let n = a.exchange.received();
        let mut dxe = ctx.work(n * h);
        {
            let (xe, gate, up) = (a.xe.view_all(l), a.gate.view_all(l), a.up.view_all(l));
            weights.enter(Unit::Experts(mp.layer), Phase::Backward)?;
            let mut start = 0;
            for (i, rows) in a.exchange.expert_rows().into_iter().enumerate() {
                let (xr, fr) = (start * h..(start + rows) * h, start * f..(start + rows) * f);
                start += rows;
                if rows == 0 {
                    continue;
                }
                let w = |p: usize| weights.view(l, lay.range(p));
                let (g, u, x, d) = (
                    &gate[fr.clone()],
                    &up[fr],
                    &xe[xr.clone()],
                    &dye[xr.clone()],
                );
                let mut act = ctx.work(rows * f);
                be.swiglu_forward(&mut act, g, u);
                grads.accumulate(lay.range(mp.w2(i)), &mut |dw| {
                    be.linear_backward_weight(dw, d, &act, rows, f, h)
                });
                drop(act);
                let mut dact = ctx.work(rows * f);
                be.linear_backward_input(&mut dact, d, &w(mp.w2(i)), rows, f, h, false);
                let (mut dg, mut du) = (ctx.work(rows * f), ctx.work(rows * f));
                be.swiglu_backward(&mut dg, &mut du, &dact, g, u);
                drop(dact);
                grads.accumulate(lay.range(mp.w1(i)), &mut |dw| {
                    be.linear_backward_weight(dw, &dg, x, rows, h, f)
                });
                grads.accumulate(lay.range(mp.w3(i)), &mut |dw| {
                    be.linear_backward_weight(dw, &du, x, rows, h, f)
                });
                be.linear_backward_input(
                    &mut dxe[xr.clone()],
                    &dg,
                    &w(mp.w1(i)),
                    rows,
                    h,
                    f,
                    false,
                );
                be.linear_backward_input(&mut dxe[xr], &du, &w(mp.w3(i)), rows, h, f, true);
            }
            weights.leave(Unit::Experts(mp.layer), Phase::Backward)?;
        }
        drop((dye, a.xe, a.gate, a.up));
        let dxg = a.exchange.combine(ep, l, &dxe, h)?;
        drop(dxe);
        let mut dx = ctx.work(t * h);
        scatter_add_rows(&mut dx, &dxg, h, &a.dispatch);
        drop(dxg);
        // Router: the gate weights' gradient plus the load-balancing loss's.
        let mut dlogits = ctx.work(t * e);
        route_backward(&mut dlogits, &dgates, &a.routing, t, e, k);
        let mb = ctx.micro_batch.load(Ordering::Relaxed);
        // The statistics are those of the whole micro-batch, every context-parallel share.
        let tokens = ctx.moe.moe_layers * t * ctx.cp().map_or(1, |cp| cp.size());
        let total = ctx.moe.total(mb, tokens);
        aux_loss_backward(
            &mut dlogits,
            ctx.moe.aux_weight,
            &total,
            tokens,
            &a.routing,
            t,
            e,
        );
        let gathered = tp::enter(ctx.tp(), l, xn)?;
        let x: &[f32] = gathered.as_deref().unwrap_or(xn);
        grads.accumulate(lay.range(mp.router), &mut |dw| {
            be.linear_backward_weight(dw, &dlogits, x, t, h, e)
        });
        drop(gathered);
        let wr = weights.view(l, lay.range(mp.router));
        be.linear_backward_input(&mut dx, &dlogits, &wr, t, h, e, true);
        Ok(local_rows(ctx, dx, h))
    }
}
