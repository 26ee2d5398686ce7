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

/// A run killed while saving step 4 of 6 (saving every 2): `latest` still names step 2 and
/// the save of step 4 is left partial, never renamed into place.
pub fn assert_killed_in_the_save_of_step_4(ckpts: &std::path::Path) {
    assert_eq!(
        std::fs::read_to_string(ckpts.join("latest")).unwrap(),
        "step_00000002\n"
    );
    assert!(ckpts.join(".step_00000004.partial").is_dir());
    assert!(!ckpts.join("step_00000004").exists());
}

/// That run resumed to the end: steps 1–6 logged once each, every loss bit-identical to the
/// uninterrupted run's in `straight`, no partial save left and `latest` at step 6.
pub fn assert_resumed_exactly(straight: &std::path::Path, killed: &std::path::Path) {
    let want = losses(straight);
    let got = losses(killed);
    let steps: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    for (step, bits) in got {
        assert_eq!(bits, want[step as usize - 1].1, "step {step}");
    }
    let ckpts = killed.join("checkpoints");
    assert!(!ckpts.join(".step_00000004.partial").exists());
    assert_eq!(
        std::fs::read_to_string(ckpts.join("latest")).unwrap(),
        "step_00000006\n"
    );
}

/// The `--set`s of a small two-rank (dp=2, ZeRO-1) run of 6 steps saving a checkpoint every
/// 2 (keeping 5), writing into `dir`.
pub fn checkpointed_run(dir: &std::path::Path) -> Vec<String> {
    let mut sets: Vec<String> = [
        "model.layers=2",
        "model.seq_len=32",
        "train.micro_batch=2",
        "train.steps=6",
        "parallel.dp=2",
        "parallel.zero=1",
        "checkpoint.every=2",
        "checkpoint.keep=5",
    ]
    .map(String::from)
    .to_vec();
    sets.push(format!("run.dir={}", dir.display()));
    sets
}
