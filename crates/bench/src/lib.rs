//! Measurements of this machine for the cost model (`ferrotron_plan`): the time of each
//! kernel shape a layout's step calls, the element-wise memory bandwidth, the fixed cost of
//! a kernel call and of waking a pool, and how far ranks' arrivals spread
//! ([`kernel_times`]), and the collectives' measured bandwidth ([`comm_cache`]). The command line (`plan`, `validate-cost`) calls it; it prints
//! nothing.

#![warn(missing_docs)]

pub mod comm_cache;
pub mod hardware;
pub mod kernel_times;

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
    /// The planner refused a model, profile or layout.
    #[error(transparent)]
    Plan(#[from] ferrotron_plan::PlanError),
    /// A measuring thread failed.
    #[error("{0}")]
    Failed(String),
}
