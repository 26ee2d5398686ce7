//! TensorBoard event files read back by the `tensorboard` Python package (EventAccumulator),
//! every scalar checked against `metrics.jsonl` and `summary.json`: a dp2 mixture-of-experts
//! run with evaluation, stopped at step 4 and resumed from its step-2 checkpoint (the events
//! of the redone steps are dropped, as metrics.jsonl's rows are).
//!
//! Needs Python with the `tensorboard` package importable (CI installs it and sets
//! PYTHONPATH), and runs only with `--features tensorboard`.
#![cfg(feature = "tensorboard")]

use std::path::Path;

mod common;

use common::{bin, ok, scratch};

fn train(dir: &Path, eval: &Path, extra: &[&str]) -> std::process::Command {
    let mut cmd = bin();
    cmd.args(["train", "--quiet"]);
    for set in [
        "model.hidden=64",
        "model.layers=2",
        "model.heads=4",
        "model.kv_heads=2",
        "model.ffn=64",
        "model.seq_len=32",
        "model.vocab=64",
        "model.experts=4",
        "model.top_k=2",
        "train.steps=4",
        "train.threads=1",
        "parallel.dp=2",
        "checkpoint.every=2",
        "checkpoint.keep=5",
    ]
    .iter()
    .chain(extra)
    {
        cmd.args(["--set", set]);
    }
    cmd.args(["--set", &format!("run.dir={}", dir.display())]);
    cmd.args(["--set", &format!("data.eval_path={}", eval.display())]);
    cmd
}

#[test]
fn tensorboard_reads_back_every_scalar_of_metrics_jsonl() {
    let root = scratch("tensorboard");
    let eval = root.join("eval.bin");
    let tokens: Vec<u32> = (0..4000u32).map(|i| (i * 7 + i / 5) % 64).collect();
    ferrotron_data::write_token_file(&eval, &tokens, 64).unwrap();
    let run = root.join("run");
    ok(&mut train(&run, &eval, &[]));
    let step2 = run.join("checkpoints/step_00000002");
    ok(train(&run, &eval, &["train.steps=6"]).args(["--resume", step2.to_str().unwrap()]));
    let out = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/tensorboard_check.py"
        ))
        .arg(&run)
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 6 steps × (5 scalars, MFU, 7 memory categories, the aux loss, 2 blocks' load) + eval.
    assert_eq!(stdout.trim(), format!("ok {} scalars", 6 * 16 + 1));
    std::fs::remove_dir_all(&root).unwrap();
}
