//! Document masking end to end: a run trained with `data.document_mask` reports the eval loss
//! that `ferrotron eval --document-eos` gives its saved model (the same masked windows), while
//! plain `eval` of the same model differs; bad settings are refused naming the field.

use std::path::Path;

use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::token_file::write_token_file;
use ferrotron_data::DataSource;

mod common;

use common::{bin, fails_with, ok, scratch};

/// A token file of synthetic samples (vocab 64) and its most frequent token, which becomes
/// the end of a document.
fn corpus(path: &Path) -> u32 {
    let corpus = SyntheticCorpus::new(64, 9);
    let (mut all, mut buf) = (Vec::new(), vec![0u32; 257]);
    for i in 0..16 {
        corpus.sample(i, &mut buf);
        all.extend_from_slice(&buf);
    }
    write_token_file(path, &all, 64).unwrap();
    let mut counts = [0usize; 64];
    all.iter().for_each(|&t| counts[t as usize] += 1);
    (0..64).max_by_key(|&t| counts[t]).unwrap() as u32
}

fn eval_loss(model: &Path, data: &Path, extra: &[&str]) -> f64 {
    let out = ok(bin()
        .args(["eval", "--model", model.to_str().unwrap()])
        .args(["--data", data.to_str().unwrap()])
        .args(extra));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["loss"].as_f64().unwrap()
}

#[test]
fn a_masked_run_evaluates_as_eval_with_its_end_of_document_token() {
    let dir = scratch("document-mask");
    let data = dir.join("data.bin");
    let eos = corpus(&data);
    let model = dir.join("model");
    let d = data.display().to_string();
    let sets = [
        "model.layers=2".to_owned(),
        "model.seq_len=32".to_owned(),
        "train.steps=4".to_owned(),
        format!("data.path={d}"),
        format!("data.eval_path={d}"),
        "data.document_mask=true".to_owned(),
        format!("data.eos_id={eos}"),
        format!("run.dir={}", dir.join("run").display()),
    ];
    let mut train = bin();
    train.args(["train", "--quiet", "--save-model", model.to_str().unwrap()]);
    for s in &sets {
        train.args(["--set", s]);
    }
    ok(&mut train);
    let summary = std::fs::read_to_string(dir.join("run/summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    let reported = summary["eval_loss"].as_f64().unwrap();
    let eos = eos.to_string();
    let masked = eval_loss(&model, &data, &["--document-eos", &eos]);
    let plain = eval_loss(&model, &data, &[]);
    eprintln!("reported {reported}, eval --document-eos {masked}, plain eval {plain}");
    assert!(
        (reported - masked).abs() <= 1e-6 * reported,
        "{reported} vs {masked}"
    );
    assert!(
        (plain - masked).abs() > 1e-4 * masked,
        "masking changed nothing"
    );
    fails_with(
        bin()
            .args(["eval", "--model", model.to_str().unwrap(), "--data", &d])
            .args(["--document-eos", "64"]),
        "--document-eos 64 is outside the model's vocabulary",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn document_masking_without_its_token_is_refused_before_any_work() {
    fails_with(
        bin().args(["train", "--set", "data.document_mask=true"]),
        "data.eos_id",
    );
    fails_with(
        bin().args(["train", "--set", "data.eos_id=3"]),
        "only by document masking",
    );
}
