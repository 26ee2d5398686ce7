//! `validate-cost` end to end on the tiny size: each layout trained and predicted, a table
//! row per layout with positive figures, the prediction within a factor of two of the
//! measurement (a sanity bound for a shared CI machine; docs/cost-model.md's table is the accuracy
//! claim), the kernel times cached in the cache directory it is given, and bad arguments
//! refused before any work.

mod common;

use std::sync::Mutex;

use common::{bin, fails_with, ok, scratch};

/// The tests that time kernels run one at a time: two at once on a 2-core machine put four
/// ranks' threads on two cores, and a fork-join kernel whose thread loses its core for a
/// time slice reads many times its time (one CI run predicted tiny dp1 8× too slow).
static TIMING: Mutex<()> = Mutex::new(());

/// `validate-cost` on the tiny size, 2 timed steps, one round, of the layouts named like
/// `only`, with its cache and runs under `dir`; its standard output.
fn validate_cost(dir: &std::path::Path, only: &str, extra: &[&str]) -> String {
    ok(bin()
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .args([
            "validate-cost",
            "--sizes",
            "tiny",
            "--steps",
            "2",
            "--rounds",
            "1",
        ])
        .args(["--only", only])
        .args(extra)
        .arg("--dir")
        .arg(dir.join("runs")))
}

#[test]
fn validate_cost_measures_and_predicts_each_layout() {
    let _one_at_a_time = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("validate-cost");
    let cache = dir.join("cache");
    let out = validate_cost(&dir, "dp1", &[]);
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("| tiny |")).collect();
    // "dp1" and "dp1 full recompute".
    assert_eq!(rows.len(), 2, "{out}");
    for row in rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let measured: f64 = cells[3].parse().unwrap();
        let predicted: f64 = cells[4].parse().unwrap();
        assert!(measured > 0.0 && predicted > 0.0, "{row}");
        let ratio = predicted / measured;
        assert!((0.5..=2.0).contains(&ratio), "{row}");
    }
    assert!(out.contains("2 layouts (one run each): median"), "{out}");
    let times = std::fs::read_to_string(cache.join("ferrotron/kernel_times.json")).unwrap();
    assert!(times.contains("backward_weight"), "{times}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A two-rank layout: its prediction within a factor of two of the measurement, and the
/// ranks' arrival skew measured into the cache for its 2 ranks, a finite fraction of 0 or
/// more at each of its 4 segment lengths, in ascending order.
#[test]
fn validate_cost_measures_the_ranks_arrival_skew() {
    let _one_at_a_time = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("validate-cost-skew");
    let cache = dir.join("cache");
    let out = validate_cost(&dir, "tp2 sp", &["--min-seconds", "0"]);
    let row = out
        .lines()
        .find(|l| l.starts_with("| tiny | tp2 sp |"))
        .unwrap_or_else(|| panic!("{out}"));
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    let ratio = cells[4].parse::<f64>().unwrap() / cells[3].parse::<f64>().unwrap();
    assert!((0.5..=2.0).contains(&ratio), "{row}");
    let text = std::fs::read_to_string(cache.join("ferrotron/kernel_times.json")).unwrap();
    let times: serde_json::Value = serde_json::from_str(&text).unwrap();
    let entry = times
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.contains("| 2 ranks |"))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("{text}"));
    let skew = entry["skew"].as_array().unwrap();
    assert_eq!(skew.len(), 4, "{skew:?}");
    let lengths: Vec<f64> = skew.iter().map(|p| p[0].as_f64().unwrap()).collect();
    assert!(lengths.windows(2).all(|w| w[0] < w[1]), "{skew:?}");
    for point in skew {
        let (seg, frac) = (point[0].as_f64().unwrap(), point[1].as_f64().unwrap());
        // A fraction, finite and not negative (a loaded CI machine may see one above 1 at
        // the shortest segments).
        assert!(seg > 0.0 && frac.is_finite() && frac >= 0.0, "{skew:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn validate_cost_refuses_bad_arguments() {
    fails_with(
        bin().args(["validate-cost", "--sizes", "huge"]),
        "--sizes: unknown size `huge`",
    );
    fails_with(bin().args(["validate-cost", "--steps", "0"]), "--steps 0");
    fails_with(bin().args(["validate-cost", "--rounds", "0"]), "--rounds 0");
    fails_with(
        bin().args(["validate-cost", "--min-seconds=-1"]),
        "--min-seconds -1",
    );
}
