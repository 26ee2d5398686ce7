//! The parsers of files a user hands us — a token file and its sidecar, a checkpoint
//! manifest, a Hugging Face model directory (config.json and safetensors header), a TOML
//! configuration — given random bytes and random mutations of valid files, return an error
//! or a value, never panic (proptest, 256 cases per parser and run).

use std::path::{Path, PathBuf};

use ferrotron_config::Config;
use ferrotron_data::TokenFile;
use ferrotron_train::checkpoint::Checkpoint;
use ferrotron_train::hf::load_model;
use proptest::prelude::*;

/// A fresh directory per case.
fn case_dir(what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("ferrotron-fuzz-{}-{what}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `text` with `edits` applied: (position, byte) replacements.
fn mutate(text: &[u8], edits: &[(usize, u8)]) -> Vec<u8> {
    let mut out = text.to_vec();
    for &(at, b) in edits {
        if !out.is_empty() {
            let i = at % out.len();
            out[i] = b;
        }
    }
    out
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

const SIDECAR: &str =
    r#"{"format":"ferrotron-tokens","version":1,"dtype":"u16","vocab_size":256,"num_tokens":4}"#;

const MANIFEST: &str = r#"{"format":"ferrotron-checkpoint-1","step":1,"samples_done":8,
"config":{},"files":[{"name":"rank_00000.safetensors","bytes":10,"sha256":"00"}]}"#;

const HF_CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,
"intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":4,
"num_key_value_heads":2,"vocab_size":64,"max_position_embeddings":16,"rms_norm_eps":1e-5,
"rope_theta":10000.0,"tie_word_embeddings":true,"torch_dtype":"float32"}"#;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn token_files(bin in prop::collection::vec(any::<u8>(), 0..64),
                   edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                   random_sidecar in prop::collection::vec(any::<u8>(), 0..128)) {
        let dir = case_dir("tokens");
        let path = dir.join("t.bin");
        write(&path, &bin);
        write(&dir.join("t.bin.json"), &mutate(SIDECAR.as_bytes(), &edits));
        let _ = TokenFile::open(&path);
        write(&dir.join("t.bin.json"), &random_sidecar);
        let _ = TokenFile::open(&path);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn checkpoint_manifests(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                            random in prop::collection::vec(any::<u8>(), 0..256)) {
        let dir = case_dir("ckpt");
        let step = dir.join("step_00000001");
        std::fs::create_dir_all(&step).unwrap();
        write(&step.join("rank_00000.safetensors"), b"0123456789");
        write(&step.join("manifest.json"), &mutate(MANIFEST.as_bytes(), &edits));
        let _ = Checkpoint::open(&step);
        write(&step.join("manifest.json"), &random);
        let _ = Checkpoint::open(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn model_directories(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                         header_len in any::<u64>(),
                         body in prop::collection::vec(any::<u8>(), 0..256)) {
        let dir = case_dir("hf");
        write(&dir.join("config.json"), &mutate(HF_CONFIG.as_bytes(), &edits));
        // A safetensors file: a header length (often absurd) and bytes.
        let mut st = header_len.to_le_bytes().to_vec();
        st.extend_from_slice(&body);
        write(&dir.join("model.safetensors"), &st);
        let _ = load_model(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn toml_configurations(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                           random in "[ -~\n]{0,200}") {
        let dir = case_dir("toml");
        let path = dir.join("c.toml");
        let valid = "[model]\nhidden = 64\nlayers = 2\n[train]\nsteps = 3\nlr = 1e-3\n";
        write(&path, &mutate(valid.as_bytes(), &edits));
        let _ = Config::load(Some(&path), &[]);
        write(&path, random.as_bytes());
        let _ = Config::load(Some(&path), &[]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
