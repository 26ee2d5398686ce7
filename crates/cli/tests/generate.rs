//! `ferrotron generate` against transformers: on each fixture of `scripts/hf-fixtures.py`
//! (Llama-3.2-style with llama3 RoPE, untied Llama, Mixtral), greedy generation continues the
//! prompt with exactly the 12 tokens transformers' `generate(do_sample=False)` produced; the
//! key/value cache gives the same tokens as recomputing every step; sampling is reproducible
//! with a seed; bad arguments are refused.

mod common;

use std::path::{Path, PathBuf};

use common::bin;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../train/tests/fixtures/hf")
        .join(name)
}

/// The fixture's prompt and transformers' greedy continuation.
fn reference(name: &str) -> (Vec<i64>, Vec<i64>) {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = |n: &str| -> Vec<i64> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    (ids("prompt"), ids("generated"))
}

/// The ids `generate` prints for `prompt` with `extra` arguments.
fn generate(name: &str, prompt: &[i64], extra: &[&str]) -> Vec<i64> {
    let ids: Vec<String> = prompt.iter().map(|i| i.to_string()).collect();
    let out = bin()
        .args(["generate", "--model", fixture(name).to_str().unwrap()])
        .args([
            "--prompt-ids",
            &ids.join(","),
            "--max-new-tokens",
            "12",
            "--ids",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

#[test]
fn greedy_generation_equals_transformers_with_and_without_the_cache() {
    for name in ["llama32", "llama_untied", "mixtral", "qwen2"] {
        let (prompt, want) = reference(name);
        assert_eq!(want.len(), 12);
        let cached = generate(name, &prompt, &["--ignore-eos"]);
        assert_eq!(cached, want, "{name}: greedy tokens");
        let recomputed = generate(name, &prompt, &["--ignore-eos", "--no-cache"]);
        assert_eq!(recomputed, want, "{name}: without the key/value cache");
    }
}

#[test]
fn sampling_is_reproducible_with_a_seed() {
    let (prompt, greedy) = reference("llama32");
    let sample = |seed: &str| {
        generate(
            "llama32",
            &prompt,
            &[
                "--ignore-eos",
                "--temperature",
                "1.5",
                "--top-p",
                "0.95",
                "--seed",
                seed,
            ],
        )
    };
    let (a, b, c) = (sample("5"), sample("5"), sample("6"));
    assert_eq!(a, b, "same seed, same tokens");
    assert_ne!(a, c, "another seed, other tokens");
    assert_ne!(a, greedy, "sampling at temperature 1.5 is not greedy");
}

#[test]
fn bad_arguments_are_refused_naming_them() {
    let model = fixture("llama32");
    let m = model.to_str().unwrap();
    for (args, needle) in [
        (vec!["--prompt-ids", "1,2", "--top-p", "0"], "--top-p 0"),
        (
            vec!["--prompt-ids", "1,2", "--temperature", "-1"],
            "--temperature -1",
        ),
        (
            vec!["--prompt-ids", "1,2", "--max-new-tokens", "0"],
            "--max-new-tokens 0",
        ),
        (
            vec!["--prompt-ids", "1,500"],
            "prompt token 500 is outside the model's vocabulary of 96",
        ),
        (
            vec!["--prompt", "héllo"],
            "read as bytes; pass --prompt-ids",
        ),
        (vec![], "the prompt is empty"),
        (
            vec!["--prompt-ids", "1,2", "--device", "gpu"],
            "invalid value 'gpu' for '--device",
        ),
    ] {
        let out = bin()
            .args(["generate", "--model", m])
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    if !cfg!(feature = "cuda") {
        let out = bin()
            .args([
                "generate",
                "--model",
                m,
                "--prompt-ids",
                "1",
                "--device",
                "cuda",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(
            err.contains("--device cuda: this ferrotron was built without CUDA"),
            "{err}"
        );
    }
    let out = bin()
        .args(["generate", "--model", "no-such-model", "--prompt-ids", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-model"));
}
