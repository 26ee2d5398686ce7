//! Pipeline parallelism: which blocks a stage holds, and the executor that walks a rank's
//! list of actions from `ferrotron-schedule` — forwards and backwards of (micro-batch, chunk)
//! pairs, with activations and gradients sent to and received from the neighbouring stages.
//!
//! Virtual stage `vs` (`chunk·p + rank`, or DualPipeV's V: stages `rank` and `2p−1−rank`)
//! holds the blocks `pp_layers[vs]` (an even split by default); stage 0 also holds the
//! embedding, stage `p·v − 1` the final norm and LM head.
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
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrotron_comm::{CommBuf, DType as CommDType, Handle};
use ferrotron_config::Config;
use ferrotron_model::{
    BlockActs, BlockRun, DeferredGrad, GradSink, Llama, LossTargets, StageParts, StepCtx,
    WeightSource, ROUTING,
};
use ferrotron_schedule::{schedule, Action, Flow, Schedule};
use ferrotron_tensor::trace::{traced, Track};
use ferrotron_tensor::{Buf, Category, DeviceSlice, Store};

use crate::mesh::GroupComm;
use crate::ParallelError;

/// What pipeline rank `rank` of `config`'s layout holds (the split of
/// [`ferrotron_schedule::stage_sizes`]).
pub fn stage_parts(config: &Config, rank: usize) -> StageParts {
    let par = &config.parallel;
    let (placement, p) = (par.pp_schedule.placement(), par.pp);
    let last = p * par.chunks_per_rank() - 1;
    StageParts {
        layers: config.rank_chunks(rank).into_iter().flatten().collect(),
        embed: placement.owner(p, 0).0 == rank,
        head: placement.owner(p, last).0 == rank,
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
            config.parallel.chunks_per_rank(),
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
        self.schedule.virtual_stage(self.rank, chunk)
    }

    /// The chunk of this rank that holds virtual stage `stage` (a neighbour of one of its
    /// own chunks, handed over in place).
    fn local_chunk(&self, stage: usize) -> usize {
        let (rank, chunk) = self.schedule.kind().placement().owner(self.p, stage);
        debug_assert_eq!(rank, self.rank, "a local hand-over stays on the rank");
        chunk
    }

    fn tag(&self, action: &Action, mb: usize) -> u64 {
        let placement = self.schedule.kind().placement();
        let (flow, edge) = action
            .edge(self.rank, self.p, placement)
            .expect("a message crosses a stage boundary");
        let flow = match flow {
            Flow::Activation => 0,
            Flow::Grad => 1,
        };
        ((mb * self.p * self.v + edge) * 2 + flow) as u64
    }

    /// The pipeline group (messages need one).
    fn link(&self) -> &GroupComm {
        self.group.as_ref().expect("messages need a pipeline group")
    }

    /// Runs this rank's actions for one step on the micro-batches of `io`. Returns the sum of
    /// the token losses this rank computed (non-zero on the last stage) and its timing.
    pub fn run(
        &self,
        model: &Llama,
        ctx: &StepCtx<'_>,
        weights: &dyn WeightSource,
        grads: &mut dyn GradSink,
        io: MicroBatches<'_>,
    ) -> Result<(f64, PipelineTiming), ParallelError> {
        let start = Instant::now();
        let mut exec = StepExec {
            pipe: self,
            model,
            ctx,
            weights,
            grads,
            io,
            extra: ctx.moe.message_len(),
            last: self.p * self.v - 1,
            batches: HashMap::new(),
            recvs: HashMap::new(),
            outputs: HashMap::new(),
            saved: HashMap::new(),
            head_grads: HashMap::new(),
            deferred: HashMap::new(),
            sends: Vec::new(),
            loss: 0.0,
            timing: PipelineTiming::default(),
        };
        for action in self
            .schedule
            .actions(self.rank)
            .map_err(|e| ParallelError::Layout(e.to_string()))?
        {
            exec.act(action)?;
        }
        for s in std::mem::take(&mut exec.sends) {
            self.link().comm.wait(s, "pipeline")?;
        }
        let mut timing = exec.timing;
        timing.working = start.elapsed().saturating_sub(timing.waiting);
        Ok((exec.loss, timing))
    }
}

/// A micro-batch's token ids on the device: `[inputs | targets]`, two equal halves.
pub type TokenIds = Buf<u32>;

/// The micro-batches of one pipeline step as this rank sees them.
#[derive(Clone, Copy)]
pub struct MicroBatches<'a> {
    /// A micro-batch's (inputs, targets), by index.
    pub batch: &'a dyn Fn(usize) -> TokenIds,
    /// Rows of this rank's residual stream per micro-batch (its tokens, or its sequence-
    /// parallel share).
    pub rows: usize,
    /// Multiplier of every token's loss.
    pub loss_scale: f32,
}

/// One step's walk over this rank's actions: what each action leaves for a later one.
struct StepExec<'r, 'a> {
    pipe: &'r Pipeline,
    model: &'r Llama,
    ctx: &'r StepCtx<'a>,
    weights: &'r dyn WeightSource,
    grads: &'r mut dyn GradSink,
    io: MicroBatches<'r>,
    /// Floats of routing statistics each message carries after its data.
    extra: usize,
    /// The last virtual stage (it holds the head).
    last: usize,
    batches: HashMap<usize, Arc<TokenIds>>,
    recvs: HashMap<(Flow, usize, usize), Handle<CommBuf>>,
    outputs: HashMap<(usize, usize), Buf<f32>>,
    saved: HashMap<(usize, usize), Vec<BlockActs>>,
    head_grads: HashMap<usize, Buf<f32>>,
    deferred: HashMap<(usize, usize), Vec<DeferredGrad>>,
    sends: Vec<Handle<()>>,
    loss: f64,
    timing: PipelineTiming,
}

impl StepExec<'_, '_> {
    fn act(&mut self, action: &Action) -> Result<(), ParallelError> {
        let mb = action.mb();
        self.ctx
            .micro_batch
            .store(mb, std::sync::atomic::Ordering::Relaxed);
        match *action {
            Action::RecvActivation {
                chunk, from_stage, ..
            } => self.recv(action, Flow::Activation, chunk, from_stage),
            Action::RecvGrad {
                chunk, from_stage, ..
            } => self.recv(action, Flow::Grad, chunk, from_stage),
            Action::SendActivation {
                chunk, to_stage, ..
            }
            | Action::SendGrad {
                chunk, to_stage, ..
            } => self.send(action, chunk, to_stage),
            Action::Forward { chunk, .. } => self.forward(mb, chunk)?,
            Action::Backward { chunk, .. } => self.backward(mb, chunk, false)?,
            Action::BackwardInput { chunk, .. } => self.backward(mb, chunk, true)?,
            Action::BackwardWeight { chunk, .. } => {
                let queue = self
                    .deferred
                    .remove(&(mb, chunk))
                    .expect("the input half ran first");
                for grad in queue {
                    grad.apply(self.ctx, self.grads)?;
                }
            }
        }
        Ok(())
    }

    fn width(&self) -> usize {
        self.io.rows * self.model.cfg.hidden
    }

    fn recv(&mut self, action: &Action, flow: Flow, chunk: usize, from_stage: usize) {
        let g = self.pipe.link();
        let handle = g.comm.recv(
            g.group.ranks()[from_stage],
            self.pipe.tag(action, action.mb()),
            self.width() + self.extra,
            CommDType::F32,
        );
        self.recvs.insert((flow, action.mb(), chunk), handle);
    }

    fn send(&mut self, action: &Action, chunk: usize, to_stage: usize) {
        let mb = action.mb();
        let data = self
            .outputs
            .remove(&(mb, chunk))
            .expect("a send follows the computation that produced it");
        let g = self.pipe.link();
        let to = g.group.ranks()[to_stage];
        let tag = self.pipe.tag(action, mb);
        self.sends.push(g.comm.send(to, tag, CommBuf::F32(data)));
    }

    /// Waits for a message, counting the time as this rank's bubble.
    fn wait(&mut self, handle: Handle<CommBuf>) -> Result<Buf<f32>, ParallelError> {
        let t0 = Instant::now();
        let out = self.pipe.link().comm.wait(handle, "pipeline")?;
        self.timing.waiting += t0.elapsed();
        Ok(out
            .into_f32()
            .unwrap_or_else(|_| unreachable!("f32 messages")))
    }

    /// A message's activations or gradients, its routing statistics read into `ctx.moe`.
    fn unpack(&self, mb: usize, msg: Buf<f32>, total: bool) -> Buf<f32> {
        if self.extra == 0 {
            return msg;
        }
        let (w, ctx) = (self.width(), self.ctx);
        let stats = ctx.ledger.download(ROUTING, &msg[w..]);
        ctx.moe.read_message(mb, total, &stats);
        let mut data = ctx.ledger.zeros::<f32>(Category::Communication, w);
        ctx.backend.copy(&mut data, &msg[..w]);
        data
    }

    /// `data` with this micro-batch's routing statistics appended.
    fn pack(&self, mb: usize, data: &DeviceSlice<f32>, total: bool) -> Buf<f32> {
        let (w, ctx) = (self.width(), self.ctx);
        let mut msg = ctx
            .ledger
            .zeros::<f32>(Category::Communication, w + self.extra);
        ctx.backend.copy(&mut msg[..w], data);
        if self.extra > 0 {
            let mut stats = vec![0.0; self.extra];
            ctx.moe.write_message(mb, total, &mut stats);
            ctx.ledger.upload_into(ROUTING, &mut msg[w..], &stats);
        }
        msg
    }

    /// The input of chunk `chunk`'s forward: the embedding, a received message, or (the
    /// previous stage on this rank: one stage holding several chunks, the turn of the V) that
    /// chunk's output.
    fn forward_input(
        &mut self,
        mb: usize,
        chunk: usize,
        inputs: &DeviceSlice<u32>,
    ) -> Result<Store, ParallelError> {
        let ctx = self.ctx;
        let stage = self.pipe.virtual_stage(chunk);
        if stage == 0 {
            return Ok(self.model.embed_forward(ctx, self.weights, inputs)?);
        }
        let msg = match self.recvs.remove(&(Flow::Activation, mb, chunk)) {
            Some(h) => self.wait(h)?,
            None => self
                .outputs
                .remove(&(mb, self.pipe.local_chunk(stage - 1)))
                .expect("the previous chunk ran first"),
        };
        let received = self.unpack(mb, msg, false);
        Ok(Store::keep(
            ctx.device(),
            Category::Activations,
            ctx.act_dtype,
            received,
        ))
    }

    fn forward(&mut self, mb: usize, chunk: usize) -> Result<(), ParallelError> {
        let batch = self.io.batch;
        let ids = self
            .batches
            .entry(mb)
            .or_insert_with(|| Arc::new(batch(mb)))
            .clone();
        let (inputs, targets) = ids.split_at(ids.len() / 2);
        let x = self.forward_input(mb, chunk, inputs)?;
        let (ctx, model) = (self.ctx, self.model);
        let range = self.pipe.chunks[chunk].clone();
        let (out, acts) = model.blocks_forward(ctx, self.weights, range, x, inputs.len(), true)?;
        self.saved.insert((mb, chunk), acts);
        if self.pipe.virtual_stage(chunk) == self.last {
            ctx.finish_moe_forward(mb, inputs.len())?;
            let grads: Option<&mut dyn GradSink> = Some(&mut *self.grads);
            let scale = self.io.loss_scale;
            let loss = LossTargets { targets, scale };
            let (l, dx) = model.head_step(ctx, self.weights, grads, out, loss)?;
            self.loss += l;
            let dx = dx.expect("the head returns its input gradient");
            self.head_grads.insert(mb, dx);
        } else {
            let buf = traced(
                ctx.trace,
                Track::Compute,
                "forward",
                || "pipeline send buffer".into(),
                Vec::new(),
                || self.pack(mb, &out.view_all(ctx.device()), false),
            );
            self.outputs.insert((mb, chunk), buf);
        }
        Ok(())
    }

    /// The gradient of chunk `chunk`'s output: from the head, a received message, or (the
    /// next stage on this rank) that chunk's backward.
    fn backward_input(&mut self, mb: usize, chunk: usize) -> Result<Buf<f32>, ParallelError> {
        let stage = self.pipe.virtual_stage(chunk);
        if stage == self.last {
            return Ok(self
                .head_grads
                .remove(&mb)
                .expect("the head ran in forward"));
        }
        let msg = match self.recvs.remove(&(Flow::Grad, mb, chunk)) {
            Some(h) => self.wait(h)?,
            None => self
                .outputs
                .remove(&(mb, self.pipe.local_chunk(stage + 1)))
                .expect("the next chunk's backward ran first"),
        };
        Ok(self.unpack(mb, msg, true))
    }

    /// A chunk's backward; `split` (zero bubble's `B`) queues its weight gradients for `W`.
    fn backward(&mut self, mb: usize, chunk: usize, split: bool) -> Result<(), ParallelError> {
        let ids = self.batches.get(&mb).expect("forward ran first").clone();
        let inputs = &ids[..ids.len() / 2];
        let dy = self.backward_input(mb, chunk)?;
        let acts = self
            .saved
            .remove(&(mb, chunk))
            .expect("forward kept the activations");
        let mut queue = Vec::new();
        let defer = split.then_some(&mut queue);
        let (ctx, model, range) = (self.ctx, self.model, self.pipe.chunks[chunk].clone());
        let blocks = BlockRun {
            local: range,
            saved: acts,
            t: inputs.len(),
        };
        let dx = model.blocks_backward(ctx, self.weights, &mut *self.grads, blocks, dy, defer)?;
        if split {
            self.deferred.insert((mb, chunk), queue);
        }
        if chunk == 0 {
            // This rank's last blocks of the micro-batch are done: its document starts go.
            if let Some(docs) = ctx.documents {
                docs.end(mb);
            }
        }
        if self.pipe.virtual_stage(chunk) == 0 {
            model.embed_backward(ctx, self.grads, inputs, dx)?;
            self.batches.remove(&mb);
            ctx.moe.end_micro_batch(mb);
        } else if self.extra == 0 {
            self.outputs.insert((mb, chunk), dx);
        } else {
            let msg = self.pack(mb, &dx, true);
            self.outputs.insert((mb, chunk), msg);
        }
        Ok(())
    }
}
