//! The training loop of one rank: micro-batches with gradient accumulation, the loss as the
//! mean over every token of the global batch, global-norm clipping, AdamW, LR schedule.

use std::sync::Arc;
use std::time::Instant;

use ferrotron_config::Config;
use ferrotron_data::{DataSource, TokenStore};
use ferrotron_model::Llama;
use ferrotron_tensor::trace::{Tracer, Track};
use ferrotron_tensor::{Backend, Held, Ledger, LedgerSnapshot, Store};

use crate::lr::LrSchedule;
use crate::optim::{optimizer_step, StepHyper};
use crate::state::TrainState;
use crate::TrainError;
use ferrotron_comm::GroupKind;
use ferrotron_parallel::pipeline::{Pipeline, PipelineTiming};
use ferrotron_parallel::RankMesh;

mod background;
mod balance;
mod build;
mod checkpoint;
mod experts;
mod fp8_amax;
mod gather;
mod gradients;
mod hooks;
mod skip;
mod sources;
mod spans;
mod stats;
mod summary;

pub use background::{InFlight, Written};
pub use experts::MoeStats;
pub use hooks::{CheckpointHook, EvalHook, Observe, SaveReport, StepHook};
pub use sources::{host_backend, matmul_description, open_data, thread_pool, Init};
pub use spans::DOCUMENT_SPANS;
pub use stats::StepStats;
pub use summary::RunSummary;

/// One rank's trainer: the model, its place in the mesh, its training state and its data,
/// on the device that computes and counts its memory.
pub struct Trainer {
    /// The validated configuration.
    pub config: Config,
    /// The model (this rank's stage and shards).
    pub model: Llama,
    /// Every group of this rank (tensor, context, pipeline, data, data × context, expert,
    /// expert-data × context), built once from the topology.
    pub mesh: RankMesh,
    /// This rank's pipeline stage: the schedule executor (None without pipeline parallelism).
    pub pipeline: Option<Pipeline>,
    /// Weights, gradients, optimizer states.
    pub state: TrainState,
    /// Where the step is (step, samples consumed, learning rate).
    position: Position,
    data: Box<dyn DataSource>,
    device: Device,
    /// What the run measures and records (MFU denominator, trace, last step's figures).
    pub metrics: RunMetrics,
    /// Fault injection for tests of failure handling.
    pub faults: Faults,
    /// Raised to stop after the step in progress (see [`crate::stop`]); None: the run
    /// cannot be stopped early (every rank of a run has one or none).
    pub stop_flag: Option<crate::stop::StopFlag>,
    /// Aux-loss-free balancing's per-expert biases (`model.moe_balance = "bias"`).
    expert_bias: balance::ExpertBias,
    /// fp16's dynamic loss scale (None under f32 and bf16).
    scaler: Option<crate::loss_scale::LossScaler>,
    /// FP8 delayed scaling's amax history (`train.fp8_amax_history`).
    fp8_history: Option<ferrotron_model::Fp8History>,
}

/// The device a trainer computes on: its kernels, its compute threads and the memory ledger
/// its buffers are counted in.
struct Device {
    ledger: Ledger,
    pool: rayon::ThreadPool,
    backend: Arc<dyn Backend>,
    /// Workspace counted for the whole run ([`build::standing_workspace`]).
    _standing: Vec<Held>,
}

impl Device {
    /// The ledger and kernels, as kernels' callers take them.
    fn dev(&self) -> ferrotron_tensor::Device<'_> {
        ferrotron_tensor::Device {
            ledger: &self.ledger,
            backend: &*self.backend,
        }
    }
}

/// Where a run is: steps taken, samples consumed (the data position), the LR schedule.
struct Position {
    step: usize,
    samples_done: u64,
    schedule: LrSchedule,
}

/// What a run measures and records besides its state.
#[derive(Default)]
pub struct RunMetrics {
    /// The MFU denominator in FLOP/s: the measured matmul peak of every core the run
    /// occupies ([`crate::mfu::Occupancy`]).
    pub peak_flops: Option<f64>,
    /// Compute threads the peak covers (ranks' threads on the cores the run occupies): the
    /// denominator is raised to the products' best rate per thread times these where that
    /// is higher (0: never raised).
    pub peak_threads: usize,
    /// Whether the denominator was raised so (the measured peak was below what the run's
    /// own products reached: it was taken while the machine was busy, or is stale).
    pub peak_raised: bool,
    /// What the last step's mixture-of-experts blocks measured (None for a dense model).
    pub(crate) last_moe: Option<MoeStats>,
    /// Waiting and working time of this rank's last pipeline step.
    pub last_pipeline_timing: PipelineTiming,
    /// Where and why the run stopped before `train.steps` (None: it has not).
    pub stopped: Option<crate::stop::Stopped>,
    /// Document masking's attention spans, the MFU numerator's attention term.
    pub(crate) spans: spans::DocumentSpans,
    tracer: Option<Arc<Tracer>>,
    trace_steps: (usize, usize),
    tracing: bool,
}

impl RunMetrics {
    /// Raises the MFU denominator to `best` FLOP/s per thread (the products' best so far)
    /// times [`RunMetrics::peak_threads`] where that is above it: MFU never counts the run
    /// faster than its own products could go.
    pub fn raise_peak(&mut self, best: Option<f64>) {
        if let (Some(peak), Some(rate)) = (self.peak_flops, best) {
            let floor = rate * self.peak_threads as f64;
            if floor > peak {
                self.peak_flops = Some(floor);
                self.peak_raised = true;
            }
        }
    }
}

/// Fault injection for tests of failure handling and checkpoint atomicity.
#[derive(Debug, Default, Clone, Copy)]
pub struct Faults {
    /// This rank fails in the middle of this (1-based) step, after its first micro-batch.
    pub fail_at_step: Option<usize>,
    /// Rank 0 aborts the process while saving the checkpoint of this step, after the rank
    /// files and before the manifest.
    pub abort_in_save: Option<usize>,
}

impl Trainer {
    /// The device this trainer computes on: its ledger and kernels.
    pub fn device(&self) -> ferrotron_tensor::Device<'_> {
        self.device.dev()
    }

    /// Records a timeline of the (1-based, inclusive) steps `first..=last` on a tracer whose
    /// times count from `origin` (share it across ranks to align their timelines).
    pub fn enable_trace(&mut self, origin: Instant, first: usize, last: usize) -> Arc<Tracer> {
        let tracer = Arc::new(Tracer::new(origin));
        self.metrics.tracer = Some(tracer.clone());
        self.metrics.trace_steps = (first, last);
        tracer
    }

    /// The tracer, while the current step is being traced.
    fn trace_now(&self) -> Option<&Tracer> {
        self.metrics
            .tracer
            .as_deref()
            .filter(|_| self.metrics.tracing)
    }

    /// The rank's communicator (shared by all its groups), when the run has more than one
    /// rank.
    fn comm(&self) -> Option<&Arc<ferrotron_comm::Comm>> {
        self.mesh.comm()
    }

    /// Runs `f` on this trainer's compute thread pool.
    pub fn in_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.device.pool.install(f)
    }

    /// Compute threads of this trainer.
    pub fn threads(&self) -> usize {
        self.device.pool.current_num_threads()
    }

    /// The backend this rank's kernels run on (the CPU's, or a GPU's).
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.device.backend
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> usize {
        self.position.step
    }

    /// Model FLOPs per token, the MFU numerator (see [`crate::mfu`]); under document masking
    /// with each document's attention, over the steps so far.
    pub fn flops_per_token(&self) -> f64 {
        self.flops_with_span(self.metrics.spans.mean())
    }

    /// Model FLOPs per token with attention spanning `span` keys per token (None: the whole
    /// window).
    fn flops_with_span(&self, span: Option<f64>) -> f64 {
        let model = &self.config.model;
        span.map_or_else(
            || model.model_flops_per_token(),
            |s| model.model_flops_with_span(s),
        )
    }

    /// This trainer's world rank (0 on a single rank).
    pub fn rank(&self) -> usize {
        self.mesh.rank()
    }

    /// Data-parallel degree and this rank's index in it: they choose the samples a rank
    /// reads (context-parallel ranks of one replica read the same samples).
    pub fn dp_coords(&self) -> (usize, usize) {
        self.mesh.coords(GroupKind::Dp)
    }

    /// One optimizer step over `grad_accum` micro-batches.
    pub fn step(&mut self) -> Result<StepStats, TrainError> {
        let start = Instant::now();
        let number = self.position.step + 1;
        self.metrics.tracing = self.metrics.tracer.is_some()
            && (self.metrics.trace_steps.0..=self.metrics.trace_steps.1).contains(&number);
        if let Some(comm) = self.comm() {
            comm.set_tracer(
                self.trace_now()
                    .map(|_| self.metrics.tracer.clone().expect("tracing")),
            );
        }
        let result = self.step_inner(start);
        // Between steps the ledger counts only what is in use.
        self.device.ledger.release_recycled();
        if let Some(t) = self.trace_now() {
            t.record(
                Track::Step,
                format!("step {number}"),
                "step",
                start,
                Instant::now(),
                Vec::new(),
            );
        }
        result
    }

    fn step_inner(&mut self, start: Instant) -> Result<StepStats, TrainError> {
        let (loss, timing) = self.compute_gradients()?;
        let step = self.position.step;
        if !loss.is_finite() {
            return self.non_finite(start, "loss", (loss, f64::NAN));
        }
        let tokens = self.config.tokens_per_step();
        let lr = self.position.schedule.at(step);
        let loss_scale = self.loss_scale();
        let skipped = self.scaler.as_ref().map_or(0, |s| s.skipped_steps());
        let train = self.config.train.clone();
        let (state, ledger) = (&mut self.state, &self.device.ledger);
        let groups = self.mesh.groups();
        let trace = self
            .metrics
            .tracer
            .as_deref()
            .filter(|_| self.metrics.tracing);
        let grad_norm = self.device.pool.install(|| {
            let span = trace.map(|t| (t, Instant::now()));
            let hyper = StepHyper {
                train: &train,
                lr,
                // Adam counts the steps it applied: not those skipped on fp16 overflow.
                step: (step + 1) as u64 - skipped,
                unscale: loss_scale.map_or(1.0, |s| 1.0 / s),
            };
            let out = optimizer_step(state, groups, ledger, &*self.device.backend, hyper);
            if let Some((t, t0)) = span {
                t.record(
                    Track::Compute,
                    "optimizer step",
                    "optimizer",
                    t0,
                    Instant::now(),
                    Vec::new(),
                );
            }
            out
        })?;
        if let Some(skipped) = self.overflowed(start, (loss, grad_norm)) {
            return Ok(skipped);
        }
        if !grad_norm.is_finite() {
            return self.non_finite(start, "gradient norm", (loss, grad_norm));
        }
        self.position.step += 1;
        self.position.samples_done += self.config.samples_per_step() as u64;
        let step_time_s = start.elapsed().as_secs_f64();
        let tokens_per_s = tokens as f64 / step_time_s;
        self.metrics
            .raise_peak(self.device.backend.best_product_rate());
        let mfu = self.metrics.peak_flops.map(|p| {
            crate::mfu::mfu(
                tokens_per_s,
                self.flops_with_span(self.metrics.spans.last()),
                p,
            )
        });
        Ok(StepStats {
            step: self.position.step,
            loss,
            lr,
            grad_norm,
            tokens,
            step_time_s,
            tokens_per_s,
            mfu,
            reduce_busy_s: timing.busy.as_secs_f64(),
            reduce_hidden_s: timing.hidden.as_secs_f64(),
            reduce_exposed_s: timing.exposed.as_secs_f64(),
            pipeline_wait_s: self.metrics.last_pipeline_timing.waiting.as_secs_f64(),
            moe: self.metrics.last_moe.clone(),
            skipped: false,
            loss_scale,
            memory_peak_bytes: self.memory_peaks(),
        })
    }

    /// Mean next-token loss of the current weights on a token file (see [`crate::evaluate`]).
    /// Collective under ZeRO-3 (the weights are gathered first); every rank gets the result.
    pub fn evaluate(&self, file: &dyn TokenStore) -> Result<crate::EvalReport, TrainError> {
        if self.pipeline.is_some() {
            return Err(TrainError::Layout(
                "data.eval_path with pipeline parallelism is not supported yet: evaluate the saved model with `ferrotron eval`".into(),
            ));
        }
        if self.mesh.link(GroupKind::Cp).is_some() {
            return Err(TrainError::Layout(
                "data.eval_path with context parallelism is not supported yet: evaluate the saved model with `ferrotron eval`".into(),
            ));
        }
        let c = &self.config;
        let gathered;
        let weights: &Store = if self.state.sharded_weights() {
            gathered = self.full_weight_store()?;
            &gathered
        } else {
            &self.state.weights
        };
        // Evaluation batches may not split evenly over tokens: no sequence parallelism.
        let tp = self.mesh.tp_comm(false, None);
        let ep = self.mesh.ep_comm(None);
        let report = self.device.pool.install(|| {
            let shape = crate::EvalShape {
                seq_len: c.model.seq_len,
                batch: c.train.micro_batch,
                loss_chunk: c.train.loss_chunk,
                document_eos: c.data.document_eos(),
            };
            let groups = crate::EvalGroups {
                tp: tp.as_ref().map(|t| t as _),
                ep: ep.as_ref().map(|e| e as _),
                expert_bias: self.expert_bias.layers(),
            };
            let dev = self.device.dev();
            crate::evaluate((&self.model, weights), dev, file, shape, groups)
        });
        // As after a step: the ledger counts only what is in use.
        self.device.ledger.release_recycled();
        report
    }

    /// Aux-loss-free balancing's per-expert biases of the mixture-of-experts blocks, in
    /// block order (empty when the run balances with the loss alone).
    pub fn expert_bias(&self) -> Vec<Vec<f32>> {
        self.expert_bias.blocks()
    }

    /// The memory ledger now.
    pub fn memory(&self) -> LedgerSnapshot {
        self.device.ledger.snapshot()
    }

    /// The ledger's peak per category so far, by category name.
    fn memory_peaks(&self) -> std::collections::BTreeMap<&'static str, usize> {
        let m = self.memory();
        ferrotron_tensor::Category::ALL
            .iter()
            .map(|c| (c.name(), m.peak(*c)))
            .collect()
    }

    /// How the rank's ledger recycles the step's overwritten buffers (on by default;
    /// [`Recycling::Poisoned`](ferrotron_tensor::Recycling::Poisoned) proves in tests that every
    /// kernel given one overwrites all of it).
    pub fn set_recycling(&self, mode: ferrotron_tensor::Recycling) {
        self.device.ledger.set_recycling(mode);
    }
}
