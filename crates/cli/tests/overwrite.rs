//! What a run may write over, through the binary: `--overwrite` replaces a previous run with
//! its checkpoints (so `--resume latest` cannot continue the replaced run), and a model
//! directory (`train --save-model`, `convert --to`) that already holds a model is refused
//! without it, then replaced whole with it.

use std::path::Path;
use std::process::Command;

mod common;

use common::{bin, fails_with, ok, run, scratch};

/// A one-rank run of `steps` steps on a 2-layer model, writing into `dir`.
fn train(dir: &Path, steps: usize) -> Command {
    let mut cmd = bin();
    cmd.args(["train", "--quiet"]);
    for set in [
        "model.layers=2",
        "model.seq_len=32",
        "train.micro_batch=2",
        &format!("train.steps={steps}"),
        &format!("run.dir={}", dir.display()),
    ] {
        cmd.args(["--set", set]);
    }
    cmd
}

fn checkpoint_folders(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn stderr(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&run(cmd).stderr).into_owned()
}

#[test]
fn overwrite_takes_the_replaced_runs_checkpoints_with_it() {
    let root = scratch("overwrite-checkpoints");
    let dir = root.join("run");
    let ckpts = dir.join("checkpoints");
    ok(train(&dir, 4).args(["--set", "checkpoint.every=2", "--set", "checkpoint.keep=5"]));
    assert_eq!(
        checkpoint_folders(&ckpts),
        ["latest", "step_00000002", "step_00000004"]
    );
    // A crashed save's leftovers go too.
    std::fs::create_dir_all(ckpts.join(".step_00000006.partial")).unwrap();
    // A fresh run in the same directory is refused, and offered to resume.
    fails_with(&mut train(&dir, 4), "--resume latest to continue it");
    // Replaced by a run that saves no checkpoint: the old ones go, other files stay.
    std::fs::write(ckpts.join("notes.txt"), "mine").unwrap();
    let said = stderr(train(&dir, 3).arg("--overwrite"));
    assert!(
        said.contains("deleted the replaced run's 3 checkpoint folder(s)"),
        "{said}"
    );
    assert_eq!(checkpoint_folders(&ckpts), ["notes.txt"]);
    // The replaced run's TensorBoard events go too: one event file, the new run's.
    let events = std::fs::read_dir(dir.join("tensorboard")).unwrap().count();
    assert_eq!(events, 1, "one event file after --overwrite");
    // Nothing to resume now: said plainly, and the refusal no longer offers it.
    fails_with(
        train(&dir, 6).args(["--resume", "latest"]),
        "--resume latest: there is no checkpoint in",
    );
    let said = stderr(&mut train(&dir, 3));
    assert!(
        said.contains("pass --overwrite to replace it, or set run.dir")
            && !said.contains("--resume"),
        "{said}"
    );
    // Checkpoints outside run.dir are not deleted: refused before any work.
    let elsewhere = root.join("elsewhere");
    let set = format!("checkpoint.dir={}", elsewhere.display());
    ok(train(&root.join("other"), 2).args(["--set", &set, "--set", "checkpoint.every=2"]));
    fails_with(
        train(&dir, 2).args(["--set", &set, "--overwrite"]),
        "outside run.dir",
    );
    assert!(elsewhere.join("step_00000002").is_dir());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_model_directory_is_replaced_only_with_overwrite() {
    let root = scratch("overwrite-model");
    let model = root.join("model");
    let model_arg = model.to_str().unwrap();
    let first = root.join("first");
    ok(train(&first, 2).args(["--set", "checkpoint.every=2", "--save-model", model_arg]));
    let weights = std::fs::read(model.join("model.safetensors")).unwrap();
    // A stale shard of some older model, which a replacement must not leave behind.
    let stale = model.join("model-00002-of-00002.safetensors");
    std::fs::write(&stale, b"stale").unwrap();
    // Refused before any work: the second run writes no metrics.
    let second = root.join("second");
    fails_with(
        train(&second, 3).args(["--save-model", model_arg]),
        "it already holds a model",
    );
    assert!(!second.join("metrics.jsonl").exists(), "training started");
    ok(train(&second, 3).args(["--save-model", model_arg, "--overwrite"]));
    assert!(!stale.exists(), "a stale shard stayed");
    let replaced = std::fs::read(model.join("model.safetensors")).unwrap();
    assert_eq!(replaced.len(), weights.len());
    assert_ne!(
        replaced, weights,
        "3 steps of training left the same weights"
    );

    // `convert`: onto a model, then onto a checkpoint root, each only with --overwrite.
    let ckpt = first.join("checkpoints").join("step_00000002");
    let export = |extra: &[&str]| {
        let mut cmd = bin();
        cmd.args([
            "convert",
            "--from",
            ckpt.to_str().unwrap(),
            "--to",
            model_arg,
        ]);
        cmd.args(extra);
        cmd
    };
    fails_with(&mut export(&[]), "it already holds a model");
    assert_eq!(
        std::fs::read(model.join("model.safetensors")).unwrap(),
        replaced
    );
    ok(&mut export(&["--overwrite"]));
    assert_eq!(
        std::fs::read(model.join("model.safetensors")).unwrap(),
        weights
    );
    let back = first.join("checkpoints");
    let import = |extra: &[&str]| {
        let mut cmd = bin();
        cmd.args([
            "convert",
            "--from",
            model_arg,
            "--to",
            back.to_str().unwrap(),
        ]);
        cmd.args(extra);
        cmd
    };
    // A checkpoint's own folder is never written over by a model.
    let onto_checkpoint = ["convert", "--from", ckpt.to_str().unwrap(), "--to"];
    fails_with(
        bin()
            .args(onto_checkpoint)
            .args([ckpt.to_str().unwrap(), "--overwrite"]),
        "it is a checkpoint's folder",
    );
    assert!(ckpt.join("rank_00000.safetensors").is_file());
    // An import that fails leaves the checkpoints it would have replaced.
    let bad = root.join("bad-hf");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("config.json"), b"{}").unwrap();
    let mut failing = bin();
    failing.args(["convert", "--from", bad.to_str().unwrap(), "--to"]);
    let out = run(failing.args([back.to_str().unwrap(), "--overwrite"]));
    assert!(!out.status.success());
    assert_eq!(checkpoint_folders(&back), ["latest", "step_00000002"]);
    fails_with(&mut import(&[]), "it already holds checkpoints");
    ok(&mut import(&["--overwrite"]));
    assert_eq!(checkpoint_folders(&back), ["latest", "step_00000000"]);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A fine-tuned model keeps the tokenizer of the model it started from, and a replaced
/// model directory loses the old one's.
#[test]
fn a_fine_tuned_model_carries_its_tokenizer_over() {
    let root = scratch("overwrite-tokenizer");
    let (base, tuned) = (root.join("base"), root.join("tuned"));
    ok(train(&root.join("r1"), 1).args(["--save-model", base.to_str().unwrap()]));
    let tokenizer = br#"{"version": "1.0", "model": {"type": "WordLevel"}}"#;
    std::fs::write(base.join("tokenizer.json"), tokenizer).unwrap();
    std::fs::write(base.join("tokenizer_config.json"), b"{}").unwrap();
    ok(train(&root.join("r2"), 1)
        .args(["--init-from", base.to_str().unwrap()])
        .args(["--save-model", tuned.to_str().unwrap()]));
    assert_eq!(
        std::fs::read(tuned.join("tokenizer.json")).unwrap(),
        tokenizer
    );
    assert!(tuned.join("tokenizer_config.json").is_file());
    // Fine-tuned in place (--init-from and --save-model the same directory): it keeps its
    // tokenizer.
    ok(train(&root.join("r4"), 1)
        .args(["--init-from", tuned.to_str().unwrap()])
        .args(["--save-model", tuned.to_str().unwrap(), "--overwrite"]));
    assert_eq!(
        std::fs::read(tuned.join("tokenizer.json")).unwrap(),
        tokenizer
    );
    // Replaced by a model trained from scratch: no tokenizer of the old one stays.
    ok(train(&root.join("r3"), 1).args(["--save-model", tuned.to_str().unwrap(), "--overwrite"]));
    assert!(!tuned.join("tokenizer.json").exists());
    assert!(!tuned.join("tokenizer_config.json").exists());
    assert!(tuned.join("model.safetensors").is_file());
    std::fs::remove_dir_all(&root).unwrap();
}

/// A model trained on text tokenized by `prepare-data` takes that tokenizer with it, so
/// `generate` reads a text prompt with it.
#[test]
fn a_model_trained_on_prepared_text_carries_its_tokenizer() {
    let root = scratch("data-tokenizer");
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(200);
    std::fs::write(root.join("text.txt"), text).unwrap();
    let tok = root.join("tok.json");
    ok(bin().current_dir(&root).args([
        "prepare-data",
        "text.txt",
        "-o",
        "text.bin",
        "--train-bpe",
        "300",
        "--save-tokenizer",
        "tok.json",
        "--quiet",
    ]));
    let sidecar: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("text.bin.json")).unwrap()).unwrap();
    let recorded = sidecar["tokenizer"].as_str().unwrap().to_string();
    assert_eq!(
        std::fs::canonicalize(&recorded).unwrap(),
        std::fs::canonicalize(&tok).unwrap()
    );
    let model = root.join("model");
    let data = format!("data.path={}", root.join("text.bin").display());
    ok(train(&root.join("run"), 2)
        .args(["--set", &data, "--set", "model.vocab=300"])
        .args(["--save-model", model.to_str().unwrap()]));
    assert_eq!(
        std::fs::read(model.join("tokenizer.json")).unwrap(),
        std::fs::read(&tok).unwrap()
    );
    // The tokenizer saved straight into the model's folder stays whole (a copy onto itself
    // would empty it), with --overwrite too.
    let home = root.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let own = home.join("tokenizer.json");
    std::fs::copy(&tok, &own).unwrap();
    let sidecar = std::fs::read_to_string(root.join("text.bin.json")).unwrap();
    let moved = sidecar.replace(&recorded, own.to_str().unwrap());
    std::fs::write(root.join("text.bin.json"), moved).unwrap();
    for (i, extra) in [&[][..], &["--overwrite"][..]].into_iter().enumerate() {
        ok(train(&root.join(format!("run{}", i + 2)), 1)
            .args(["--set", &data, "--set", "model.vocab=300"])
            .args(["--save-model", home.to_str().unwrap()])
            .args(extra));
        assert_eq!(std::fs::read(&own).unwrap(), std::fs::read(&tok).unwrap());
    }
    let out = run(bin()
        .args(["generate", "--model", model.to_str().unwrap()])
        .args(["--prompt", "the quick", "--max-new-tokens", "4"]));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !said.contains("no tokenizer.json"),
        "{said}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
