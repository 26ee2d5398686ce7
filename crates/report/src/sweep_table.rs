//! The results of a sweep: classifying a failed run from its exit and stderr, and
//! `sweep.csv`, one row per layout.

use crate::run_data::{Summary, MEMORY_CATEGORIES};
use crate::SweepBar;

/// What became of one layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The run finished and wrote its summary.
    Ok,
    /// The configuration refused the layout (divisibility, unsupported combination, …).
    InvalidLayout,
    /// An allocation failed, or the process was killed by signal 9 (the OOM killer).
    OutOfMemory,
    /// Any other failure.
    Crashed,
    /// The sweep received a signal and forwarded it: the run saved its checkpoint and
    /// stopped early (its summary says `interrupted`); later layouts did not run.
    Interrupted,
}

impl Status {
    /// The name used in `sweep.csv` and the chart.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::InvalidLayout => "invalid_layout",
            Status::OutOfMemory => "out_of_memory",
            Status::Crashed => "crashed",
            Status::Interrupted => "interrupted",
        }
    }
}

const INVALID_MARKERS: [&str; 3] = ["config field", "does not divide", "not supported"];
const OOM_MARKERS: [&str; 7] = [
    "memory allocation of",
    "out of memory",
    "cannot allocate memory",
    "allocation failed",
    "bad_alloc",
    "signal 9",
    "oom-kill",
];

/// Classifies a finished run: success → `Ok`; otherwise a configuration complaint on stderr
/// → `InvalidLayout`; an allocation failure on stderr or death by signal 9 → `OutOfMemory`;
/// anything else → `Crashed`.
pub fn classify(success: bool, signal: Option<i32>, stderr: &str) -> Status {
    let lower = stderr.to_lowercase();
    if success {
        Status::Ok
    } else if INVALID_MARKERS.iter().any(|m| lower.contains(m)) {
        Status::InvalidLayout
    } else if signal == Some(9) || OOM_MARKERS.iter().any(|m| lower.contains(m)) {
        Status::OutOfMemory
    } else {
        Status::Crashed
    }
}

/// The one-line reason for a failure: the `Error: …` report (with its causes), else a panic
/// message, else the last line of stderr, else `fallback` (e.g. `killed by signal 9`).
/// At most 500 characters.
pub fn error_message(stderr: &str, fallback: &str) -> String {
    // Backtraces (RUST_BACKTRACE=1) and their hints are noise in a one-line reason.
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Stack backtrace:") && !l.starts_with("stack backtrace:"))
        .filter(|l| !l.is_empty() && !l.starts_with("note: run with `RUST_BACKTRACE"))
        .collect();
    let found = if let Some(i) = lines.iter().rposition(|l| l.starts_with("Error:")) {
        let text = lines[i..].join(" ");
        text.trim_start_matches("Error:").trim().to_string()
    } else if let Some(i) = lines.iter().position(|l| l.contains("panicked at")) {
        lines[i..(i + 2).min(lines.len())].join(" ")
    } else {
        lines.last().map(|l| l.to_string()).unwrap_or_default()
    };
    let text = if found.is_empty() {
        fallback.to_string()
    } else {
        found
    };
    match text.char_indices().nth(500) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

/// One layout's line of `sweep.csv`.
#[derive(Debug, Clone)]
pub struct SweepRow {
    /// Layout name.
    pub layout: String,
    /// The layout's value of every grid key, in grid order.
    pub values: Vec<String>,
    /// Outcome.
    pub status: Status,
    /// Ranks of the layout (dp·tp·pp·cp), when its configuration could be read.
    pub world: Option<usize>,
    /// The run's `summary.json`, for successful runs.
    pub summary: Option<Summary>,
    /// Why it failed (empty when it did not).
    pub error: String,
    /// Wall time of the run, seconds.
    pub wall_s: f64,
}

impl SweepRow {
    /// Throughput of all ranks together.
    pub fn tokens_per_s(&self) -> Option<f64> {
        self.summary.as_ref().and_then(|s| s.tokens_per_s)
    }

    /// Throughput divided by the number of ranks.
    pub fn tokens_per_s_per_rank(&self) -> Option<f64> {
        Some(self.tokens_per_s()? / self.world.filter(|w| *w > 0)? as f64)
    }

    /// The row as the sweep chart draws it.
    pub fn bar(&self) -> SweepBar {
        SweepBar {
            name: self.layout.clone(),
            status: self.status.as_str().to_string(),
            tokens_per_s_per_rank: self.tokens_per_s_per_rank(),
            mfu: self.summary.as_ref().and_then(|s| s.mfu),
        }
    }

    /// One progress line: `dp2: ok, 1234 tokens/s (617 per rank), MFU 3.1%, 4.20 s`, or
    /// `tp3: invalid_layout — <reason>`.
    pub fn describe(&self) -> String {
        match (
            self.status,
            self.tokens_per_s(),
            self.tokens_per_s_per_rank(),
        ) {
            (Status::Ok, Some(all), Some(per_rank)) => {
                let mfu = self.summary.as_ref().and_then(|s| s.mfu);
                let mfu = mfu
                    .map(|m| format!(", MFU {:.1}%", m * 100.0))
                    .unwrap_or_default();
                let (name, wall) = (&self.layout, self.wall_s);
                format!("{name}: ok, {all:.0} tokens/s ({per_rank:.0} per rank){mfu}, {wall:.2} s")
            }
            (status, ..) => format!("{}: {} — {}", self.layout, status.as_str(), self.error),
        }
    }
}

/// Quotes a CSV field when it holds a comma, quote or line break (RFC 4180).
pub fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

/// `sweep.csv`: a header (`layout`, every grid key, `status`, `world`, `tokens_per_s`,
/// `tokens_per_s_per_rank`, `mfu`, `peak_memory_bytes_per_rank`, `peak_<category>_bytes`
/// per memory category, `final_loss`, `wall_s`, `error`) and one line per row; unknown
/// values are empty.
pub fn sweep_csv(keys: &[String], rows: &[SweepRow]) -> String {
    let mut header: Vec<String> = vec!["layout".into()];
    header.extend(keys.iter().cloned());
    header.extend(
        [
            "status",
            "world",
            "tokens_per_s",
            "tokens_per_s_per_rank",
            "mfu",
            "peak_memory_bytes_per_rank",
        ]
        .map(String::from),
    );
    header.extend(MEMORY_CATEGORIES.iter().map(|c| format!("peak_{c}_bytes")));
    header.extend(["final_loss", "wall_s", "error"].map(String::from));
    let mut out = header
        .iter()
        .map(|h| csv_field(h))
        .collect::<Vec<_>>()
        .join(",");
    out.push('\n');
    let num = |v: Option<f64>| {
        v.filter(|v| v.is_finite())
            .map(|v| v.to_string())
            .unwrap_or_default()
    };
    for row in rows {
        let s = row.summary.as_ref();
        let mut fields: Vec<String> = vec![row.layout.clone()];
        fields.extend(row.values.iter().cloned());
        fields.push(row.status.as_str().into());
        fields.push(row.world.map(|w| w.to_string()).unwrap_or_default());
        fields.push(num(row.tokens_per_s()));
        fields.push(num(row.tokens_per_s_per_rank()));
        fields.push(num(s.and_then(|s| s.mfu)));
        fields.push(
            s.and_then(|s| s.memory_total_peak_bytes)
                .map(|b| b.to_string())
                .unwrap_or_default(),
        );
        for c in MEMORY_CATEGORIES {
            fields.push(
                s.and_then(|s| s.memory_peak_bytes.get(c))
                    .map(|b| b.to_string())
                    .unwrap_or_default(),
            );
        }
        fields.push(num(s.and_then(|s| s.final_loss)));
        fields.push(format!("{:.3}", row.wall_s));
        fields.push(row.error.clone());
        out.push_str(
            &fields
                .iter()
                .map(|f| csv_field(f))
                .collect::<Vec<_>>()
                .join(","),
        );
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_classified_by_stderr_and_signal() {
        let tp3 =
            "Error: config field `model.kv_heads`: tp=3 does not divide kv_heads=4: choose tp";
        assert_eq!(classify(false, None, tp3), Status::InvalidLayout);
        assert_eq!(
            classify(
                false,
                None,
                "zero=2 with pipeline parallelism is not supported"
            ),
            Status::InvalidLayout
        );
        assert_eq!(
            classify(false, None, "memory allocation of 8589934592 bytes failed"),
            Status::OutOfMemory
        );
        assert_eq!(classify(false, Some(9), ""), Status::OutOfMemory);
        assert_eq!(
            classify(false, None, "rank 0 exited on signal 9 (Killed)"),
            Status::OutOfMemory
        );
        assert_eq!(
            classify(false, Some(6), "thread 'main' panicked at x.rs:1:1"),
            Status::Crashed
        );
        assert_eq!(classify(true, None, "config field"), Status::Ok);
    }

    #[test]
    fn error_messages_are_one_line() {
        let anyhow = "step 1 loss 4\nError: cannot start MPI\n\nCaused by:\n    0: no launcher\n";
        assert_eq!(
            error_message(anyhow, "x"),
            "cannot start MPI Caused by: 0: no launcher"
        );
        let panic = "thread 'main' panicked at src/a.rs:3:5:\nindex out of bounds\nnote: run with `RUST_BACKTRACE=1`\n";
        let traced = "Error: config field `x`: bad\n\nStack backtrace:\n   0: anyhow::from\n";
        assert_eq!(error_message(traced, "x"), "config field `x`: bad");
        assert_eq!(
            error_message(panic, "x"),
            "thread 'main' panicked at src/a.rs:3:5: index out of bounds"
        );
        assert_eq!(
            error_message("", "killed by signal 9"),
            "killed by signal 9"
        );
        assert_eq!(error_message(&"é".repeat(600), "").chars().count(), 501);
    }

    #[test]
    fn csv_has_a_header_and_quoted_rows() {
        let mut summary = Summary {
            tokens_per_s: Some(400.0),
            mfu: Some(0.25),
            ..Summary::default()
        };
        summary.memory_peak_bytes.insert("weights".into(), 1000);
        summary.memory_total_peak_bytes = Some(3000);
        let rows = [
            SweepRow {
                layout: "dp2".into(),
                values: vec!["2".into()],
                status: Status::Ok,
                world: Some(4),
                summary: Some(summary),
                error: String::new(),
                wall_s: 1.5,
            },
            SweepRow {
                layout: "tp3".into(),
                values: vec!["1".into()],
                status: Status::InvalidLayout,
                world: None,
                summary: None,
                error: "a, \"b\"".into(),
                wall_s: 0.0,
            },
        ];
        assert_eq!(
            rows[0].describe(),
            "dp2: ok, 400 tokens/s (100 per rank), MFU 25.0%, 1.50 s"
        );
        assert_eq!(rows[1].describe(), "tp3: invalid_layout — a, \"b\"");
        assert_eq!(rows[0].bar().tokens_per_s_per_rank, Some(100.0));
        assert_eq!(rows[1].bar().status, "invalid_layout");
        let csv = sweep_csv(&["parallel.dp".into()], &rows);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "layout,parallel.dp,status,world,tokens_per_s,tokens_per_s_per_rank,mfu,peak_memory_bytes_per_rank,peak_weights_bytes,peak_gradients_bytes,peak_optimizer_bytes,peak_activations_bytes,peak_communication_bytes,peak_workspace_bytes,peak_checkpoint_bytes,final_loss,wall_s,error");
        assert_eq!(lines[1], "dp2,2,ok,4,400,100,0.25,3000,1000,,,,,,,,1.500,");
        assert_eq!(
            lines[2],
            "tp3,1,invalid_layout,,,,,,,,,,,,,,0.000,\"a, \"\"b\"\"\""
        );
    }
}
