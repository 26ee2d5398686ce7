//! Checkpoints through the binary: a process killed while saving leaves the previous
//! checkpoint whole and `--resume latest` continues from it exactly; a damaged checkpoint is
//! refused before training, naming the file; `convert` goes to Hugging Face and back.

use std::path::Path;
use std::process::Command;

mod common;

use common::{
    assert_killed_in_the_save_of_step_4, assert_resumed_exactly, bin, checkpointed_run, losses, ok,
    run, scratch,
};

/// A small two-rank (dp=2, ZeRO-1) run of 6 steps writing into `dir`.
fn train(dir: &Path) -> Command {
    let mut cmd = bin();
    cmd.args(["train", "--quiet"]);
    for set in checkpointed_run(dir) {
        cmd.args(["--set", &set]);
    }
    cmd
}

#[test]
fn killed_during_save_resumes_from_the_previous_checkpoint() {
    let root = scratch("killed");
    let (straight, killed) = (root.join("straight"), root.join("killed"));
    ok(&mut train(&straight));
    let out = run(train(&killed).args(["--abort-in-save", "4"]));
    assert!(!out.status.success(), "the process was meant to die");
    let ckpts = killed.join("checkpoints");
    assert_killed_in_the_save_of_step_4(&ckpts);
    ok(train(&killed).args(["--resume", "latest"]));
    // The resumed run's saves (steps 4 and 6) kept its step loop waiting, and it says so.
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(killed.join("summary.json")).unwrap()).unwrap();
    assert!(
        summary["checkpoint_blocked_s"].as_f64().unwrap() > 0.0,
        "{summary}"
    );
    // Steps 1–4 were logged before the kill; the resume from step 2 drops the rows of steps 3
    // and 4 and logs 3–6: each step once, every loss bit-identical to the uninterrupted run's.
    assert_resumed_exactly(&straight, &killed);

    // A flipped byte is named before any training starts.
    let step4 = ckpts.join("step_00000004").join("rank_00001.safetensors");
    let mut bytes = std::fs::read(&step4).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 1;
    std::fs::write(&step4, bytes).unwrap();
    let fresh = root.join("refused");
    let out = run(train(&fresh).args(["--resume", ckpts.join("step_00000004").to_str().unwrap()]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank_00001.safetensors") && stderr.contains("SHA-256"),
        "{stderr}"
    );
    assert!(!fresh.join("metrics.jsonl").exists(), "training started");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn convert_to_hugging_face_and_back_keeps_every_tensor() {
    let root = scratch("convert");
    let run_dir = root.join("run");
    ok(train(&run_dir).args(["--set", "parallel.dp=1", "--set", "parallel.tp=2"]));
    let ckpt = run_dir.join("checkpoints").join("step_00000006");
    let hf = root.join("hf");
    ok(bin().args([
        "convert",
        "--from",
        ckpt.to_str().unwrap(),
        "--to",
        hf.to_str().unwrap(),
    ]));
    assert!(hf.join("model.safetensors").is_file() && hf.join("config.json").is_file());
    let back = root.join("back");
    ok(bin().args([
        "convert",
        "--from",
        hf.to_str().unwrap(),
        "--to",
        back.to_str().unwrap(),
    ]));
    // The re-imported checkpoint exports to byte-identical Hugging Face files.
    let hf2 = root.join("hf2");
    ok(bin().args([
        "convert",
        "--from",
        back.to_str().unwrap(),
        "--to",
        hf2.to_str().unwrap(),
    ]));
    for f in ["model.safetensors", "config.json"] {
        assert_eq!(
            std::fs::read(hf.join(f)).unwrap(),
            std::fs::read(hf2.join(f)).unwrap(),
            "{f}"
        );
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// `prepare-data` records each token file's SHA-256 (`sha256sum` of the `.bin`) in its
/// sidecar; a checkpoint records the data it consumed; a resume on another file is refused
/// before any work, naming both, unless `--allow-data-change`; a file that only moved is
/// the same data.
#[test]
fn a_resume_on_other_data_is_refused_naming_both_files() {
    let root = scratch("data-identity");
    for (name, text) in [("a", "alpha beta gamma. "), ("b", "delta epsilon zeta. ")] {
        std::fs::write(root.join(format!("{name}.txt")), text.repeat(300)).unwrap();
        ok(bin().current_dir(&root).args([
            "prepare-data",
            &format!("{name}.txt"),
            "-o",
            &format!("{name}.bin"),
            "--quiet",
        ]));
    }
    let sidecar: serde_json::Value =
        serde_json::from_slice(&std::fs::read(root.join("a.bin.json")).unwrap()).unwrap();
    let bytes = std::fs::read(root.join("a.bin")).unwrap();
    let want = {
        use sha2::Digest;
        let d = sha2::Sha256::digest(&bytes);
        d.iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    assert_eq!(sidecar["sha256"].as_str(), Some(want.as_str()));

    let run_dir = root.join("run");
    let data = |name: &str| format!("data.path={}", root.join(name).display());
    ok(train(&run_dir).args([
        "--set",
        &data("a.bin"),
        "--set",
        "train.steps=2",
        "--set",
        "model.vocab=257",
    ]));
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(run_dir.join("checkpoints/step_00000002/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["data"]["sha256"].as_str(), Some(want.as_str()));

    let resume = |name: &str| {
        let mut cmd = train(&run_dir);
        cmd.args(["--resume", "latest", "--set", &data(name)]);
        cmd
    };
    let out = run(&mut resume("b.bin"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a resume on b.bin was accepted");
    assert!(
        stderr.contains("a.bin")
            && stderr.contains("b.bin")
            && stderr.contains("--allow-data-change"),
        "{stderr}"
    );
    assert_eq!(losses(&run_dir).len(), 2, "nothing trained");
    // The same file under another name is the same data.
    std::fs::copy(root.join("a.bin"), root.join("moved.bin")).unwrap();
    std::fs::copy(root.join("a.bin.json"), root.join("moved.bin.json")).unwrap();
    ok(resume("moved.bin").args(["--set", "train.steps=3"]));
    // Asked for, the change goes through and says so.
    let out = run(resume("b.bin")
        .arg("--allow-data-change")
        .args(["--set", "train.steps=4"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--allow-data-change: continuing on"),
        "{stderr}"
    );
    assert_eq!(losses(&run_dir).len(), 4);
    std::fs::remove_dir_all(&root).unwrap();
}
