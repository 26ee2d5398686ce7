//! Pipeline parallelism: which blocks a stage holds, and the executor that walks a rank's
//! list of actions from `ferrotron-schedule` — forwards and backwards of (micro-batch, chunk)
//! pairs, with activations and gradients sent to and received from the neighbouring stages.
//!
//! Virtual stage `vs = chunk·p + rank` holds the blocks `pp_layers[vs]` (an even split by
//! default); stage 0 also holds the embedding, stage `p·v − 1` the final norm and LM head.
//! Per micro-batch a rank keeps exactly what its chunks' backward needs, from the chunk's
//! forward until its backward, and sends activations and gradients as soon as they exist
//! (sends are buffered; receives are posted where the schedule places them and waited on by
//! the computation that needs them). Gradients accumulate over the step's micro-batches;
//! the data-parallel reduction starts after the rank's last backward.
//!
//! Zero bubble: `BackwardInput` computes a chunk's input gradient (on the critical path to
//! the previous stage) and queues its linear layers' weight gradients with their inputs;
//! `BackwardWeight` computes them later, in the schedule's bubbles. The LM head's weight
//! gradient is computed with the loss, in the forward, as in every schedule. (Experts' and
//! routers' weight gradients are not deferred.)
//!
//! Mixture-of-experts models: the load-balancing loss of a micro-batch needs the routing
//! statistics of every block, which live on every stage. Each activation message carries the
//! statistics summed over the blocks so far after the activations; the last stage completes
//! them, and each gradient message carries the total back after the gradients
//! ([`ferrotron_model::MoeStep::write_message`]).

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use ferrotron_comm::{CommBuf, DType as CommDType, Handle};
use ferrotron_config::Config;
use ferrotron_model::{
    BlockActs, DeferredGrad, GradSink, Llama, StageParts, StepCtx, WeightSource,
};
use ferrotron_schedule::{schedule, Action, Flow, Schedule};
use ferrotron_tensor::trace::{traced, Track};
use ferrotron_tensor::{Buf, Category, Ledger, Store};

use crate::mesh::GroupComm;
use crate::ParallelError;

/// What pipeline rank `rank` of `config`'s layout holds (the split of
/// [`ferrotron_schedule::stage_sizes`]).
pub fn stage_parts(config: &Config, rank: usize) -> StageParts {
    StageParts {
        layers: config.rank_chunks(rank).into_iter().flatten().collect(),
        embed: rank == 0,
        head: rank == config.parallel.pp - 1,
    }
}

/// Local block ranges (indices into the stage layout's blocks) of each chunk of `rank`.
pub fn chunk_ranges(config: &Config, rank: usize) -> Vec<Range<usize>> {
    let mut start = 0;
    config
        .rank_chunks(rank)
        .into_iter()
        .map(|chunk| {
            start += chunk.len();
            start - chunk.len()..start
        })
        .collect()
}

/// A pipeline rank: its schedule, chunks and pipeline group.
pub struct Pipeline {
    /// The whole schedule (every rank's actions).
    pub schedule: Schedule,
    /// This rank's index in the pipeline group.
    pub rank: usize,
    /// Stages.
    pub p: usize,
    /// Virtual stages per rank.
    pub v: usize,
    chunks: Vec<Range<usize>>,
    /// The pipeline group (None with one stage).
    pub group: Option<GroupComm>,
}

/// Time one rank spent on a step's pipeline.
#[derive(Debug, Clone, Copy, Default)]
pub struct PipelineTiming {
    /// Blocked waiting for activations or gradients from a neighbour (the bubble as this
    /// rank sees it).
    pub waiting: Duration,
    /// Everything else inside the schedule (compute, posting messages).
    pub working: Duration,
}

impl Pipeline {
    /// The pipeline of `config` for rank `rank` of `group` (one stage when `group` is None).
    pub fn new(
        config: &Config,
        rank: usize,
        group: Option<GroupComm>,
    ) -> Result<Self, ParallelError> {
        let (p, v, m) = (
            config.parallel.pp,
            config.parallel.virtual_stages,
            config.train.grad_accum,
        );
        let schedule = schedule(config.parallel.pp_schedule, p, m, v)
            .map_err(|e| ParallelError::Layout(e.to_string()))?;
        Ok(Pipeline {
            schedule,
            rank,
            p,
            v,
            chunks: chunk_ranges(config, rank),
            group: group.filter(|g| g.group.size() > 1),
        })
    }

    fn virtual_stage(&self, chunk: usize) -> usize {
        chunk * self.p + self.rank
    }

    fn tag(&self, action: &Action, mb: usize) -> u64 {
        let (flow, edge) = action
            .edge(self.rank, self.p)
            .expect("a message crosses a stage boundary");
        let flow = match flow {
            Flow::Activation => 0,
            Flow::Grad => 1,
        };
        ((mb * self.p * self.v + edge) * 2 + flow) as u64
    }

    /// Runs this rank's actions for one step. `batch(mb)` gives a micro-batch's (inputs,
    /// targets); `t` tokens per micro-batch, `rows` of them in this rank's residual stream.
    /// Returns the sum of the token losses this rank computed (non-zero on the last stage).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        model: &Llama,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: &mut dyn GradSink,
        batch: &dyn Fn(usize) -> (Vec<u32>, Vec<u32>),
        rows: usize,
        loss_scale: f32,
    ) -> Result<(f64, PipelineTiming), ParallelError> {
        let ledger: &Ledger = ctx.ledger;
        let h = model.cfg.hidden;
        let last = self.p * self.v - 1;
        let mut timing = PipelineTiming::default();
        let start = Instant::now();
        let mut batches: HashMap<usize, (Vec<u32>, Vec<u32>)> = HashMap::new();
        let mut recvs: HashMap<(Flow, usize, usize), Handle<CommBuf>> = HashMap::new();
        let mut outputs: HashMap<(usize, usize), Buf<f32>> = HashMap::new();
        let mut saved: HashMap<(usize, usize), Vec<BlockActs>> = HashMap::new();
        let mut head_grads: HashMap<usize, Buf<f32>> = HashMap::new();
        let mut deferred: HashMap<(usize, usize), Vec<DeferredGrad>> = HashMap::new();
        let mut sends = Vec::new();
        let mut loss = 0.0;
        let extra = ctx.moe.message_len();
        // A message's activations or gradients, its routing statistics read into `ctx.moe`.
        let unpack = |mb: usize, msg: Buf<f32>, total: bool| -> Buf<f32> {
            if extra == 0 {
                return msg;
            }
            ctx.moe.read_message(mb, total, &msg[rows * h..]);
            let mut data = ledger.zeros::<f32>(Category::Communication, rows * h);
            data.copy_from_slice(&msg[..rows * h]);
            data
        };
        // `data` with this micro-batch's routing statistics appended.
        let pack = |mb: usize, data: &[f32], total: bool| -> Buf<f32> {
            let mut msg = ledger.zeros::<f32>(Category::Communication, rows * h + extra);
            msg[..rows * h].copy_from_slice(data);
            ctx.moe.write_message(mb, total, &mut msg[rows * h..]);
            msg
        };
        let peer = |stage: usize| {
            self.group
                .as_ref()
                .map(|g| g.group.ranks()[stage])
                .expect("messages need a pipeline group")
        };
        let wait = |handle: Handle<CommBuf>,
                    timing: &mut PipelineTiming|
         -> Result<Buf<f32>, ParallelError> {
            let t0 = Instant::now();
            let g = self.group.as_ref().expect("messages need a pipeline group");
            let out = g.comm.wait(handle, "pipeline")?;
            timing.waiting += t0.elapsed();
            Ok(out
                .into_f32()
                .unwrap_or_else(|_| unreachable!("f32 messages")))
        };
        for action in self
            .schedule
            .actions(self.rank)
            .map_err(|e| ParallelError::Layout(e.to_string()))?
        {
            let mb = action.mb();
            ctx.micro_batch
                .store(mb, std::sync::atomic::Ordering::Relaxed);
            match *action {
                Action::RecvActivation {
                    chunk, from_stage, ..
                }
                | Action::RecvGrad {
                    chunk, from_stage, ..
                } => {
                    let flow = if matches!(action, Action::RecvActivation { .. }) {
                        Flow::Activation
                    } else {
                        Flow::Grad
                    };
                    let g = self.group.as_ref().expect("messages need a pipeline group");
                    let handle = g.comm.recv(
                        peer(from_stage),
                        self.tag(action, mb),
                        rows * h + extra,
                        CommDType::F32,
                    );
                    recvs.insert((flow, mb, chunk), handle);
                }
                Action::SendActivation {
                    chunk, to_stage, ..
                }
                | Action::SendGrad {
                    chunk, to_stage, ..
                } => {
                    let data = outputs
                        .remove(&(mb, chunk))
                        .expect("a send follows the computation that produced it");
                    let g = self.group.as_ref().expect("messages need a pipeline group");
                    sends.push(g.comm.send(
                        peer(to_stage),
                        self.tag(action, mb),
                        CommBuf::F32(data),
                    ));
                }
                Action::Forward { chunk, .. } => {
                    let (inputs, targets) = batches.entry(mb).or_insert_with(|| batch(mb)).clone();
                    let vs = self.virtual_stage(chunk);
                    let x = if vs == 0 {
                        model.embed_forward(ctx, weights, &inputs)?
                    } else if let Some(h) = recvs.remove(&(Flow::Activation, mb, chunk)) {
                        let received = unpack(mb, wait(h, &mut timing)?, false);
                        Store::keep(ledger, Category::Activations, ctx.act_dtype, received)
                    } else {
                        // One stage holding several chunks passes activations locally.
                        let previous = outputs
                            .remove(&(mb, chunk - 1))
                            .expect("the previous chunk ran first");
                        let previous = unpack(mb, previous, false);
                        Store::keep(ledger, Category::Activations, ctx.act_dtype, previous)
                    };
                    let (out, acts) = model.blocks_forward(
                        ctx,
                        weights,
                        self.chunks[chunk].clone(),
                        x,
                        inputs.len(),
                        true,
                    )?;
                    saved.insert((mb, chunk), acts);
                    if vs == last {
                        ctx.finish_moe_forward(mb, inputs.len())?;
                        let (l, dx) = model.head_step(
                            ctx,
                            weights,
                            Some(&mut *grads),
                            out,
                            &targets,
                            loss_scale,
                        )?;
                        loss += l;
                        head_grads.insert(mb, dx.expect("the head returns its input gradient"));
                    } else {
                        let buf = traced(
                            ctx.trace,
                            Track::Compute,
                            "forward",
                            || "pipeline send buffer".into(),
                            Vec::new(),
                            || pack(mb, &out.view_all(ledger), false),
                        );
                        outputs.insert((mb, chunk), buf);
                    }
                }
                Action::Backward { chunk, .. } | Action::BackwardInput { chunk, .. } => {
                    let split = matches!(action, Action::BackwardInput { .. });
                    let (inputs, _) = batches.get(&mb).expect("forward ran first").clone();
                    let vs = self.virtual_stage(chunk);
                    let dy = if vs == last {
                        head_grads.remove(&mb).expect("the head ran in forward")
                    } else if let Some(h) = recvs.remove(&(Flow::Grad, mb, chunk)) {
                        unpack(mb, wait(h, &mut timing)?, true)
                    } else {
                        let next = outputs
                            .remove(&(mb, chunk + 1))
                            .expect("the next chunk's backward ran first");
                        unpack(mb, next, true)
                    };
                    let acts = saved
                        .remove(&(mb, chunk))
                        .expect("forward kept the activations");
                    let mut queue = Vec::new();
                    let defer = split.then_some(&mut queue);
                    let dx = model.blocks_backward(
                        ctx,
                        weights,
                        grads,
                        self.chunks[chunk].clone(),
                        acts,
                        dy,
                        inputs.len(),
                        defer,
                    )?;
                    if split {
                        deferred.insert((mb, chunk), queue);
                    }
                    if vs == 0 {
                        model.embed_backward(ctx, grads, &inputs, dx)?;
                        batches.remove(&mb);
                        ctx.moe.end_micro_batch(mb);
                    } else if extra == 0 {
                        outputs.insert((mb, chunk), dx);
                    } else {
                        outputs.insert((mb, chunk), pack(mb, &dx, true));
                    }
                }
                Action::BackwardWeight { chunk, .. } => {
                    for grad in deferred
                        .remove(&(mb, chunk))
                        .expect("the input half ran first")
                    {
                        grad.apply(ctx, grads);
                    }
                }
            }
        }
        for s in sends {
            let g = self.group.as_ref().expect("messages need a pipeline group");
            g.comm.wait(s, "pipeline")?;
        }
        timing.working = start.elapsed().saturating_sub(timing.waiting);
        Ok((loss, timing))
    }
}
