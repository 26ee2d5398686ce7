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
