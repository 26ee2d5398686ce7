//! The ferrotron engine: flat parameter, gradient and optimizer buffers; the training loop
//! with gradient accumulation, global-norm clipping, AdamW and the LR schedule; data
//! sources; Hugging Face model I/O; evaluation; metrics; the machine's matmul peak.

#![warn(missing_docs)]

pub mod checkpoint;
pub mod eval;
pub mod eval_dir;
pub mod generate;
pub mod hf;
pub mod launch;
pub mod loss_scale;
pub mod lr;
pub mod metrics;
pub mod mfu;
pub mod on_device;
pub mod optim;
pub mod run;
pub mod state;
pub mod step_report;
pub mod stop;
pub mod tensorboard;
pub mod trace_files;
pub mod trainer;

pub use eval::{evaluate, EvalGroups, EvalReport, EvalShape};
pub use ferrotron_tensor::trace::Tracer;
pub use run::{Run, RunHandle};
pub use trainer::{
    CheckpointHook, EvalHook, Init, MoeStats, Observe, RunSummary, SaveReport, StepHook, StepStats,
    Trainer, DOCUMENT_SPANS,
};

use std::path::PathBuf;

/// Everything that can stop a run, each naming what to fix.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Invalid configuration.
    #[error(transparent)]
    Config(#[from] ferrotron_config::ConfigError),
    /// Token data could not be used.
    #[error(transparent)]
    Data(#[from] ferrotron_data::DataError),
    /// The host matmul library asked for (`train.matmul`) could not be loaded.
    #[error(transparent)]
    Blas(#[from] ferrotron_tensor::blas::BlasError),
    /// A model directory is unusable.
    #[error("model directory {dir}: {message}")]
    Model {
        /// The directory.
        dir: PathBuf,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A file operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The run directory cannot be used (another run holds it).
    #[error("{0}")]
    RunDir(String),
    /// Training diverged: the step was not applied.
    #[error("the {what} became {value} at step {step}; the step was not applied: {hint}")]
    Diverged {
        /// Step at which it happened.
        step: usize,
        /// What became non-finite: `loss` or `gradient norm`.
        what: &'static str,
        /// The non-finite value.
        value: f64,
        /// What to change.
        hint: String,
    },
    /// A collective failed (a peer failed, timed out or disagreed).
    #[error(transparent)]
    Comm(#[from] ferrotron_comm::CommError),
    /// The parallel layout is invalid.
    #[error("{0}")]
    Layout(String),
    /// A rank of the run failed; the others stopped.
    #[error("rank {rank} failed: {reason}")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// Its error.
        reason: String,
    },
    /// A model hook failed with an error that is not a collective's.
    #[error("{0}")]
    Hook(String),
    /// A checkpoint is missing, damaged or does not fit this run.
    #[error("{0}")]
    Checkpoint(String),
    /// The compute thread pool could not be built.
    #[error("train.threads: {0}")]
    Threads(String),
    /// An evaluation's or a generation's arguments are out of range or do not fit its
    /// model or data.
    #[error("{0}")]
    Arguments(String),
}

impl From<ferrotron_parallel::ParallelError> for TrainError {
    fn from(e: ferrotron_parallel::ParallelError) -> Self {
        match e {
            ferrotron_parallel::ParallelError::Comm(c) => TrainError::Comm(c),
            ferrotron_parallel::ParallelError::Hook(h) => h.into(),
            ferrotron_parallel::ParallelError::Layout(m) => TrainError::Layout(m),
        }
    }
}

impl From<ferrotron_model::HookError> for TrainError {
    fn from(e: ferrotron_model::HookError) -> Self {
        match e.downcast::<ferrotron_comm::CommError>() {
            Ok(c) => TrainError::Comm(*c),
            Err(other) => TrainError::Hook(other.to_string()),
        }
    }
}

pub(crate) fn io_err(
    action: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> TrainError {
    let path = path.into();
    move |source| TrainError::Io {
        action,
        path,
        source,
    }
}
