//! The `checkpoint` section: where and how often a run saves a resumable checkpoint.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Periodic checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Directory holding one `step_NNNNNNNN/` folder per checkpoint and the `latest` pointer;
    /// empty means `<run.dir>/checkpoints`.
    pub dir: Option<PathBuf>,
    /// Save every this many steps (and after the last step); 0 disables checkpoints.
    pub every: usize,
    /// How many complete checkpoints to keep; older ones are deleted after a save succeeds.
    pub keep: usize,
    /// Save the step a run stops at early (SIGTERM, SIGINT, SIGUSR1, a library caller's
    /// stop), even with `every = 0`.
    pub on_stop: bool,
    /// Write checkpoints in the background (`checkpoint.async`): at the step boundary each
    /// rank copies what it owns to host memory (counted as `checkpoint` memory) and the next
    /// steps run while a thread writes it; at most one save is in flight (the next one, the
    /// run's end and a stop wait for it). The save of a stopped run is written at once.
    #[serde(rename = "async")]
    pub background: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            dir: None,
            every: 0,
            keep: 2,
            on_stop: true,
            background: false,
        }
    }
}

impl CheckpointConfig {
    /// The checkpoint directory of a run writing to `run_dir`.
    pub fn dir_for(&self, run_dir: &std::path::Path) -> PathBuf {
        self.dir
            .clone()
            .unwrap_or_else(|| run_dir.join("checkpoints"))
    }
}
