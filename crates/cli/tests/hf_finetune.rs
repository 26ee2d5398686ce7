//! End-to-end with a model transformers made (the Mixtral fixture of
//! `scripts/hf-fixtures.py`): `eval` of the directory on a token file of the fixture's batch
//! gives transformers' loss; `train --init-from` under tp2·pp2 with `--save-model` and no
//! step gives a directory that evaluates to the same loss; three fine-tuning steps under
//! tp2·pp2 give the model three steps on one rank give.

mod common;

use std::path::{Path, PathBuf};

use common::{bin, ok, scratch};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../train/tests/fixtures/hf/mixtral")
}

/// The fixture's token stream and transformers' mean loss on its two windows.
fn reference() -> (Vec<u32>, f64) {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let stream = st
        .tensor("stream")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let loss = f64::from_le_bytes(st.tensor("loss").unwrap().data().try_into().unwrap());
    (stream, loss)
}

/// `eval`'s loss of `model` on `data` in windows of 16.
fn eval(model: &Path, data: &Path) -> f64 {
    let out = ok(bin()
        .args(["eval", "--model", model.to_str().unwrap()])
        .args(["--data", data.to_str().unwrap(), "--seq", "16"]));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["loss"].as_f64().unwrap()
}

/// `train --init-from` the fixture on `data` for `steps` steps under `layout`, saving the
/// model to `dir/name`.
fn finetune(dir: &Path, data: &Path, name: &str, steps: usize, layout: &[&str]) -> PathBuf {
    let model = dir.join(name);
    let mut sets = vec![
        format!("train.steps={steps}"),
        "model.seq_len=16".into(),
        "train.micro_batch=2".into(),
        "train.warmup_steps=1".into(),
        "train.threads=1".into(),
        format!("data.path={:?}", data.to_str().unwrap()),
        format!(
            "run.dir={:?}",
            dir.join(format!("run-{name}")).to_str().unwrap()
        ),
    ];
    sets.extend(layout.iter().map(|s| s.to_string()));
    let mut cmd = bin();
    cmd.args([
        "train",
        "--quiet",
        "--init-from",
        fixture().to_str().unwrap(),
    ]);
    for s in &sets {
        cmd.args(["--set", s]);
    }
    cmd.args(["--save-model", model.to_str().unwrap()]);
    ok(&mut cmd);
    model
}

#[test]
fn a_transformers_model_fine_tuned_under_tp2_pp2_evaluates_as_on_one_rank() {
    let dir = scratch("hf-finetune");
    let (stream, want) = reference();
    let data = dir.join("stream.bin");
    ferrotron_data::token_file::write_token_file(&data, &stream, 64).unwrap();
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    // The directory as transformers saved it.
    let loss = eval(&fixture(), &data);
    assert!(
        rel(loss, want) <= 1e-6,
        "eval {loss} vs transformers {want}"
    );
    // Loaded, sharded over tp2·pp2 and saved again without a step: the same model.
    let tp_pp = ["parallel.tp=2", "parallel.pp=2"];
    let resaved = finetune(&dir, &data, "resaved", 0, &tp_pp);
    let loss = eval(&resaved, &data);
    assert!(
        rel(loss, want) <= 1e-6,
        "re-saved {loss} vs transformers {want}"
    );
    // Three steps under tp2·pp2 and on one rank: the same fine-tuned model.
    let parallel = eval(&finetune(&dir, &data, "tp2pp2", 3, &tp_pp), &data);
    let single = eval(&finetune(&dir, &data, "single", 3, &[]), &data);
    eprintln!("fine-tuned: {parallel} (tp2·pp2) vs {single} (one rank), from {want}");
    assert!(
        parallel < want,
        "three steps on the evaluation batch lower its loss"
    );
    assert!(rel(parallel, single) <= 1e-5, "{parallel} vs {single}");
}

/// `eval --seq` past the model's `max_position_embeddings` (32 here) warns and still runs.
#[test]
fn eval_past_the_models_context_warns() {
    let dir = scratch("hf-eval-long");
    let (stream, _) = reference();
    let long: Vec<u32> = stream.iter().cycle().take(200).copied().collect();
    let data = dir.join("long.bin");
    ferrotron_data::token_file::write_token_file(&data, &long, 64).unwrap();
    let out = bin()
        .args(["eval", "--model", fixture().to_str().unwrap()])
        .args(["--data", data.to_str().unwrap(), "--seq", "64"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("--seq 64 uses positions beyond the model's max_position_embeddings = 32"),
        "{err}"
    );
}
