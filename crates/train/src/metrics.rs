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
        Self::open(dir, None)
    }

    /// Opens `<dir>/metrics.jsonl`: truncated for a fresh run (`resumed_at` None); for a run
    /// resumed after step `s`, the rows of steps after `s` (a later run's, or the steps a
    /// crash lost) are dropped first, the previous file kept as `metrics.jsonl.bak`, so that
    /// no step appears twice.
    pub fn open(dir: &Path, resumed_at: Option<usize>) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        let path = dir.join("metrics.jsonl");
        if let Some(step) = resumed_at {
            keep_rows_through(&path, step)?;
        }
        let append = resumed_at.is_some();
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

/// Rewrites `path` (atomically, the old file kept as `.bak`) with only its rows of steps up to
/// `step`; rows that do not parse (a torn last line) are dropped too. No file: nothing to do.
fn keep_rows_through(path: &Path, step: usize) -> Result<(), TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let step_of = |line: &str| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("step")?.as_u64())
    };
    let kept: String = text
        .lines()
        .filter(|l| step_of(l).is_some_and(|s| s as usize <= step))
        .map(|l| format!("{l}\n"))
        .collect();
    if kept == text {
        return Ok(());
    }
    let backup = path.with_extension("jsonl.bak");
    std::fs::copy(path, &backup).map_err(io_err("back up", path))?;
    write_atomic(path, kept.as_bytes())?;
    Ok(())
}

/// What `summary.json` says of a run that failed: its status, the error, and the step it
/// started from (its steps are in `metrics.jsonl`).
#[derive(Debug, Serialize)]
pub struct FailedRun {
    /// Always `failed`.
    pub status: &'static str,
    /// The error, as printed.
    pub error: String,
    /// The step the run started from (0: a fresh run).
    pub started_at_step: usize,
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
