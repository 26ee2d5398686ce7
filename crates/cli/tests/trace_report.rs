//! `train --trace` on 8 ranks: the terminal gets the step table and the communication and
//! memory summed over the ranks; `report.txt` keeps every rank's lines; the summary's figures
//! are those of `report.json`.

mod common;
use common::{bin, run, scratch};

#[test]
fn eight_ranks_print_a_summary_and_keep_every_rank_in_the_report_file() {
    let dir = scratch("trace-report");
    let out = run(bin().args(["train", "--quiet", "--trace"]).args([
        "--set",
        &format!("run.dir={}", dir.display()),
        "--set",
        "train.steps=2",
        "--set",
        "parallel.dp=2",
        "--set",
        "parallel.tp=2",
        "--set",
        "parallel.pp=2",
        "--set",
        "train.threads=1",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    // The terminal: one row per rank, one line per collective kind, one per memory category.
    let section = |head: &str| -> Vec<String> {
        let at = stderr
            .find(head)
            .unwrap_or_else(|| panic!("{head:?} in {stderr}"));
        stderr[at..]
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with(' '))
            .map(String::from)
            .collect()
    };
    assert_eq!(section("rank   steps").len(), 8, "{stderr}");
    let kinds = section("communication volume (all 8 ranks");
    let all_reduce: Vec<&str> = kinds
        .iter()
        .find(|l| l.trim_start().starts_with("all_reduce"))
        .expect("an all_reduce line")
        .split_whitespace()
        .collect();
    let calls: u64 = all_reduce[all_reduce.len() - 4].parse().unwrap();
    assert_eq!(calls, total_calls(&report, "all_reduce"));
    let memory = section("peak memory per category over the ranks");
    assert_eq!(memory.len(), 7, "one row per memory category: {stderr}");
    let largest_weights = report["memory"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["category"] == "weights")
        .map(|r| r["measured_peak_bytes"].as_u64().unwrap())
        .max()
        .unwrap();
    let printed: f64 = memory[0]
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (printed - largest_weights as f64 / 1048576.0).abs() < 1e-3,
        "{printed}"
    );
    // The file: every rank's communication and memory lines.
    let text = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    for r in 0..8 {
        assert!(text.contains(&format!("  rank {r:>3} weights ")), "{text}");
        assert!(
            text.contains(&format!("  rank {r:>3} all_reduce ")),
            "{text}"
        );
    }
    assert!(!stderr.contains("-0.0%"), "{stderr}");
}

/// Calls of `kind` over every rank of `report.json`.
fn total_calls(report: &serde_json::Value, kind: &str) -> u64 {
    report["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["volume"].as_array().unwrap())
        .filter(|v| v["kind"] == kind)
        .map(|v| v["calls"].as_u64().unwrap())
        .sum()
}

/// Traced steps outside the steps a run trains are refused before any work, naming them.
#[test]
fn trace_steps_past_the_run_are_refused() {
    let dir = scratch("trace-steps-past");
    let out = bin()
        .args(["train", "--quiet", "--trace", "--trace-steps", "5-9"])
        .args(["--set", &format!("run.dir={}", dir.display())])
        .args(["--set", "train.steps=3"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--trace-steps 5-9: this run trains steps 1–3 (train.steps = 3)"),
        "{stderr}"
    );
    assert!(!dir.join("metrics.jsonl").exists(), "no step ran");
}
