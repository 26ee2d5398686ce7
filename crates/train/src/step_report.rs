//! The step report: each rank's time split into compute, exposed communication, pipeline
//! bubble and other, and its communication volume per group and kind — read off the rank's
//! trace (see `ferrotron_tensor::trace`).
//!
//! - compute: spans on the compute track (layers, loss head, data, optimizer) minus the time
//!   blocked on communication inside them (tensor-parallel collectives inside a layer);
//! - exposed communication: every wait that is not a pipeline wait (tensor-parallel, data-
//!   parallel reductions, ZeRO gathers, loss and norm reductions);
//! - bubble: waits for a pipeline neighbour's activations or gradients;
//! - other: the rest of the step time, i.e. what no span covers.

use std::collections::BTreeMap;

use ferrotron_tensor::trace::{Span, Track};
use serde::Serialize;

/// Seconds of the traced steps of one rank, split by what the rank was doing.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TimeSplit {
    /// Total of the traced steps.
    pub step_s: f64,
    /// Computing (net of waits inside compute spans).
    pub compute_s: f64,
    /// Blocked on communication other than the pipeline.
    pub exposed_comm_s: f64,
    /// Blocked waiting for a pipeline neighbour.
    pub bubble_s: f64,
    /// Not covered by any span.
    pub other_s: f64,
}

/// Calls and bytes of one collective kind on one group.
#[derive(Debug, Clone, Serialize)]
pub struct Volume {
    /// The group's world ranks (or `point-to-point`).
    pub group: String,
    /// Operation (`all_reduce`, `send`, …).
    pub kind: String,
    /// Operations executed.
    pub calls: u64,
    /// Bytes this rank contributed.
    pub bytes: u64,
}

/// One rank's report.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// World rank.
    pub rank: usize,
    /// Steps traced.
    pub steps: usize,
    /// Time split.
    pub time: TimeSplit,
    /// Communication volume per group and kind.
    pub volume: Vec<Volume>,
}

/// Total length of the intersection of two sets of intervals (each set non-overlapping).
fn overlap(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

fn intervals(spans: &[Span], track: Track, keep: impl Fn(&Span) -> bool) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = spans
        .iter()
        .filter(|s| s.track == track && keep(s))
        .map(|s| (s.start_us * 1e-6, (s.start_us + s.dur_us) * 1e-6))
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The report of `rank` from its spans.
pub fn rank_report(rank: usize, spans: &[Span]) -> RankReport {
    let len = |v: &[(f64, f64)]| v.iter().map(|(a, b)| b - a).sum::<f64>();
    let steps = intervals(spans, Track::Step, |_| true);
    let compute = intervals(spans, Track::Compute, |_| true);
    let bubble = intervals(spans, Track::Wait, |s| s.cat == "pipeline");
    let exposed = intervals(spans, Track::Wait, |s| s.cat != "pipeline");
    let waits = intervals(spans, Track::Wait, |_| true);
    let step_s = len(&steps);
    let compute_s = len(&compute) - overlap(&compute, &waits);
    let (exposed_s, bubble_s) = (len(&exposed), len(&bubble));
    let time = TimeSplit {
        step_s,
        compute_s,
        exposed_comm_s: exposed_s,
        bubble_s,
        other_s: step_s - compute_s - exposed_s - bubble_s,
    };
    let mut volume: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for s in spans.iter().filter(|s| s.track == Track::Comm) {
        let arg = |k: &str| {
            s.args
                .iter()
                .find(|(key, _)| *key == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let e = volume.entry((arg("group"), s.name.clone())).or_default();
        e.0 += 1;
        e.1 += arg("bytes").parse::<u64>().unwrap_or(0);
    }
    let volume = volume
        .into_iter()
        .map(|((group, kind), (calls, bytes))| Volume {
            group,
            kind,
            calls,
            bytes,
        })
        .collect();
    RankReport {
        rank,
        steps: steps.len(),
        time,
        volume,
    }
}

/// A percentage of `whole` for a table: a rounding residue of ±0.05% prints as 0.0, not -0.0.
fn percent(part: f64, whole: f64) -> f64 {
    let v = if whole > 0.0 {
        100.0 * part / whole
    } else {
        0.0
    };
    if v.abs() < 0.05 {
        0.0
    } else {
        v
    }
}

/// The time table: one row per rank, its traced steps' total seconds and their shares.
pub fn render_steps(reports: &[RankReport]) -> String {
    let mut out = String::from("rank   steps  total s   compute   exposed comm   bubble   other\n");
    for r in reports {
        let t = &r.time;
        let pct = |x: f64| percent(x, t.step_s);
        out.push_str(&format!(
            "{:>4} {:>7} {:>8.3} {:>8.1}% {:>13.1}% {:>7.1}% {:>6.1}%\n",
            r.rank,
            r.steps,
            t.step_s,
            pct(t.compute_s),
            pct(t.exposed_comm_s),
            pct(t.bubble_s),
            pct(t.other_s)
        ));
    }
    out
}

/// The communication volume of every rank, per group and kind.
pub fn render_volume(reports: &[RankReport]) -> String {
    let mut out = String::from("\ncommunication volume (per rank, traced steps):\n");
    let mut any = false;
    for r in reports {
        for v in &r.volume {
            any = true;
            out.push_str(&format!(
                "  rank {:>3} {:<16} {:<24} {:>6} calls {:>12} bytes\n",
                r.rank, v.kind, v.group, v.calls, v.bytes
            ));
        }
    }
    if !any {
        out.push_str("  none\n");
    }
    out
}

/// The communication volume summed over the ranks, one line per kind: how many groups,
/// calls and bytes (what [`render_volume`] lists rank by rank).
pub fn render_volume_summary(reports: &[RankReport]) -> String {
    let mut kinds: BTreeMap<&str, (std::collections::BTreeSet<&str>, u64, u64)> = BTreeMap::new();
    for v in reports.iter().flat_map(|r| &r.volume) {
        let e = kinds.entry(&v.kind).or_default();
        e.0.insert(&v.group);
        e.1 += v.calls;
        e.2 += v.bytes;
    }
    let mut out = format!(
        "\ncommunication volume (all {} ranks, traced steps):\n",
        reports.len()
    );
    if kinds.is_empty() {
        out.push_str("  none\n");
    }
    for (kind, (groups, calls, bytes)) in kinds {
        let over = match groups.len() {
            1 if groups.contains("point-to-point") => "point-to-point".to_string(),
            1 => "1 group".to_string(),
            n => format!("{n} groups"),
        };
        out.push_str(&format!(
            "  {kind:<16} {over:<16} {calls:>8} calls {bytes:>14} bytes\n"
        ));
    }
    out
}

/// A text table of several ranks' reports: [`render_steps`] and [`render_volume`].
pub fn render(reports: &[RankReport]) -> String {
    render_steps(reports) + &render_volume(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(rank: usize, volume: &[(&str, &str, u64, u64)]) -> RankReport {
        RankReport {
            rank,
            steps: 1,
            time: TimeSplit {
                step_s: 2.0,
                compute_s: 1.5,
                exposed_comm_s: -1e-9,
                bubble_s: 0.5,
                other_s: 0.0,
            },
            volume: volume
                .iter()
                .map(|&(kind, group, calls, bytes)| Volume {
                    group: group.into(),
                    kind: kind.into(),
                    calls,
                    bytes,
                })
                .collect(),
        }
    }

    #[test]
    fn the_summary_sums_calls_and_bytes_per_kind_over_ranks_and_counts_groups() {
        let reports = [
            rank(
                0,
                &[
                    ("all_reduce", "[0, 1]", 3, 100),
                    ("send", "point-to-point", 1, 8),
                ],
            ),
            rank(
                1,
                &[
                    ("all_reduce", "[0, 1]", 3, 100),
                    ("all_reduce", "[1, 3]", 2, 5),
                ],
            ),
        ];
        let s = render_volume_summary(&reports);
        let lines: Vec<Vec<&str>> = s
            .lines()
            .skip(2)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            lines,
            [
                vec!["all_reduce", "2", "groups", "8", "calls", "205", "bytes"],
                vec!["send", "point-to-point", "1", "calls", "8", "bytes"],
            ]
        );
        assert!(render_volume_summary(&[rank(0, &[])]).ends_with("  none\n"));
        assert!(render_volume(&[rank(0, &[])]).ends_with("  none\n"));
    }

    #[test]
    fn a_rounding_residue_prints_as_zero_not_minus_zero() {
        let table = render_steps(&[rank(4, &[])]);
        let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(row, ["4", "1", "2.000", "75.0%", "0.0%", "25.0%", "0.0%"]);
        assert_eq!(percent(-0.0004, 1.0), 0.0);
        assert_eq!(percent(-0.01, 1.0), -1.0);
    }
}
