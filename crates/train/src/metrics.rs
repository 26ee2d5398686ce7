//! `<run.dir>/metrics.jsonl`: one JSON object per step, each written whole with one `write`
//! and flushed, so a crash never leaves half a line; `summary.json` written atomically.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use ferrotron_data::token_file::write_atomic;
use serde::Serialize;

use crate::{io_err, RunSummary, StepStats, TrainError};

/// Appends step records to `metrics.jsonl`.
pub struct MetricsWriter {
    file: File,
    path: PathBuf,
}

impl MetricsWriter {
    /// Creates (truncates) `<dir>/metrics.jsonl`, making `dir` if needed.
    pub fn create(dir: &Path) -> Result<Self, TrainError> {
        Self::open(dir, false)
    }

    /// Opens `<dir>/metrics.jsonl`, appending to it when `append` (a resumed run) and
    /// truncating it otherwise.
    pub fn open(dir: &Path, append: bool) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        let path = dir.join("metrics.jsonl");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&path)
            .map_err(io_err("create", &path))?;
        Ok(MetricsWriter { file, path })
    }

    /// Writes one step.
    pub fn write_step(&mut self, stats: &StepStats) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(stats).expect("stats serialise");
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(io_err("write", &self.path))?;
        self.file.flush().map_err(io_err("flush", &self.path))
    }
}

/// Writes `<dir>/summary.json` atomically.
pub fn write_summary(dir: &Path, summary: &RunSummary) -> Result<(), TrainError> {
    write_json(&dir.join("summary.json"), summary)
}

/// Writes any serialisable value as pretty JSON, atomically.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<(), TrainError> {
    let mut text = serde_json::to_string_pretty(value).expect("value serialises");
    text.push('\n');
    write_atomic(path, text.as_bytes())?;
    Ok(())
}
