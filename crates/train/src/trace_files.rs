//! A traced run's files (`train --trace`): where this process's ranks leave their timelines
//! and ledger peaks as they finish, and the Chrome trace, step report (`report.json`,
//! `report.txt`) and charts written from them.

use std::sync::Mutex;
use std::time::Instant;

use ferrotron_config::Config;
use ferrotron_data::token_file::write_atomic;
use ferrotron_plan::{estimate, Job};
use ferrotron_tensor::trace::{chrome_trace_json_with_memory, MemorySample, Span, Tracer};
use ferrotron_tensor::{Category, LedgerSnapshot};

use crate::metrics::write_json;
use crate::step_report::{rank_report, render, render_steps, render_volume_summary, RankReport};
use crate::{TrainError, Trainer};

/// What this process's ranks leave as they finish: their timelines (on one origin, so the
/// ranks line up), memory samples and ledger peaks.
pub struct TraceSink {
    origin: Instant,
    steps: Option<(usize, usize)>,
    ranks: Mutex<Vec<(usize, Vec<Span>)>>,
    /// (rank, pipeline stage, peak bytes per category) of every traced rank.
    memory: Mutex<Vec<(usize, usize, LedgerSnapshot)>>,
    /// (rank, memory samples over the traced steps) of every traced rank.
    timelines: Mutex<Vec<(usize, Vec<MemorySample>)>>,
    /// The ledger's peak bytes (all categories) of every rank of this process, traced or not.
    ledger_peaks: Mutex<Vec<usize>>,
}

impl TraceSink {
    /// A sink for ranks tracing `steps` (first, last; None: no trace), timed from `origin`.
    pub fn new(origin: Instant, steps: Option<(usize, usize)>) -> TraceSink {
        TraceSink {
            origin,
            steps,
            ranks: Mutex::default(),
            memory: Mutex::default(),
            timelines: Mutex::default(),
            ledger_peaks: Mutex::default(),
        }
    }

    /// The origin every rank's timeline is measured from.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// The steps traced (first, last), if any.
    pub fn steps(&self) -> Option<(usize, usize)> {
        self.steps
    }

    /// Takes `trainer`'s timeline, memory samples and peaks from `tracer` (after its last step).
    pub fn collect(&self, trainer: &Trainer, tracer: &Tracer) {
        let rank = trainer.rank();
        unpoisoned(&self.ranks).push((rank, tracer.take()));
        let stage = trainer.pipeline.as_ref().map(|p| p.rank).unwrap_or(0);
        unpoisoned(&self.memory).push((rank, stage, trainer.memory()));
        unpoisoned(&self.timelines).push((rank, tracer.take_memory()));
    }

    /// Records a rank's ledger peak (all categories), traced or not.
    pub fn record_peak(&self, bytes: usize) {
        unpoisoned(&self.ledger_peaks).push(bytes);
    }

    /// The ledger peaks recorded so far (taken).
    pub fn take_peaks(&self) -> Vec<usize> {
        std::mem::take(&mut *unpoisoned(&self.ledger_peaks))
    }

    /// Writes the trace files of the ranks traced (in rank order) into `config.run.dir`,
    /// named `trace` (or `trace-rank<R>` for `per_process`, one process per rank); the step
    /// report for the terminal, or None when no rank was traced.
    ///
    /// # Errors
    ///
    /// [`TrainError::Io`] and the write errors of the files.
    pub fn write(self, config: &Config, per_process: bool) -> Result<Option<String>, TrainError> {
        let mut ranks = self.ranks.into_inner().unwrap_or_else(|e| e.into_inner());
        if ranks.is_empty() {
            return Ok(None);
        }
        ranks.sort_by_key(|(r, _)| *r);
        let name = match per_process {
            true => format!("trace-rank{}", ranks[0].0),
            false => "trace".into(),
        };
        let mut memory = self.memory.into_inner().unwrap_or_else(|e| e.into_inner());
        memory.sort_by_key(|(r, _, _)| *r);
        let mut timelines = self
            .timelines
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        timelines.sort_by_key(|(r, _)| *r);
        write_trace(config, &name, &ranks, &memory, &timelines).map(Some)
    }
}

/// One row of the report's memory table: a rank's measured peak against the estimator.
#[derive(serde::Serialize)]
struct MemoryRow {
    rank: usize,
    category: &'static str,
    measured_peak_bytes: usize,
    predicted_bytes: Option<u64>,
}

/// The lock's contents: a rank that panicked while pushing left them whole (a push either
/// happened or not).
fn unpoisoned<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes `<dir>/<name>.json` (Chrome trace) and the step report (`report.json`, `report.txt`
/// with the `name`'s suffix) for the ranks traced in this process; the report for the
/// terminal.
fn write_trace(
    config: &Config,
    name: &str,
    ranks: &[(usize, Vec<Span>)],
    memory: &[(usize, usize, LedgerSnapshot)],
    timelines: &[(usize, Vec<MemorySample>)],
) -> Result<String, TrainError> {
    let dir = &config.run.dir;
    std::fs::create_dir_all(dir).map_err(crate::io_err("create directory", dir))?;
    write_atomic(
        &dir.join(format!("{name}.json")),
        chrome_trace_json_with_memory(ranks, timelines).as_bytes(),
    )?;
    let reports: Vec<RankReport> = ranks
        .iter()
        .map(|(r, spans)| rank_report(*r, spans))
        .collect();
    let suffix = name.strip_prefix("trace").unwrap_or("");
    let mut text = render(&reports);
    // Throughput of the whole run, from rank 0's summary (written before the traces).
    let summary: Option<serde_json::Value> = std::fs::read_to_string(dir.join("summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let throughput = summary.as_ref().map(|s| {
        format!(
            "\nthroughput: {:.0} tokens/s (median step), MFU {:.1}% of the measured matmul peak\n",
            s["tokens_per_s"].as_f64().unwrap_or(0.0),
            100.0 * s["mfu"].as_f64().unwrap_or(0.0)
        )
    });
    text.push_str(throughput.as_deref().unwrap_or(""));
    let rows = memory_rows(config, memory, &mut text);
    let report_txt = dir.join(format!("report{suffix}.txt"));
    write_json(
        &dir.join(format!("report{suffix}.json")),
        &serde_json::json!({ "ranks": reports, "memory": rows, "summary": summary }),
    )?;
    write_atomic(&report_txt, text.as_bytes())?;
    write_charts(config, suffix, &reports, timelines)?;
    // The terminal gets the whole report for one or two ranks; for more, the communication
    // and memory summed over the ranks, and the file has every rank's lines.
    let terminal = if reports.len() <= 2 {
        text
    } else {
        format!(
            "{}{}{}{}every rank's communication and memory: {}\n",
            render_steps(&reports),
            render_volume_summary(&reports),
            throughput.unwrap_or_default(),
            memory_summary(&rows),
            report_txt.display()
        )
    };
    Ok(format!(
        "step report (traced steps):\n{terminal}trace: {}",
        dir.join(format!("{name}.json")).display()
    ))
}

/// Per category, the largest measured peak over the ranks and the largest distance from the
/// estimator's prediction for a rank, with the ranks they occur on.
fn memory_summary(rows: &[MemoryRow]) -> String {
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let mut out = String::from(
        "\npeak memory per category over the ranks, measured (ledger) vs predicted (ferrotron estimate), MiB:\n",
    );
    for cat in Category::ALL {
        let of: Vec<&MemoryRow> = rows.iter().filter(|r| r.category == cat.name()).collect();
        let Some(top) = of.iter().max_by_key(|r| r.measured_peak_bytes) else {
            continue;
        };
        let gap = |r: &&&MemoryRow| {
            r.predicted_bytes
                .map(|p| (r.measured_peak_bytes as f64 - p as f64).abs())
                .unwrap_or(0.0)
        };
        let far = of
            .iter()
            .max_by(|a, b| gap(a).total_cmp(&gap(b)))
            .unwrap_or(top);
        let predicted = |r: &MemoryRow| {
            r.predicted_bytes
                .map(|p| format!("{:.3}", mib(p as f64)))
                .unwrap_or_else(|| "n/a".into())
        };
        let furthest = match gap(&far) {
            0.0 => "every rank as predicted".to_string(),
            _ => format!(
                "furthest from prediction: rank {} {:.3} vs {}",
                far.rank,
                mib(far.measured_peak_bytes as f64),
                predicted(far)
            ),
        };
        out.push_str(&format!(
            "  {:<14} largest {:>10.3} (rank {}, predicted {})   {furthest}\n",
            cat.name(),
            mib(top.measured_peak_bytes as f64),
            top.rank,
            predicted(top),
        ));
    }
    out
}

/// Peak memory per category of each traced rank against the estimator's prediction for the
/// rank's stage: the report's rows, and their table appended to `text`.
fn memory_rows(
    config: &Config,
    memory: &[(usize, usize, LedgerSnapshot)],
    text: &mut String,
) -> Vec<MemoryRow> {
    let estimate = Job::from_config(config).and_then(|job| estimate(&job)).ok();
    let mut rows = Vec::new();
    text.push_str(
        "\npeak memory per category, measured (ledger) vs predicted (ferrotron estimate), MiB:\n",
    );
    let mib = |b: f64| b / (1u64 << 20) as f64;
    for (rank, stage, snap) in memory {
        let predicted = estimate
            .as_ref()
            .and_then(|e| e.stages.iter().find(|s| s.stage == *stage))
            .map(|s| &s.memory);
        for cat in Category::ALL {
            let p = predicted.map(|m| m.get(cat));
            rows.push(MemoryRow {
                rank: *rank,
                category: cat.name(),
                measured_peak_bytes: snap.peak(cat),
                predicted_bytes: p,
            });
            let p = p
                .map(|p| format!("{:>10.3}", mib(p as f64)))
                .unwrap_or_else(|| "n/a".into());
            text.push_str(&format!(
                "  rank {rank:>3} {:<14} measured {:>10.3}  predicted {p}\n",
                cat.name(),
                mib(snap.peak(cat) as f64)
            ));
        }
    }
    rows
}

/// `ranks<suffix>.svg` (each rank's time by kind) and, for the first traced rank,
/// `memory_timeline<suffix>.svg`.
fn write_charts(
    config: &Config,
    suffix: &str,
    reports: &[RankReport],
    timelines: &[(usize, Vec<MemorySample>)],
) -> Result<(), TrainError> {
    let dir = &config.run.dir;
    let times: Vec<ferrotron_report::RankTime> = reports
        .iter()
        .map(|r| ferrotron_report::RankTime {
            rank: r.rank,
            compute: r.time.compute_s,
            exposed: r.time.exposed_comm_s,
            bubble: r.time.bubble_s,
            other: r.time.other_s,
        })
        .collect();
    write_atomic(
        &dir.join(format!("ranks{suffix}.svg")),
        ferrotron_report::ranks_svg(&times).as_bytes(),
    )?;
    if let Some((rank, samples)) = timelines.first() {
        let points: Vec<(f64, [usize; ferrotron_config::MemoryCategory::COUNT])> =
            samples.iter().map(|m| (m.at_us * 1e-6, m.bytes)).collect();
        let svg = ferrotron_report::memory_timeline_svg(*rank, &points);
        write_atomic(
            &dir.join(format!("memory_timeline{suffix}.svg")),
            svg.as_bytes(),
        )?;
    }
    Ok(())
}
