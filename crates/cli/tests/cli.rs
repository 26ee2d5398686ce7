//! End-to-end tests of the `ferrotron` binary: save → eval agreement, byte-identical
//! re-save, and clear errors (non-zero exit, a message naming the problem, never a panic).

use std::path::{Path, PathBuf};

use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::token_file::write_token_file;
use ferrotron_data::DataSource;

mod common;

use common::{bin, fails_with, ok, scratch};

/// A token file of synthetic-corpus samples (vocab 64).
fn corpus_file(dir: &Path, tokens: usize) -> PathBuf {
    let corpus = SyntheticCorpus::new(64, 9);
    let mut all = Vec::new();
    let mut buf = vec![0u32; 257];
    let mut i = 0;
    while all.len() < tokens {
        corpus.sample(i, &mut buf);
        all.extend_from_slice(&buf);
        i += 1;
    }
    all.truncate(tokens);
    let path = dir.join("data.bin");
    write_token_file(&path, &all, 64).unwrap();
    path
}

const SMALL: [&str; 8] = [
    "--set",
    "model.layers=2",
    "--set",
    "model.kv_heads=2",
    "--set",
    "model.seq_len=32",
    "--set",
    "train.micro_batch=4",
];

/// The eval loss a training run in `run` reported in its summary, and `ferrotron eval` of
/// the model it saved on `data`: (reported, evaluated, tokens evaluated).
fn eval_losses(run: &Path, model: &Path, data: &str) -> (f64, f64, u64) {
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    let eval: serde_json::Value = serde_json::from_str(&ok(bin().args([
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data,
    ])))
    .unwrap();
    (
        summary["eval_loss"].as_f64().unwrap(),
        eval["loss"].as_f64().unwrap(),
        eval["tokens"].as_u64().unwrap(),
    )
}

fn save_eval_resave(dtype: &str) {
    let dir = scratch(&format!("roundtrip-{dtype}"));
    let data = corpus_file(&dir, 4000);
    let model = dir.join("model");
    let d = data.display().to_string();
    ok(bin().args(["train", "--quiet"]).args(SMALL).args([
        "--set",
        "train.steps=5",
        "--set",
        &format!("train.dtype={dtype}"),
        "--set",
        &format!("data.path={d}"),
        "--set",
        &format!("data.eval_path={d}"),
        "--set",
        &format!("run.dir={}", dir.join("run").display()),
        "--save-model",
        model.to_str().unwrap(),
    ]));
    let (reported, evaluated, tokens) = eval_losses(&dir.join("run"), &model, &d);
    assert_eq!(tokens, (3999 / 32) * 32);
    // Same weights, same windows, same kernels: equal up to f32 summation order.
    assert!(
        (reported - evaluated).abs() <= 1e-6 * reported,
        "{reported} vs {evaluated}"
    );

    // Load and save again without training: byte-identical.
    let again = dir.join("again");
    ok(bin().args(["train", "--quiet"]).args(SMALL).args([
        "--set",
        "train.steps=0",
        "--set",
        &format!("train.dtype={dtype}"),
        "--set",
        &format!("run.dir={}", dir.join("run2").display()),
        "--init-from",
        model.to_str().unwrap(),
        "--save-model",
        again.to_str().unwrap(),
    ]));
    for f in ["config.json", "model.safetensors"] {
        assert_eq!(
            std::fs::read(model.join(f)).unwrap(),
            std::fs::read(again.join(f)).unwrap(),
            "{f} differs"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn save_eval_and_resave_f32() {
    save_eval_resave("f32");
}

#[test]
fn save_eval_and_resave_bf16() {
    save_eval_resave("bf16");
}

#[test]
fn config_errors_name_the_field() {
    fails_with(bin().args(["train", "--set", "model.hiden=3"]), "hiden");
    fails_with(
        bin().args(["train", "--set", "train.steps=\"many\""]),
        "invalid type",
    );
    fails_with(
        bin().args(["train", "--set", "model.kv_heads=3"]),
        "heads=4 is not divisible by kv_heads=3",
    );
    fails_with(
        bin().args(["train", "--set", "model.hidden=130"]),
        "hidden=130 is not divisible by heads=4",
    );
    fails_with(
        bin().args(["train", "--set", "parallel.cp=3"]),
        "not divisible by 2 × parallel.cp = 6",
    );
    let dir = scratch("badconfig");
    let cfg = dir.join("c.toml");
    std::fs::write(&cfg, "[model]\nlayers = \"two\"\n").unwrap();
    fails_with(
        bin().args(["train", "--config", cfg.to_str().unwrap()]),
        "layers",
    );
    fails_with(
        bin().args([
            "train",
            "--config",
            dir.join("missing.toml").to_str().unwrap(),
        ]),
        "missing.toml",
    );
}

#[test]
fn data_errors_name_the_file() {
    let dir = scratch("baddata");
    let data = corpus_file(&dir, 1000);
    let d = data.display().to_string();
    let run_dir = format!("run.dir={}", dir.join("run").display());
    // seq_len longer than the data.
    fails_with(
        bin().args([
            "train",
            "--set",
            &format!("data.path={d}"),
            "--set",
            "model.seq_len=2000",
            "--set",
            &run_dir,
        ]),
        "longer than the data",
    );
    // Data vocabulary larger than the model's.
    let big = dir.join("big.bin");
    write_token_file(&big, &[1, 2, 300, 4], 512).unwrap();
    fails_with(
        bin().args([
            "train",
            "--set",
            &format!("data.path={}", big.display()),
            "--set",
            "model.seq_len=2",
            "--set",
            &run_dir,
        ]),
        "vocab",
    );
    // … said before the ranks start, not as one rank's failure.
    let out = common::run(bin().args([
        "train",
        "--set",
        &format!("data.path={}", big.display()),
        "--set",
        "parallel.dp=2",
        "--set",
        &run_dir,
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("has vocab_size 512 but model.vocab is 64") && !stderr.contains("rank"),
        "{stderr}"
    );
    // A token id ≥ vocab inside a file: corrupt one token of a valid file.
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[20] = 0xFF;
    bytes[21] = 0x00;
    std::fs::write(&data, &bytes).unwrap();
    fails_with(
        bin().args([
            "train",
            "--set",
            &format!("data.path={d}"),
            "--set",
            &run_dir,
        ]),
        "255",
    );
    // Truncated file.
    std::fs::write(&data, &bytes[..1500]).unwrap();
    fails_with(
        bin().args([
            "train",
            "--set",
            &format!("data.path={d}"),
            "--set",
            &run_dir,
        ]),
        "truncated",
    );
    // Missing file.
    std::fs::remove_file(&data).unwrap();
    fails_with(
        bin().args([
            "train",
            "--set",
            &format!("data.path={d}"),
            "--set",
            &run_dir,
        ]),
        "data.bin",
    );
    fails_with(
        bin().args(["eval", "--model", dir.to_str().unwrap(), "--data", &d]),
        "config.json",
    );
}

#[test]
fn model_directory_that_does_not_match_its_config() {
    let dir = scratch("badmodel");
    let model = dir.join("model");
    ok(bin().args(["train", "--quiet"]).args(SMALL).args([
        "--set",
        "train.steps=0",
        "--set",
        &format!("run.dir={}", dir.join("run").display()),
        "--save-model",
        model.to_str().unwrap(),
    ]));
    let cfg_path = model.join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        cfg.replace("\"intermediate_size\": 384", "\"intermediate_size\": 512"),
    )
    .unwrap();
    fails_with(
        bin().args(["train", "--set", "train.steps=0", "--init-from", model.to_str().unwrap()]),
        "model.layers.0.mlp.gate_proj.weight` has shape [384, 128] but config.json implies [512, 128]",
    );
    // A truncated weights file.
    std::fs::write(&cfg_path, cfg).unwrap();
    let w = std::fs::read(model.join("model.safetensors")).unwrap();
    std::fs::write(model.join("model.safetensors"), &w[..w.len() / 2]).unwrap();
    fails_with(
        bin().args([
            "train",
            "--set",
            "train.steps=0",
            "--init-from",
            model.to_str().unwrap(),
        ]),
        "model.safetensors",
    );
}

#[test]
fn a_failing_rank_on_threads_exits_non_zero_naming_it() {
    let dir = scratch("failrank");
    let start = std::time::Instant::now();
    fails_with(
        bin().args(["train", "--quiet"]).args(SMALL).args([
            "--set",
            "parallel.dp=4",
            "--set",
            "train.steps=5",
            "--set",
            "parallel.comm_timeout_s=60",
            "--set",
            &format!("run.dir={}", dir.join("run").display()),
            "--fail-rank-at",
            "2:3",
        ]),
        "rank 2 failed: injected failure at step 3",
    );
    // Every other rank stopped on the failure instead of waiting out the 60 s timeout.
    assert!(start.elapsed().as_secs() < 30, "took {:?}", start.elapsed());
}

#[test]
fn dry_run_reports_the_context_parallel_balance() {
    let out = ok(bin().args(["train", "--dry-run", "--set", "parallel.cp=4"]));
    let zigzag = out.lines().find(|l| l.contains("zig-zag")).expect(&out);
    let contiguous = out.lines().find(|l| l.contains("contiguous")).expect(&out);
    // seq 128 in 8 chunks of 16: every zig-zag rank does the same causal work; the
    // contiguous ranks do 1 : 3 : 5 : 7 (plus the diagonal).
    assert!(zigzag.ends_with("max/min − 1 = 0.0%"), "{zigzag}");
    assert!(contiguous.ends_with("max/min − 1 = 581.8%"), "{contiguous}");
}

/// `data.eval_path` under tensor parallelism and under expert parallelism with ZeRO-3: every
/// rank joins the evaluation's collectives (no hang), and the reported loss is what `eval`
/// computes on the saved model.
#[test]
fn eval_during_training_under_tensor_and_expert_parallelism() {
    let dir = scratch("eval-parallel");
    let data = corpus_file(&dir, 4000);
    let d = data.display().to_string();
    let layouts: [&[&str]; 2] = [
        &["parallel.tp=2"],
        &[
            "model.experts=4",
            "model.top_k=2",
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.zero=3",
        ],
    ];
    for (i, layout) in layouts.iter().enumerate() {
        let (run, model) = (dir.join(format!("run{i}")), dir.join(format!("model{i}")));
        let mut cmd = bin();
        cmd.args(["train", "--quiet"]).args(SMALL);
        for set in layout.iter().copied().chain([
            "train.steps=3",
            "parallel.comm_timeout_s=60",
            &format!("data.path={d}"),
            &format!("data.eval_path={d}"),
            &format!("run.dir={}", run.display()),
        ]) {
            cmd.args(["--set", set]);
        }
        ok(cmd.args(["--save-model", model.to_str().unwrap()]));
        let (reported, evaluated, _) = eval_losses(&run, &model, &d);
        assert!(
            (reported - evaluated).abs() <= 1e-5 * reported,
            "{layout:?}: {reported} vs {evaluated}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cached peak far below the machine's (as one measured while the machine was busy, or on
/// another machine): MFU is counted against what the run's own products reached instead,
/// says so, and stays at most 100%.
#[test]
fn mfu_stays_at_most_100_percent_against_a_stale_cached_peak() {
    let root = scratch("stale-peak");
    let cache = root.join("cache");
    std::fs::create_dir_all(cache.join("ferrotron")).unwrap();
    let key = ferrotron_bench::peak::cache_key_of(1, ferrotron_bench::peak::Products::F32);
    let stale = serde_json::json!({ key: 0.5 }); // 0.5 GFLOP/s
    std::fs::write(cache.join("ferrotron/matmul_peak.json"), stale.to_string()).unwrap();
    let run = root.join("run");
    let out = ok(bin()
        .env("XDG_CACHE_HOME", &cache)
        .args(["train", "--quiet"])
        .args(["--set", "model.hidden=128", "--set", "model.ffn=512"])
        .args(["--set", "model.seq_len=64", "--set", "train.micro_batch=4"])
        .args(["--set", "train.steps=3", "--set", "train.threads=1"])
        .args(["--set", &format!("run.dir={}", run.display())]));
    let _ = out;
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["peak_from_products"], true, "{summary}");
    let mfu = summary["mfu"].as_f64().unwrap();
    assert!(mfu > 0.0 && mfu <= 1.0, "MFU {mfu}");
    assert!(summary["peak_gflops"].as_f64().unwrap() > 0.5);
    std::fs::remove_dir_all(&root).unwrap();
}
