//! Reading what `ferrotron train` writes: `metrics.jsonl` (one object per step) and
//! `summary.json`. Non-finite numbers are written by serde_json as `null`; they read back
//! as NaN (per-step values) or `None` (summary values).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Deserializer};

use crate::ReportError;

/// The memory-ledger categories' names, in the order reports show them (the ledger's list).
pub const MEMORY_CATEGORIES: [&str; ferrotron_config::MemoryCategory::COUNT] =
    ferrotron_config::MemoryCategory::NAMES;

/// One line of `metrics.jsonl`. Timing-breakdown fields absent from older runs read as 0.
#[derive(Debug, Clone, Deserialize)]
pub struct StepRecord {
    /// 1-based step number.
    pub step: usize,
    /// Mean token loss (NaN when the run diverged).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Learning rate.
    #[serde(default, deserialize_with = "nan_if_null")]
    pub lr: f64,
    /// Wall time of the step, seconds.
    #[serde(default, deserialize_with = "nan_if_null")]
    pub step_time_s: f64,
    /// Tokens per second of this step.
    #[serde(default, deserialize_with = "nan_if_null")]
    pub tokens_per_s: f64,
    /// Model FLOP utilisation, when a peak was known.
    #[serde(default)]
    pub mfu: Option<f64>,
    /// Time blocked on gradient reductions after backward, seconds.
    #[serde(default, deserialize_with = "nan_if_null")]
    pub reduce_exposed_s: f64,
    /// Time waiting for pipeline neighbours, seconds.
    #[serde(default, deserialize_with = "nan_if_null")]
    pub pipeline_wait_s: f64,
}

/// `summary.json`, the fields reports use (others are ignored).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Summary {
    /// Steps run.
    pub steps: usize,
    /// Loss of the last step.
    pub final_loss: Option<f64>,
    /// Mean loss of the last 10% of steps.
    pub tail_loss: Option<f64>,
    /// Median tokens per second of the whole run (all ranks together).
    pub tokens_per_s: Option<f64>,
    /// MFU at that throughput.
    pub mfu: Option<f64>,
    /// Parameters.
    pub params: Option<u64>,
    /// Peak bytes per ledger category, on rank 0.
    pub memory_peak_bytes: BTreeMap<String, u64>,
    /// Peak bytes of all categories together, on rank 0.
    pub memory_total_peak_bytes: Option<u64>,
}

fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn read_text(path: &Path) -> Result<String, ReportError> {
    std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ReportError::NoData {
                path: path.to_path_buf(),
                message: "not found: run `ferrotron train --set run.dir=DIR` to write it".into(),
            }
        } else {
            ReportError::Io {
                action: "read",
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

/// Reads every step of a `metrics.jsonl`; blank lines are skipped. Fails, naming the file
/// and line, on a malformed line, and when the file is missing or holds no step.
pub fn read_metrics(path: &Path) -> Result<Vec<StepRecord>, ReportError> {
    let text = read_text(path)?;
    let mut steps = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(line).map_err(|e| ReportError::Parse {
            path: path.to_path_buf(),
            line: Some(i + 1),
            message: format!("not a step record of `ferrotron train` ({e})"),
        })?;
        steps.push(record);
    }
    if steps.is_empty() {
        return Err(ReportError::NoData {
            path: path.to_path_buf(),
            message:
                "no step recorded (train.steps = 0, or the run failed before its first step); \
                      run at least one step"
                    .into(),
        });
    }
    Ok(steps)
}

/// Reads a `summary.json`.
pub fn read_summary(path: &Path) -> Result<Summary, ReportError> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|e| ReportError::Parse {
        path: path.to_path_buf(),
        line: None,
        message: format!("not a run summary of `ferrotron train` ({e})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ferrotron-report-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn metrics_read_with_nulls_and_missing_fields() {
        let dir = scratch("metrics");
        let path = dir.join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"step\":1,\"loss\":4.5,\"lr\":0.001,\"step_time_s\":0.5,\"tokens_per_s\":100,\"mfu\":null,\"reduce_exposed_s\":0.1,\"pipeline_wait_s\":0}\n\n{\"step\":2,\"loss\":null}\n",
        )
        .unwrap();
        let steps = read_metrics(&path).unwrap();
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].reduce_exposed_s, 0.1);
        assert!(steps[1].loss.is_nan());
        assert_eq!(steps[1].pipeline_wait_s, 0.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_metrics_name_file_and_line() {
        let dir = scratch("bad");
        let path = dir.join("metrics.jsonl");
        std::fs::write(&path, "{\"step\":1,\"loss\":1}\n{oops\n").unwrap();
        let err = read_metrics(&path).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl line 2"), "{err}");
        std::fs::write(&path, "\n").unwrap();
        let err = read_metrics(&path).unwrap_err().to_string();
        assert!(err.contains("no step recorded"), "{err}");
        let err = read_metrics(&dir.join("none.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("none.jsonl: not found"), "{err}");
        let err = read_summary(&path).unwrap_err().to_string();
        assert!(err.contains("not a run summary"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
