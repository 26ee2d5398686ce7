//! One step's forward and backward over its micro-batches — directly, or through the
//! pipeline schedule — with the gradients reduced where the optimizer reads them.

use ferrotron_comm::GroupKind;
use ferrotron_config::Config;
use ferrotron_model::Grads;
use ferrotron_model::{Documents, MoeStep, StepCtx, WeightSource, TOKEN_IDS};
use ferrotron_parallel::{RankMesh, Strategies};
use ferrotron_tensor::trace::Tracer;
use ferrotron_tensor::trace::{traced, Track};
use ferrotron_tensor::{Buf, Category, Held, Ledger, Store};

use super::experts::moe_stats;
use super::Trainer;
use crate::optim::all_reduce_f64;
use crate::state::{store_dtype, TrainState};
use crate::TrainError;
use ferrotron_parallel::data_parallel::{Reduction, ReductionTiming, StepSink};
use ferrotron_parallel::pipeline::{MicroBatches, Pipeline, PipelineTiming};
use ferrotron_parallel::zero::Zero3Weights;

/// Which samples a rank reads: the global sample index depends on (samples consumed,
/// micro-batch, dp rank, row) only, so the global batch is the same for every layout and
/// resumes exactly; under context parallelism a rank keeps its zig-zag share of each.
struct Sampler<'a> {
    data: &'a dyn ferrotron_data::DataSource,
    /// Samples consumed before this step.
    first: u64,
    /// (data-parallel degree, this rank's index).
    dp: (usize, usize),
    /// Sequences per micro-batch.
    b: usize,
    /// This rank's positions of each sequence (None: all of them).
    keep: Option<&'a [usize]>,
    /// Document masking: the end-of-document token, and the table the model reads each
    /// micro-batch's document starts from.
    documents: Option<(u32, &'a Documents)>,
    /// The squared lengths of the documents of every window sampled (the MFU's attention).
    pairs: std::sync::atomic::AtomicU64,
}

/// A micro-batch's token ids staged on the host: the sample window (counted in the ledger,
/// as the estimator does) and `[inputs | targets]`, which go to the device in one transfer.
struct Staging {
    sample: Vec<u32>,
    ids: Vec<u32>,
    _held: Held,
}

impl Staging {
    /// Staging for micro-batches of `b` rows of `n` tokens, from samples of `seq_len + 1`.
    fn new(ledger: &Ledger, seq_len: usize, b: usize, n: usize) -> Self {
        Staging {
            sample: vec![0; seq_len + 1],
            ids: vec![0; 2 * b * n],
            _held: ledger.hold(Category::Workspace, 4 * (seq_len + 1)),
        }
    }

    /// Micro-batch `micro` of `sampler` into `dst` (`[inputs | targets]` on the device): one
    /// host-to-device transfer counted as [`TOKEN_IDS`].
    fn upload(&mut self, sampler: &Sampler<'_>, micro: usize, ledger: &Ledger, dst: &mut Buf<u32>) {
        let half = self.ids.len() / 2;
        let (inputs, targets) = self.ids.split_at_mut(half);
        let starts = sampler.fill(micro, &mut self.sample, inputs, targets);
        if let (Some((_, table)), Some(starts)) = (sampler.documents, starts) {
            table.set(ledger, micro, starts);
        }
        ledger.upload_into(TOKEN_IDS, dst, &self.ids);
    }
}

impl Sampler<'_> {
    /// Fills `inputs`, `targets` (`[b, n]`) with micro-batch `micro`, through `sample`; under
    /// document masking, returns the document starts of its windows (`[b, seq_len]`: every
    /// token, whatever share of them this rank computes), found while each sample is in hand.
    fn fill(
        &self,
        micro: usize,
        sample: &mut [u32],
        inputs: &mut [u32],
        targets: &mut [u32],
    ) -> Option<Vec<usize>> {
        let (n_dp, dp_rank) = self.dp;
        let s = sample.len() - 1;
        let mut starts = self.documents.map(|_| vec![0; self.b * s]);
        for row in 0..self.b {
            let index = self.first + ((micro * n_dp + dp_rank) * self.b + row) as u64;
            self.data.sample(index, sample);
            split_row(sample, self.keep, row, inputs, targets);
            if let (Some((eos, _)), Some(starts)) = (self.documents, starts.as_mut()) {
                let window = &mut starts[row * s..(row + 1) * s];
                ferrotron_data::document_starts(&sample[..s], eos, window);
                let pairs = super::spans::squared_lengths(window);
                self.pairs
                    .fetch_add(pairs, std::sync::atomic::Ordering::Relaxed);
            }
        }
        starts
    }
}

/// The parts of one step's backward that both step shapes (accumulation, pipeline) share.
struct StepRun<'r, 'a> {
    ctx: &'r StepCtx<'a>,
    model: &'r ferrotron_model::Llama,
    reduction: Reduction<'r>,
    sampler: Sampler<'r>,
    /// Multiplier of every token's loss gradient: 1 / tokens of the global batch (times the
    /// loss scale under fp16).
    scale: f32,
    /// Fault injection: fail in this (1-based) step, after its first micro-batch.
    fail: Option<usize>,
}

impl StepRun<'_, '_> {
    fn check_fault(&self) -> Result<(), TrainError> {
        match self.fail {
            Some(step) => Err(TrainError::Hook(format!("injected failure at step {step}"))),
            None => Ok(()),
        }
    }

    /// Gradient accumulation: each micro-batch's forward and backward in turn; the
    /// reductions start during the last one's backward.
    fn accumulate(
        &self,
        (weights, grads): (&Store, &mut Grads),
        m: usize,
    ) -> Result<(f64, ReductionTiming), TrainError> {
        let (ctx, l) = (self.ctx, self.ctx.ledger);
        let (n, b) = (ctx.local_seq(self.model.cfg.seq_len), self.sampler.b);
        let mut staging = Staging::new(l, self.model.cfg.seq_len, b, n);
        let mut ids = l.zeros::<u32>(Category::Workspace, 2 * b * n);
        let (mut loss_sum, mut timing) = (0.0, ReductionTiming::default());
        for micro in 0..m {
            ctx.micro_batch
                .store(micro, std::sync::atomic::Ordering::Relaxed);
            traced(
                ctx.trace,
                Track::Compute,
                "data",
                || "data".into(),
                Vec::new(),
                || staging.upload(&self.sampler, micro, l, &mut ids),
            );
            let mut sink = StepSink::new(&mut *grads, self.reduction, micro + 1 == m);
            let zero3;
            let source: &dyn WeightSource = if self.reduction.zero >= 3 {
                zero3 = Zero3Weights::new(weights, &self.model.layout, self.reduction);
                &zero3
            } else {
                weights
            };
            let (ins, tgs) = ids.split_at(b * n);
            loss_sum +=
                self.model
                    .forward_backward(ctx, source, Some(&mut sink), ins, tgs, self.scale)?;
            timing.add(&sink.finish()?);
            self.check_fault()?;
        }
        Ok((loss_sum, timing))
    }

    /// Pipeline: the schedule interleaves the micro-batches' forwards and backwards; the
    /// data-parallel reduction starts after this rank's last backward.
    fn pipelined(
        &self,
        pipe: &Pipeline,
        (weights, grads): (&Store, &mut Grads),
    ) -> Result<(f64, ReductionTiming, PipelineTiming), TrainError> {
        let ctx = self.ctx;
        let n = ctx.local_seq(self.model.cfg.seq_len);
        let b = self.sampler.b;
        // The sampling buffers, counted in the ledger; the schedule keeps its own copy of
        // each micro-batch's ids until its backward.
        let l = ctx.ledger;
        let staging = std::cell::RefCell::new(Staging::new(l, self.model.cfg.seq_len, b, n));
        let batch = |micro: usize| {
            traced(
                ctx.trace,
                Track::Compute,
                "data",
                || "data".into(),
                Vec::new(),
                || {
                    let mut ids = l.zeros::<u32>(Category::Workspace, 2 * b * n);
                    staging
                        .borrow_mut()
                        .upload(&self.sampler, micro, l, &mut ids);
                    ids
                },
            )
        };
        let rows = ctx.local_rows(b * n);
        let mut sink = StepSink::new(grads, self.reduction, false);
        let io = MicroBatches {
            batch: &batch,
            rows,
            loss_scale: self.scale,
        };
        let (loss, pipe_timing) = pipe.run(self.model, ctx, weights, &mut sink, io)?;
        self.check_fault()?;
        traced(
            ctx.trace,
            Track::Compute,
            "backward",
            || "gradient buckets".into(),
            Vec::new(),
            || sink.launch_all(),
        )?;
        Ok((loss, sink.finish()?, pipe_timing))
    }
}

/// The strategies the mesh hands the model for one step of `c`, traced into `trace`.
fn step_strategies<'a>(
    mesh: &'a RankMesh,
    c: &Config,
    trace: Option<&'a Tracer>,
) -> Result<Strategies<'a>, TrainError> {
    let split = (c.model.seq_len, c.parallel.cp_kind);
    mesh.strategies(c.parallel.sequence_parallel, split, trace)
        .map_err(|e| TrainError::Layout(e.to_string()))
}

/// The context of one step's forward and backward with the mesh's `strategies`, on
/// `device` (ledger, kernels), every loss gradient multiplied by `loss_scale` (fp16's;
/// else 1).
fn step_ctx<'s>(
    strategies: &'s Strategies<'s>,
    c: &Config,
    loss_scale: f64,
    (ledger, backend): (
        &'s ferrotron_tensor::Ledger,
        &'s dyn ferrotron_tensor::Backend,
    ),
    trace: Option<&'s Tracer>,
) -> StepCtx<'s> {
    let (n_dp, m) = (strategies.data_ranks, c.train.grad_accum);
    StepCtx {
        ledger,
        backend,
        act_dtype: store_dtype(c.train.dtype),
        loss_chunk: c.train.loss_chunk,
        tp: strategies.tp.as_ref().map(|t| t as _),
        cp: strategies.cp.as_ref().map(|c| c as _),
        trace,
        micro_batch: Default::default(),
        recompute: c.parallel.recompute,
        // Every (data-parallel rank, micro-batch) pair's aux has the same weight.
        moe: MoeStep::new(
            &c.model,
            strategies.ep.as_ref().map(|e| e as _),
            c.model.router_aux_loss_coef / (n_dp * m) as f64 * loss_scale,
        ),
        documents: None,
        fp8: c.train.fp8,
        fp8_history: None,
    }
}
/// The multiplier of every token's loss gradient: 1 / `tokens`, times fp16's loss scale.
fn token_scale(loss_scale: Option<f64>, tokens: usize) -> f32 {
    match loss_scale {
        None => 1.0 / tokens as f32,
        Some(s) => (s / tokens as f64) as f32,
    }
}

impl Trainer {
    /// Forward and backward of every micro-batch of the current step: gradients accumulated
    /// (and reduced over data and context parallelism) where the optimizer reads them.
    /// Returns the mean token loss of the global batch (the cross-entropy; a
    /// mixture-of-experts model's load-balancing loss is in the next
    /// [`super::StepStats::moe`]) and the timing of the gradient reductions.
    pub fn compute_gradients(&mut self) -> Result<(f64, ReductionTiming), TrainError> {
        let c = &self.config;
        let (b, s, m) = (c.train.micro_batch, c.model.seq_len, c.train.grad_accum);
        let (n_dp, dp_rank) = self.dp_coords();
        // Context parallelism splits each sequence, not the batch: the global batch and the
        // loss scale stay those of the data-parallel ranks.
        let tokens = b * s * m * n_dp;
        let trace = self
            .metrics
            .tracer
            .as_deref()
            .filter(|_| self.metrics.tracing);
        let mesh = &self.mesh;
        let strategies = step_strategies(mesh, c, trace)?;
        let documents = Documents::new();
        let (loss_scale, fail) = (self.loss_scale(), self.failure_now());
        let dev = (&self.device.ledger, &*self.device.backend);
        let mut ctx = step_ctx(&strategies, c, loss_scale.unwrap_or(1.0), dev, trace);
        ctx.documents = c.data.document_eos().map(|_| &documents);
        ctx.fp8_history = self.fp8_history.as_ref();
        if let Some(bias) = self.expert_bias.layers() {
            ctx.moe = ctx.moe.with_bias(bias);
        }
        let TrainState {
            weights,
            grads,
            plan,
            zero,
            dp_rank: shard,
            ..
        } = &mut self.state;
        let run = StepRun {
            ctx: &ctx,
            model: &self.model,
            reduction: Reduction {
                plan,
                groups: mesh.reduce_groups(),
                dev: self.device.dev(),
                zero: *zero,
                // ZeRO pieces are indexed within the reduction group (data × context).
                dp_rank: *shard,
                dtype: store_dtype(c.train.dtype),
            },
            sampler: Sampler {
                data: &*self.data,
                first: self.position.samples_done,
                dp: (n_dp, dp_rank),
                b,
                keep: strategies.cp.as_ref().map(|cp| cp.positions()),
                documents: c.data.document_eos().map(|eos| (eos, &documents)),
                pairs: Default::default(),
            },
            scale: token_scale(loss_scale, tokens),
            fail,
        };
        let (loss_sum, timing) = match &self.pipeline {
            None => self
                .device
                .pool
                .install(|| run.accumulate((weights, grads), m))?,
            Some(pipe) => {
                let (loss, timing, pipe_timing) = self
                    .device
                    .pool
                    .install(|| run.pipelined(pipe, (weights, grads)))?;
                self.metrics.last_pipeline_timing = pipe_timing;
                (loss, timing)
            }
        };
        let pairs = c.data.document_mask.then(|| run.sampler.pairs.into_inner());
        let report = ctx.moe.report();
        drop(ctx);
        self.record_fp8_amax()?;
        let loss_sum = self.finish_step_loss(loss_sum, report)?;
        if let Some(pairs) = pairs {
            self.record_spans(pairs, tokens)?;
        }
        Ok((loss_sum / tokens as f64, timing))
    }

    /// The injected failure's step when it is the step about to run (fault injection).
    fn failure_now(&self) -> Option<usize> {
        let next = self.position.step + 1;
        self.faults.fail_at_step.filter(|&f| f == next)
    }

    /// The step's loss summed over every token of the global batch — over the stages (only
    /// the last computed losses), then the data and context parallel ranks — and the
    /// step's mixture-of-experts figures.
    fn finish_step_loss(
        &mut self,
        mut loss_sum: f64,
        report: ferrotron_model::MoeReport,
    ) -> Result<f64, TrainError> {
        let (ledger, mesh) = (&self.device.ledger, &self.mesh);
        let (dp, pp) = (mesh.link(GroupKind::DpCp), mesh.link(GroupKind::Pp));
        for group in [pp, dp].into_iter().flatten() {
            loss_sum = all_reduce_f64(group, ledger, loss_sum, "loss")?;
        }
        self.metrics.last_moe = moe_stats(&self.config, report, pp, dp, ledger)?;
        if let Some(moe) = &self.metrics.last_moe {
            self.expert_bias.update(&moe.expert_counts);
        }
        Ok(loss_sum)
    }
}

/// Writes row `row` of a micro-batch from one sample (`s + 1` tokens): the inputs and
/// next-token targets at the positions `keep` (this rank's context-parallel share), or all
/// `s` of them. `inputs`, `targets`: `[b, n]` flattened, `n` = positions kept.
fn split_row(
    sample: &[u32],
    keep: Option<&[usize]>,
    row: usize,
    inputs: &mut [u32],
    targets: &mut [u32],
) {
    let s = sample.len() - 1;
    match keep {
        None => {
            inputs[row * s..(row + 1) * s].copy_from_slice(&sample[..s]);
            targets[row * s..(row + 1) * s].copy_from_slice(&sample[1..]);
        }
        Some(pos) => {
            let n = pos.len();
            for (i, &p) in pos.iter().enumerate() {
                inputs[row * n + i] = sample[p];
                targets[row * n + i] = sample[p + 1];
            }
        }
    }
}
