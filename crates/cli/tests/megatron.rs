//! `prepare-data --format megatron` writes a Megatron dataset that `train` and `eval` read
//! through `data.path` exactly as the token file of the same documents; `data.blend` mixes
//! corpora from the command line, and a resume on another blend is refused.

mod common;

use std::path::Path;

use common::{bin, fails_with, losses, ok, scratch};

/// `prepare-data` of `text.txt` into `output` in `format`; its JSON report.
fn prepare(root: &Path, format: &str, output: &str) -> serde_json::Value {
    let out = ok(bin().current_dir(root).args([
        "prepare-data",
        "text.txt",
        "--lines",
        "--format",
        format,
        "-o",
        output,
        "--quiet",
    ]));
    serde_json::from_str(out.trim()).unwrap()
}

fn train(root: &Path, run: &str, sets: &[String]) -> std::process::Command {
    let mut cmd = bin();
    cmd.current_dir(root).args(["train", "--quiet"]);
    for set in [
        "model.vocab=257",
        "model.layers=2",
        "model.seq_len=32",
        "train.micro_batch=2",
        "train.steps=3",
        "checkpoint.every=3",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("run.dir={run}")])
    .chain(sets.iter().cloned())
    {
        cmd.args(["--set", &set]);
    }
    cmd
}

#[test]
fn a_prepared_megatron_dataset_trains_and_evaluates_like_its_token_file() {
    let root = scratch("megatron");
    let lines: Vec<String> = (0..400)
        .map(|i| {
            format!(
                "document {i}: the {} fox jumps over {} dogs.",
                i % 7,
                i % 13
            )
        })
        .collect();
    std::fs::write(root.join("text.txt"), lines.join("\n")).unwrap();
    let tokens = prepare(&root, "tokens", "a.bin");
    let megatron = prepare(&root, "megatron", "a_text_document");
    assert_eq!(megatron["tokens"], tokens["tokens"]);
    assert_eq!(megatron["documents"], 400);
    assert_eq!(megatron["output"], "a_text_document");
    for f in ["a_text_document.bin", "a_text_document.idx"] {
        assert!(root.join(f).exists(), "{f}");
    }
    assert!(!std::fs::read_dir(&root).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .ends_with(".tmp")));

    let data = |p: &str| vec![format!("data.path={p}")];
    ok(train(&root, "run_tokens", &data("a.bin")).args(["--save-model", "model"]));
    ok(&mut train(&root, "run_megatron", &data("a_text_document")));
    ok(&mut train(
        &root,
        "run_megatron_bin",
        &data("a_text_document.bin"),
    ));
    let want = losses(&root.join("run_tokens"));
    assert_eq!(want.len(), 3);
    assert_eq!(losses(&root.join("run_megatron")), want);
    assert_eq!(losses(&root.join("run_megatron_bin")), want);

    let eval = |data: &str| -> serde_json::Value {
        let out = ok(bin()
            .current_dir(&root)
            .args(["eval", "--model", "model", "--data", data, "--seq", "32"]));
        serde_json::from_str(out.trim()).unwrap()
    };
    let (a, b) = (eval("a.bin"), eval("a_text_document"));
    assert_eq!(a["loss"], b["loss"]);
    assert!(a["tokens"].as_u64().unwrap() > 1000);
}

#[test]
fn a_blend_trains_from_the_command_line_and_refuses_a_resume_on_another() {
    let root = scratch("blend-cli");
    std::fs::write(
        root.join("text.txt"),
        "one two three four five six\n".repeat(200),
    )
    .unwrap();
    prepare(&root, "megatron", "a");
    prepare(&root, "tokens", "b.bin");
    let blend = |wa: u32| vec![format!("data.blend=[[{wa}, \"a\"], [1, \"b.bin\"]]")];
    ok(&mut train(&root, "run", &blend(3)));
    assert_eq!(losses(&root.join("run")).len(), 3);
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root.join("run/checkpoints/step_00000003/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["data"]["kind"], "blend");
    assert_eq!(manifest["data"]["parts"][0]["data"]["kind"], "megatron");
    assert_eq!(manifest["data"]["parts"][0]["weight"], 0.75);
    let mut resume = train(&root, "run", &blend(1));
    resume.args(["--resume", "latest", "--set", "train.steps=4"]);
    fails_with(&mut resume, "--allow-data-change");
    // Both a path and a blend, or a blend naming a missing corpus: refused, naming them.
    let mut both = train(&root, "r2", &blend(1));
    both.args(["--set", "data.path=b.bin"]);
    fails_with(&mut both, "data.blend");
    let missing = vec!["data.blend=[[1, \"b.bin\"], [1, \"gone\"]]".to_owned()];
    fails_with(&mut train(&root, "r3", &missing), "gone");
    assert!(!root.join("r2").join("metrics.jsonl").exists());
    assert!(!root.join("r3").join("metrics.jsonl").exists());
}
