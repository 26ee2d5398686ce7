//! The training loop of one rank: micro-batches with gradient accumulation, the loss as the
//! mean over every token of the global batch, global-norm clipping, AdamW, LR schedule.

use std::time::Instant;

use ferrotron_config::Config;
use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::{DataSource, FileSampler, TokenFile};
use ferrotron_model::{Llama, StepCtx};
use ferrotron_tensor::{Category, CpuBackend, Ledger, LedgerSnapshot};
use serde::Serialize;

use crate::lr::LrSchedule;
use crate::state::{store_dtype, TrainState};
use crate::TrainError;

/// What one optimizer step measured.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    /// 1-based step number.
    pub step: usize,
    /// Mean token loss over the global batch (nats).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the global batch.
    pub tokens: usize,
    /// Wall time of the step (seconds).
    pub step_time_s: f64,
    /// Tokens per second of this step.
    pub tokens_per_s: f64,
    /// Model FLOP utilisation against the measured matmul peak (None when no peak is known).
    pub mfu: Option<f64>,
}

/// The end-of-run summary written to `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Steps run.
    pub steps: usize,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Mean loss over the last 10% of steps (at least one).
    pub tail_loss: f64,
    /// Mean next-token loss on `data.eval_path`, when set.
    pub eval_loss: Option<f64>,
    /// Median tokens per second over the steps after the first.
    pub tokens_per_s: f64,
    /// MFU at that throughput, against `peak_gflops`.
    pub mfu: Option<f64>,
    /// The matmul peak MFU is measured against (GFLOP/s, measured on this machine).
    pub peak_gflops: Option<f64>,
    /// Training FLOPs per token (causal half of attention counted).
    pub flops_per_token: f64,
    /// Parameters Ψ.
    pub params: usize,
    /// Peak bytes per ledger category.
    pub memory_peak_bytes: std::collections::BTreeMap<String, usize>,
    /// Peak bytes of all categories together.
    pub memory_total_peak_bytes: usize,
}

/// One rank's trainer.
pub struct Trainer {
    /// The validated configuration.
    pub config: Config,
    /// The model.
    pub model: Llama,
    /// The memory ledger of this rank.
    pub ledger: Ledger,
    /// Weights, gradients, optimizer states.
    pub state: TrainState,
    /// Measured matmul peak in FLOP/s, the MFU denominator.
    pub peak_flops: Option<f64>,
    data: Box<dyn DataSource>,
    pool: rayon::ThreadPool,
    backend: CpuBackend,
    schedule: LrSchedule,
    step: usize,
}

/// The token source a config names: the token file, or the embedded synthetic corpus.
pub fn open_data(config: &Config) -> Result<Box<dyn DataSource>, TrainError> {
    match &config.data.path {
        None => Ok(Box::new(SyntheticCorpus::new(
            config.model.vocab,
            config.train.seed,
        ))),
        Some(path) => {
            let file = TokenFile::open(path)?;
            file.check_vocab(config.model.vocab)?;
            Ok(Box::new(FileSampler::new(
                file,
                config.model.seq_len,
                config.train.seed,
            )?))
        }
    }
}

/// A rayon pool of `threads` workers (0 = one per core).
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool, TrainError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Threads(e.to_string()))
}

impl Trainer {
    /// A trainer with weights from the layout-independent initialisation.
    pub fn new(config: Config) -> Result<Self, TrainError> {
        Self::build(config, None)
    }

    /// A trainer starting from `weights` (full fp32 values in layout order).
    pub fn with_weights(config: Config, weights: &[f32]) -> Result<Self, TrainError> {
        Self::build(config, Some(weights))
    }

    fn build(config: Config, weights: Option<&[f32]>) -> Result<Self, TrainError> {
        config.validate()?;
        let data = open_data(&config)?;
        let pool = thread_pool(config.train.threads)?;
        let ledger = Ledger::new();
        let model = Llama::new(&config.model);
        let layout = model.layout.clone();
        let state = match weights {
            Some(w) => TrainState::new(&ledger, layout, w, &config.train),
            None => pool.install(|| TrainState::initialised(&ledger, layout, &config.train)),
        };
        let t = &config.train;
        let schedule = LrSchedule {
            peak: t.lr,
            floor: t.min_lr,
            warmup: t.warmup_steps,
            total: t.steps,
        };
        Ok(Trainer {
            config,
            model,
            ledger,
            state,
            peak_flops: None,
            data,
            pool,
            backend: CpuBackend,
            schedule,
            step: 0,
        })
    }

    /// Runs `f` on this trainer's compute thread pool.
    pub fn in_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Compute threads of this trainer.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// Training FLOPs per token, causal half of attention counted.
    pub fn flops_per_token(&self) -> f64 {
        self.config.model.train_flops_per_token(true)
    }

    /// One optimizer step over `grad_accum` micro-batches.
    pub fn step(&mut self) -> Result<StepStats, TrainError> {
        let start = Instant::now();
        let c = &self.config;
        let (b, s, m) = (c.train.micro_batch, c.model.seq_len, c.train.grad_accum);
        let tokens = b * s * m;
        let scale = 1.0 / tokens as f32;
        let ctx = StepCtx {
            ledger: &self.ledger,
            backend: &self.backend,
            act_dtype: store_dtype(c.train.dtype),
            loss_chunk: c.train.loss_chunk,
        };
        let mut sample = self.ledger.zeros::<u32>(Category::Workspace, s + 1);
        let mut inputs = self.ledger.zeros::<u32>(Category::Workspace, b * s);
        let mut targets = self.ledger.zeros::<u32>(Category::Workspace, b * s);
        let mut loss_sum = 0.0;
        let (model, state, data, step) = (&self.model, &mut self.state, &self.data, self.step);
        self.pool.install(|| {
            for micro in 0..m {
                for row in 0..b {
                    // The global sample index depends on (step, micro-batch, row) only.
                    let index = ((step * m + micro) * b + row) as u64;
                    data.sample(index, &mut sample);
                    inputs[row * s..(row + 1) * s].copy_from_slice(&sample[..s]);
                    targets[row * s..(row + 1) * s].copy_from_slice(&sample[1..]);
                }
                loss_sum += model.forward_backward(
                    &ctx,
                    &state.weights,
                    Some(&mut state.grads),
                    &inputs,
                    &targets,
                    scale,
                );
            }
        });
        let loss = loss_sum / tokens as f64;
        if !loss.is_finite() {
            return Err(TrainError::Diverged {
                step: step + 1,
                loss,
            });
        }
        let lr = self.schedule.at(step);
        let train = self.config.train.clone();
        let grad_norm = self
            .pool
            .install(|| self.state.optimizer_step(&train, lr, (step + 1) as u64));
        self.step += 1;
        let step_time_s = start.elapsed().as_secs_f64();
        let tokens_per_s = tokens as f64 / step_time_s;
        let mfu = self
            .peak_flops
            .map(|p| tokens_per_s * self.flops_per_token() / p);
        Ok(StepStats {
            step: self.step,
            loss,
            lr,
            grad_norm,
            tokens,
            step_time_s,
            tokens_per_s,
            mfu,
        })
    }

    /// Runs every remaining step, calling `observe` after each.
    pub fn run(
        &mut self,
        mut observe: impl FnMut(&StepStats),
    ) -> Result<Vec<StepStats>, TrainError> {
        let mut all = Vec::with_capacity(self.config.train.steps);
        while self.step < self.config.train.steps {
            let stats = self.step()?;
            observe(&stats);
            all.push(stats);
        }
        Ok(all)
    }

    /// Mean next-token loss of the current weights on a token file (see [`crate::evaluate`]).
    pub fn evaluate(&self, file: &TokenFile) -> Result<crate::EvalReport, TrainError> {
        let c = &self.config;
        self.pool.install(|| {
            crate::evaluate(
                &self.model,
                &self.state.weights,
                &self.ledger,
                file,
                c.model.seq_len,
                c.train.micro_batch,
                c.train.loss_chunk,
            )
        })
    }

    /// The memory ledger now.
    pub fn memory(&self) -> LedgerSnapshot {
        self.ledger.snapshot()
    }

    /// Builds the run summary from the steps' statistics.
    pub fn summary(&self, steps: &[StepStats], eval_loss: Option<f64>) -> RunSummary {
        let mut tps: Vec<f64> = steps.iter().skip(1).map(|s| s.tokens_per_s).collect();
        if tps.is_empty() {
            tps = steps.iter().map(|s| s.tokens_per_s).collect();
        }
        tps.sort_by(|a, b| a.total_cmp(b));
        let median = tps.get(tps.len() / 2).copied().unwrap_or(0.0);
        let tail = (steps.len() / 10).max(1).min(steps.len().max(1));
        let tail_loss = if steps.is_empty() {
            f64::NAN
        } else {
            steps[steps.len() - tail..]
                .iter()
                .map(|s| s.loss)
                .sum::<f64>()
                / tail as f64
        };
        let mem = self.memory();
        RunSummary {
            steps: steps.len(),
            final_loss: steps.last().map(|s| s.loss).unwrap_or(f64::NAN),
            tail_loss,
            eval_loss,
            tokens_per_s: median,
            mfu: self.peak_flops.map(|p| median * self.flops_per_token() / p),
            peak_gflops: self.peak_flops.map(|p| p / 1e9),
            flops_per_token: self.flops_per_token(),
            params: self.model.layout.total,
            memory_peak_bytes: Category::ALL
                .iter()
                .map(|c| (c.name().to_string(), mem.peak(*c)))
                .collect(),
            memory_total_peak_bytes: mem.total_peak,
        }
    }
}
