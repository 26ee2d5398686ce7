//! Measurements of this machine, printed by the command line (`bench`, `bench-comm`,
//! `validate-cost`, `plan --hardware cpu-local`); this crate prints nothing:
//! - the matmul peak MFU is counted against, cached per thread count ([`peak`]);
//! - the benchmark presets and their throughput ([`presets`]), and a step's profile by
//!   kernel class ([`profile`]);
//! - each pipeline rank's idle time per schedule ([`pipeline`]);
//! - collective bandwidth over a sweep of sizes ([`comm_sweep`]) and its cache
//!   ([`comm_cache`]);
//! - for the cost model (`ferrotron_plan`): the time of each kernel shape a layout's step
//!   calls, the element-wise memory bandwidth, the fixed cost of a kernel call and of waking
//!   a pool, and how far ranks' arrivals spread ([`kernel_times`], [`hardware`]).

#![warn(missing_docs)]

pub mod comm_cache;
pub mod comm_sweep;
pub mod hardware;
pub mod kernel_times;
pub mod peak;
pub mod pipeline;
pub mod presets;
pub mod profile;
pub mod validate;

use std::path::PathBuf;

/// What can go wrong while measuring.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A compute pool, or a write of the cache, failed.
    #[error(transparent)]
    Train(#[from] ferrotron_train::TrainError),
    /// A file or directory could not be made.
    #[error("could not {action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] ferrotron_config::ConfigError),
    /// The planner refused a model, profile or layout.
    #[error(transparent)]
    Plan(#[from] ferrotron_plan::PlanError),
    /// A measuring thread failed.
    #[error("{0}")]
    Failed(String),
}
