//! Running the `ferrotron` binary from the end-to-end tests. Each test binary uses some of
//! these.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The binary under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferrotron"))
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotron-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `cmd`, asserting it did not panic.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    out
}

/// Runs `cmd`, asserting success; its stdout.
pub fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `cmd`, asserting failure with `needle` in stderr.
pub fn fails_with(cmd: &mut Command, needle: &str) {
    let out = run(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure mentioning {needle:?}"
    );
    assert!(stderr.contains(needle), "stderr lacks {needle:?}: {stderr}");
}

/// (step, loss bits) of every row of `dir/metrics.jsonl`.
pub fn losses(dir: &std::path::Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
            )
        })
        .collect()
}
