//! Megatron indexed datasets and blends in training: a dataset written by a Python writer of
//! the format (from its description) trains to the same losses as the same tokens in a
//! token file; a blend gives the same run under dp2 and tp2 as on one rank, and resumes
//! bit for bit.

mod common;
#[path = "../../data/tests/fixtures/megatron_python.rs"]
mod megatron_python;

use std::path::{Path, PathBuf};

use ferrotron_config::{Config, DType};
use ferrotron_model::ParamLayout;
use ferrotron_train::checkpoint::{Checkpoint, DataChange};
use ferrotron_train::Init;
use megatron_python::python_write;

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 32;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 64;
    c.model.seq_len = 16;
    c.model.vocab = 257;
    c.train.steps = 6;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 1;
    c.train.threads = 1;
    c.train.dtype = DType::F32;
    c.parallel.bucket_mb = 0.01;
    c.parallel.comm_timeout_s = 60.0;
    c
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotron-blend-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `n` documents of 5 to 60 ids below 257, drawn from `seed` (a lag-1 pattern the model
/// can learn a little of in a few steps).
fn documents(n: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut z = seed;
    let mut next = move || {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (z >> 33) as i64
    };
    (0..n)
        .map(|_| {
            let len = 5 + next() % 56;
            let mut doc = vec![next() % 256];
            for _ in 1..len {
                let last = *doc.last().unwrap();
                doc.push(if next() % 4 == 0 {
                    next() % 256
                } else {
                    (last * 3 + 1) % 256
                });
            }
            doc.push(256); // end of document
            doc
        })
        .collect()
}

/// The same documents as a token file.
fn token_file(path: &Path, docs: &[Vec<i64>]) {
    let tokens: Vec<u32> = docs.iter().flatten().map(|&t| t as u32).collect();
    ferrotron_data::write_token_file(path, &tokens, 257).unwrap();
}

#[test]
fn a_python_written_megatron_dataset_trains_like_the_same_token_file() {
    let dir = scratch("same");
    let docs = documents(300, 1);
    let prefix = dir.join("corpus_text_document");
    python_write(&prefix, 8, &docs);
    token_file(&dir.join("tokens.bin"), &docs);
    let mut megatron = base();
    megatron.data.path = Some(prefix);
    let mut tokens = base();
    tokens.data.path = Some(dir.join("tokens.bin"));
    let (a, pa) = common::single(&megatron);
    let (b, pb) = common::single(&tokens);
    assert_eq!(a.len(), 6);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "step {}: {x} vs {y}", i + 1);
    }
    assert!(pa == pb, "parameters after 6 steps differ");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A blend of a Megatron dataset (weight 3) and a token file (weight 1).
fn blended(dir: &Path) -> Config {
    python_write(&dir.join("a"), 8, &documents(300, 2));
    token_file(&dir.join("b.bin"), &documents(300, 3));
    let mut c = base();
    c.data.blend = vec![(3.0, dir.join("a")), (1.0, dir.join("b.bin"))];
    c
}

#[test]
fn a_blend_is_the_same_run_under_dp2_and_tp2() {
    let dir = scratch("layouts");
    let c = blended(&dir);
    let (single, p_single) = common::run(&c, Init::Fresh, 6, None);
    // The blend is not either corpus alone: this comparison could fail.
    let mut alone = c.clone();
    alone.data.blend.clear();
    alone.data.path = Some(dir.join("a"));
    let (a_alone, _) = common::run(&alone, Init::Fresh, 6, None);
    assert_ne!(single, a_alone);
    for (dp, tp) in [(2, 1), (1, 2)] {
        let mut l = c.clone();
        (l.parallel.dp, l.parallel.tp) = (dp, tp);
        // The same global batch: dp ranks share the micro-batches.
        l.train.grad_accum /= dp;
        let (losses, params) = common::run(&l, Init::Fresh, 6, None);
        for (i, (x, y)) in losses.iter().zip(&single).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * y.abs(),
                "dp{dp} tp{tp} step {}: {x} vs {y}",
                i + 1
            );
        }
        let (tensor, _, name) = common::compare(&ParamLayout::new(&c.model), &params, &p_single);
        assert!(tensor <= 1e-5, "dp{dp} tp{tp} {name}: {tensor}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_blend_resumes_bit_for_bit_and_refuses_other_weights() {
    let dir = scratch("resume");
    let mut c = blended(&dir);
    c.parallel.dp = 2;
    let (straight, p_straight) = common::run(&c, Init::Fresh, 6, None);
    let root = dir.join("ckpt");
    let (first, _) = common::run(&c, Init::Fresh, 3, Some(&root));
    let ck = Checkpoint::open(&root).unwrap();
    let (second, p_resumed) = common::run(&c, Init::Checkpoint(&ck), 3, None);
    let resumed: Vec<f64> = first.into_iter().chain(second).collect();
    for (i, (a, b)) in resumed.iter().zip(&straight).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "step {}: {a} vs {b}", i + 1);
    }
    assert!(p_resumed == p_straight, "parameters after 6 steps differ");
    assert_eq!(ck.check_data(&c, false).unwrap(), DataChange::Same);
    // Weights scaled together are the same blend; other weights are other data.
    let mut scaled = c.clone();
    scaled.data.blend[0].0 = 6.0;
    scaled.data.blend[1].0 = 2.0;
    assert_eq!(ck.check_data(&scaled, false).unwrap(), DataChange::Same);
    let mut other = c.clone();
    other.data.blend[0].0 = 1.0;
    let err = ck.check_data(&other, false).unwrap_err().to_string();
    assert!(
        err.contains("a blend of 0.7500") && err.contains("a blend of 0.5000"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
