//! A training run as `ferrotron train` starts it, as one library call: [`start`] (in the
//! background, with a handle) or [`train`] (in the caller's thread) takes the run's
//! [`TrainOptions`] and a [`Console`] for what the user reads, and owns everything between
//! the configuration and the summary:
//! - the configuration, resumed from a checkpoint or initialised from a Hugging Face model;
//! - checks before any work: output directories, the data's vocabulary, the memory the run
//!   will need, what `--overwrite` may replace;
//! - the run directory's lock, the stop signals (SIGTERM, SIGINT, SIGUSR1; with
//!   [`TrainOptions::signals`]) and [`TrainHandle::stop`];
//! - the launch: ranks as threads (on the CPU or this machine's GPUs) or this MPI process's
//!   rank;
//! - the matmul peak MFU is counted against;
//! - metrics, TensorBoard, checkpoints, evaluation, the trace, `summary.json`, the saved
//!   model and the run's charts.
//!
//! ```no_run
//! use std::sync::Arc;
//! use ferrotron_engine::{start, Outcome, Stderr, TrainOptions};
//!
//! let options = TrainOptions {
//!     set: vec!["train.steps=20".into(), "run.dir=runs/demo".into()],
//!     ..TrainOptions::default()
//! };
//! let mut run = start(&options, Arc::new(Stderr))?;
//! for step in run.by_ref() {
//!     println!("step {} loss {:.3}", step.step, step.loss);
//! }
//! match run.wait()? {
//!     Outcome::Finished(Some(summary)) => println!("final loss {:.3}", summary.final_loss),
//!     Outcome::Interrupted { stop, .. } => eprintln!("{stop}"),
//!     _ => {}
//! }
//! # Ok::<(), ferrotron_engine::EngineError>(())
//! ```
//!
//! The command line parses its arguments into [`TrainOptions`], calls [`train`] and draws
//! the progress. [`sweep`] runs a grid of layouts; [`convert`] turns a checkpoint into a
//! Hugging Face model and back. `ferrotron_train::Run` is the lighter
//! call that writes nothing to disk.

#![warn(missing_docs)]

pub mod convert;
mod drive;
mod handle;
pub mod mpi;
mod options;
pub mod overwrite;
mod peak_report;
mod pp_split;
mod process_memory;
mod resume;
mod run_lock;
mod shared;
pub mod signals;
pub mod sweep;
mod train;

use ferrotron_train::StepStats;

pub use handle::{start, TrainHandle};
pub use options::TrainOptions;
pub use run_lock::RunLock;
pub use signals::Interrupted;
pub use train::{train, Outcome};

/// What can stop a run before or while it trains.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The configuration, the data, a checkpoint or a rank's step failed.
    #[error(transparent)]
    Train(#[from] ferrotron_train::TrainError),
    /// The run's devices could not open, or the run does not fit their memory.
    #[error(transparent)]
    Devices(#[from] ferrotron_devices::DevicesError),
    /// An option or an output path was refused before any work; the message names it and
    /// the fix.
    #[error("{0}")]
    Refused(String),
    /// A launch or a measurement failed while it ran.
    #[error("{0}")]
    Failed(String),
}

impl From<ferrotron_config::ConfigError> for EngineError {
    fn from(e: ferrotron_config::ConfigError) -> Self {
        EngineError::Train(e.into())
    }
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, EngineError>;

/// Refuses with `message` unless `ok` (a check before any work).
fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<()> {
    match ok {
        true => Ok(()),
        false => Err(EngineError::Refused(message())),
    }
}

/// Where the run's words go: its notes, warnings and closing lines ([`Console::say`]), and
/// the leader's progress through its steps. Shared by every rank of the process.
pub trait Console: Send + Sync {
    /// A line for the user.
    fn say(&self, line: &str);
    /// The leader's steps begin: `done` of `total` are already trained (a resumed run).
    fn begin(&self, _done: usize, _total: usize) {}
    /// The leader finished the step `stats` describes.
    fn step(&self, _stats: &StepStats) {}
    /// The leader's steps ended (finished, stopped or failed), or a sweep's layouts did.
    fn end(&self) {}
    /// A sweep's layout `name` starts; `done` of `total` layouts have run.
    fn task(&self, _done: usize, _total: usize, _name: &str) {}
}

/// A [`Console`] that writes each line to stderr and draws no progress.
pub struct Stderr;

impl Console for Stderr {
    fn say(&self, line: &str) {
        eprintln!("{line}");
    }
}

/// `say!(console, "format", args…)`: one formatted line to a [`Console`].
macro_rules! say {
    ($console:expr, $($fmt:tt)*) => {
        $console.say(&format!($($fmt)*))
    };
}
pub(crate) use say;
