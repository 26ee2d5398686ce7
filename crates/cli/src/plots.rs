//! Charts of a finished training run (`loss.svg`, `memory.svg`, `time.svg`), written into
//! its run directory by `ferrotron_report`.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Reads `<run_dir>/metrics.jsonl` and `<run_dir>/summary.json` and writes `loss.svg`,
/// `memory.svg` and `time.svg` there (each atomically), returning their paths. Fails, naming
/// the file, when the metrics or the summary are missing, malformed or empty.
pub fn write_run_plots(run_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    ferrotron_report::write_run_plots(run_dir)
        .with_context(|| format!("cannot draw the charts of run {}", run_dir.display()))
}
