//! The process's memory beside the ledger's. When the ranks of a run (ranks as threads: all
//! of them) have finished, the growth of the process's peak RSS over the run (`VmHWM` at the
//! end − `VmRSS` when `train` started) is set beside the sum of their ledgers' peaks, in
//! `summary.json` (`process_memory`) and on stderr.
//!
//! The difference is what the ledger does not count: the binary's pages touched after start,
//! thread stacks, `gemm`'s packing buffers, the data's pages, the allocator's own overhead —
//! and, the other way, buffers allocated but never written, which take no resident memory.

use std::path::Path;

use ferrotron_bench::presets::peak_rss_bytes;
use ferrotron_train::metrics::write_json;
use serde_json::json;

use crate::{say, Console};

const MIB: f64 = (1 << 20) as f64;

/// Adds the process's memory to `<dir>/summary.json` and prints it: `baseline` is the RSS
/// when `train` started, `ledger_peaks` the ledger's peak of every rank of this process.
pub fn report(
    dir: &Path,
    baseline: Option<u64>,
    ledger_peaks: &[usize],
    console: &dyn Console,
) -> Result<(), String> {
    let (Some(base), Some(peak)) = (baseline, peak_rss_bytes()) else {
        return Ok(());
    };
    let path = dir.join("summary.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(());
    };
    if ledger_peaks.is_empty() {
        return Ok(());
    }
    let mut summary: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let ledger: usize = ledger_peaks.iter().sum();
    let growth = peak.saturating_sub(base);
    summary["process_memory"] = json!({
        "baseline_rss_bytes": base,
        "peak_rss_bytes": peak,
        "peak_rss_growth_bytes": growth,
        "ledger_peak_bytes": ledger,
        "ranks": ledger_peaks.len(),
    });
    write_json(&path, &summary).map_err(|e| e.to_string())?;
    say!(
        console,
        "process memory: peak RSS grew {:.1} MiB over the run; the ledger's peak is {:.1} MiB \
         ({} rank{}; {:+.1}%)",
        growth as f64 / MIB,
        ledger as f64 / MIB,
        ledger_peaks.len(),
        if ledger_peaks.len() == 1 {
            ""
        } else {
            "s, summed"
        },
        100.0 * (growth as f64 - ledger as f64) / ledger.max(1) as f64
    );
    Ok(())
}
