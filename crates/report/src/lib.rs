//! Reports of ferrotron runs and sweeps: self-contained SVG charts and sweep bookkeeping.
//!
//! - [`write_run_plots`] turns a run directory (`metrics.jsonl` + `summary.json`, as written by
//!   `ferrotron train`) into `loss.svg`, `memory.svg` and `time.svg`.
//! - [`collect`] and [`report_html`] make `ferrotron report`'s page: runs and sweeps side by
//!   side, self-contained (its data and script inline, nothing fetched).
//! - [`sweep_svg`] draws a sweep the way the Ultra-Scale Playbook compares layouts: one bar
//!   per layout with tokens/s per rank, MFU on a secondary axis, failed layouts as labelled
//!   empty slots.
//! - [`parse_grid`] / [`expand_layouts`] turn `--grid key=v1,v2` axes into named layouts;
//!   [`classify`], [`error_message`] and [`sweep_csv`] turn finished runs into `sweep.csv`;
//!   [`slurm_script`] writes a layout's batch script.
//!
//! Charts are written as plain SVG text (no plotting crate); every file is written
//! atomically (temporary file, then rename), so a reader never sees half a chart.

#![warn(missing_docs)]

mod grid;
pub mod page;
mod rank_chart;
mod run_data;
mod run_plots;
mod slurm;
pub mod svg;
mod sweep_chart;
mod sweep_table;

use std::io::Write;
use std::path::{Path, PathBuf};

pub use grid::{expand_layouts, parse_grid, GridAxis, Layout};
pub use page::{collect, report_html, PageData};
pub use rank_chart::{memory_timeline_svg, ranks_svg, RankTime};
pub use run_data::{read_metrics, read_summary, StepRecord, Summary, MEMORY_CATEGORIES};
pub use run_plots::{loss_svg, memory_svg, time_svg, write_run_plots};
pub use slurm::{check_template, shell_quote, slurm_script, SlurmJob, DEFAULT_SLURM_TEMPLATE};
pub use sweep_chart::{sweep_svg, SweepBar};
pub use sweep_table::{classify, csv_field, error_message, sweep_csv, Status, SweepRow};

/// Everything that can go wrong while reading run outputs or writing a report; every
/// variant names the file and says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be read or written.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done (`read`, `write`, …).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file exists but its content is not what `ferrotron train` writes.
    #[error("{}{}: {message}", path.display(), line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line, for line-oriented files.
        line: Option<usize>,
        /// What is wrong, naming the field when there is one.
        message: String,
    },
    /// A `--grid` argument is malformed.
    #[error("--grid `{spec}`: {message}")]
    Grid {
        /// The argument as given.
        spec: String,
        /// What is wrong and how to write it.
        message: String,
    },
    /// A file is missing or holds no data to plot.
    #[error("{}: {message}", path.display())]
    NoData {
        /// The file.
        path: PathBuf,
        /// What is missing and how to get it.
        message: String,
    },
}

/// Writes `bytes` to `path` atomically: a temporary file next to it, then a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    let io = |action: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |source| ReportError::Io {
            action,
            path: p,
            source,
        }
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name.unwrap_or_else(|| "report".to_string());
    let tmp = path.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    let mut file = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
    file.write_all(bytes).map_err(io("write", &tmp))?;
    file.sync_all().map_err(io("sync", &tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io("rename into", path)(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_and_leaves_no_temporary() {
        let dir =
            std::env::temp_dir().join(format!("ferrotron-report-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.svg");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let err = write_atomic(&dir.join("missing/x.svg"), b"x").unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
