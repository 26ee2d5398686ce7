//! `ferrotron plan` end to end: the playbook's measured system, and bad flags.

mod common;

use common::{bin, fails_with, ok};

/// The playbook's 1B cell at 64 nodes (measured best 5.2% MFU), through the binary: the
/// JSON plan's best layout is within 5 points, and its step adds up, host time included.
#[test]
fn plan_as_measured_predicts_the_playbook_cell_and_shows_the_host_time() {
    let args = [
        "plan",
        "--model",
        "llama3-1b",
        "--gpus",
        "512",
        "--global-batch-tokens",
        "1048576",
        "--as-measured",
    ];
    let json = ok(bin().args(args).arg("--json"));
    let plan: serde_json::Value = serde_json::from_str(&json).unwrap();
    let cost = &plan["candidates"][0]["cost"];
    let f = |k: &str| cost[k].as_f64().unwrap_or_else(|| panic!("{k} in {cost}"));
    assert_eq!(f("host_s"), 0.11);
    let parts = f("compute_s") + f("bubble_s") + f("exposed_comm_s") + f("host_s");
    assert!((parts - f("step_s")).abs() < 1e-9 * f("step_s"), "{cost}");
    let mfu = 100.0 * f("mfu");
    assert!((mfu - 5.2).abs() <= 5.0, "{mfu}");

    let text = ok(bin().args(args));
    assert!(
        text.contains("s exposed communication + 0.110 s host"),
        "{text}"
    );
    // Without the overhead, the same layouts are faster.
    let free = ok(bin().args(args).args(["--step-overhead-ms", "0", "--json"]));
    let free: serde_json::Value = serde_json::from_str(&free).unwrap();
    assert!(free["candidates"][0]["cost"]["mfu"].as_f64().unwrap() > mfu / 100.0);
}

#[test]
fn a_negative_step_overhead_is_refused_naming_the_flag() {
    fails_with(
        bin().args([
            "plan",
            "--model",
            "llama3-1b",
            "--gpus",
            "8",
            "--global-batch-tokens",
            "1048576",
            "--step-overhead-ms=-5",
        ]),
        "--step-overhead-ms must be a finite number of milliseconds, 0 or more (got -5)",
    );
}

/// `bench-comm` on the threads backend caches what it measured, and `plan --hardware
/// cpu-local` then predicts this machine from it (and says so) instead of the placeholder.
#[test]
fn bench_comm_measures_what_plan_uses_for_this_machine() {
    let cache = common::scratch("bench-comm-cache");
    let out = ok(bin().env("XDG_CACHE_HOME", &cache).args([
        "bench-comm",
        "--ranks",
        "2",
        "--min-bytes",
        "4096",
        "--max-bytes",
        "16777216",
        "--factor",
        "4096",
    ]));
    for kind in [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
    ] {
        assert!(out.contains(&format!("| {kind} | 2 | 16 MiB |")), "{out}");
    }
    let text = std::fs::read_to_string(cache.join("ferrotron/collectives.json")).unwrap();
    let cached: serde_json::Value = serde_json::from_str(&text).unwrap();
    let (_, m) = cached.as_object().unwrap().iter().next().unwrap();
    assert_eq!(m["ranks"], 2);
    assert_eq!(m["bytes"], 16 << 20);
    let all_reduce = m["all_reduce_gbps"].as_f64().unwrap();
    assert!(
        all_reduce > 0.0 && m["latency_us"].as_f64().unwrap() > 0.0,
        "{m}"
    );

    let plan = |cache_home: &std::path::Path| {
        ok(bin().env("XDG_CACHE_HOME", cache_home).args([
            "plan",
            "--model",
            "tiny",
            "--gpus",
            "4",
            "--hardware",
            "cpu-local",
            "--seq",
            "64",
            "--global-batch-tokens",
            "1024",
        ]))
    };
    let measured = plan(&cache);
    assert!(
        measured.contains(&format!("all-reduce {all_reduce:.2}"))
            && measured.contains("measured by `ferrotron bench-comm` (2 ranks, 16 MiB)"),
        "{measured}"
    );
    let placeholder = plan(&common::scratch("empty-cache"));
    assert!(!placeholder.contains("bench-comm"), "{placeholder}");
    // Its prediction assumes one thread per rank (the kernels' timing), and the overrides
    // it prints say so, so that `train` runs what it predicted.
    let overrides = measured
        .lines()
        .find(|l| l.starts_with("as overrides:"))
        .expect("an overrides line");
    assert!(overrides.contains("--set train.threads=1"), "{overrides}");

    // A damaged entry is ignored, with a note naming the file and the fix.
    let mut damaged = cached.clone();
    for entry in damaged.as_object_mut().unwrap().values_mut() {
        entry["all_reduce_gbps"] = serde_json::json!(0.0);
    }
    std::fs::write(
        cache.join("ferrotron/collectives.json"),
        serde_json::to_string(&damaged).unwrap(),
    )
    .unwrap();
    let ignored = plan(&cache);
    assert!(
        ignored.contains("ignored the cached collectives in")
            && ignored.contains("rerun `ferrotron bench-comm --ranks 2`")
            && !ignored.contains("measured by `ferrotron bench-comm`"),
        "{ignored}"
    );
}

/// A layout whose batch cannot be reached is named so, whether or not it also fits in
/// memory: on 7 GPUs, no dp = 7 layout divides 256 sequences.
#[test]
fn an_unreachable_batch_is_named_even_when_memory_fails_too() {
    let text = ok(bin().args([
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "7",
        "--global-batch-tokens",
        "1048576",
    ]));
    let dp7: Vec<&str> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("DP7 "))
        .collect();
    assert!(
        dp7.iter().any(|l| l.contains("and out of memory")),
        "{text}"
    );
    for line in dp7 {
        assert!(line.contains("batch not reachable"), "{line}");
    }
}
