//! Where a run's tokens come from.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Token file (`.bin` with its `.bin.json` sidecar) or Megatron indexed dataset (its
    /// prefix: `PREFIX.bin` + `PREFIX.idx`); empty (and no blend) = the embedded synthetic
    /// corpus.
    pub path: Option<PathBuf>,
    /// Several corpora mixed by weight, `[[weight, path], …]` (each path as `path` takes
    /// it); instead of `path`. The weights are normalised to sum to 1.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub blend: Vec<(f64, PathBuf)>,
    /// Token file evaluated at the end of the run (mean next-token loss); optional.
    pub eval_path: Option<PathBuf>,
}

impl DataConfig {
    /// Whether the run reads files (`path` or `blend`) rather than the synthetic corpus.
    pub fn reads_files(&self) -> bool {
        self.path.is_some() || !self.blend.is_empty()
    }

    /// Every training corpus the run reads: `path`, or each of `blend`'s.
    pub fn training_paths(&self) -> Vec<&Path> {
        match &self.path {
            Some(p) => vec![p.as_path()],
            None => self.blend.iter().map(|(_, p)| p.as_path()).collect(),
        }
    }
}
