//! The linear layers on OpenBLAS (`train.matmul = "openblas"`): parallel layouts against the
//! single rank on the same library, and that single rank against the one on `gemm`.
//! Tolerances as in `tp_parity.rs` (f32: losses and every parameter tensor within relative
//! 1e-5). Needs a threaded `libopenblas.so.0`: built with `--features openblas`, which CI
//! turns on after installing `libopenblas0-pthread`.

#![cfg(feature = "openblas")]

mod common;

use common::single;

use ferrotron_config::{Config, DType, Matmul};
use ferrotron_model::ParamLayout;
use ferrotron_train::launch::run_threads;
use ferrotron_train::{Init, Trainer};

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 2;
    c.model.heads = 8;
    c.model.kv_heads = 4;
    c.model.ffn = 128;
    c.model.seq_len = 32;
    c.train.steps = 6;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 2;
    c.train.dtype = DType::F32;
    c.train.threads = 2;
    c.train.loss_chunk = 24;
    // Adam's ε bounds how much an update moves per unit of gradient error: lr/ε. At the
    // default 1e-8 that is 3e5, and one near-cancelling gradient turns rounding into a
    // tensor-level difference: measured, o_proj of layer 0 has an element whose gradient is
    // −6.21e-8 with 2 threads and −6.04e-8 with 1 (rms of the tensor 6.3e-3, so an error of
    // 3e-7 of it), and after one step the tensor differs by 9e-6 between the two, most of
    // the 1e-5 budget. At 1e-5, lr/ε is 300 and rounding stays rounding (after six steps the
    // layouts differ by 8e-7); the gradients' rms is 600 ε, so the update is still Adam's.
    c.train.eps = 1e-5;
    c.train.matmul = Matmul::OpenBlas;
    c.parallel.bucket_mb = 0.05;
    c.parallel.comm_timeout_s = 60.0;
    c
}

fn assert_close(what: &str, (losses, params): (&[f64], &[f32]), reference: &(Vec<f64>, Vec<f32>)) {
    let layout = ParamLayout::new(&base().model);
    for (i, (a, b)) in losses.iter().zip(&reference.0).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b,
            "{what} step {}: loss {a} vs {b}",
            i + 1
        );
    }
    let (tensor, element, name) = common::compare(&layout, params, &reference.1);
    assert!(tensor <= 1e-5, "{what}: {name} differs by {tensor:e}");
    assert!(
        element <= 1e-3,
        "{what}: worst element differs by {element:e}"
    );
}

#[test]
fn openblas_training_matches_gemm_training() {
    let c = base();
    let blas = single(&c);
    let mut g = c.clone();
    g.train.matmul = Matmul::Gemm;
    let gemm = single(&g);
    assert_close("openblas vs gemm", (&blas.0, &blas.1), &gemm);
    // Not the same bits: the libraries add in different orders, so this comparison is not
    // trivially met by one library standing in for the other.
    assert_ne!(blas.1, gemm.1, "the two runs gave identical parameters");
}

#[test]
fn openblas_layouts_match_the_single_rank() {
    let c = base();
    let reference = single(&c);
    for (dp, tp, sp) in [(2, 1, false), (1, 2, true), (2, 2, true)] {
        let mut cfg = c.clone();
        cfg.train.threads = 1;
        (
            cfg.parallel.dp,
            cfg.parallel.tp,
            cfg.parallel.sequence_parallel,
        ) = (dp, tp, sp);
        cfg.train.grad_accum = c.train.grad_accum / dp;
        let what = format!("dp={dp} tp={tp} sp={sp}");
        for o in run_threads(&cfg, Init::Fresh, |_| {}, |_, _| {}).unwrap() {
            let losses: Vec<f64> = o.steps.iter().map(|s| s.loss).collect();
            assert_close(
                &format!("{what} rank {}", o.rank),
                (&losses, &o.params),
                &reference,
            );
        }
    }
}

/// The ledger counts OpenBLAS's buffer per compute thread as workspace for the whole run.
#[test]
fn the_ledger_counts_openblas_scratch_per_thread() {
    let c = base();
    let blas = Trainer::new(c.clone()).unwrap();
    let mut g = c.clone();
    g.train.matmul = Matmul::Gemm;
    let gemm = Trainer::new(g.clone()).unwrap();
    let ws = |t: &Trainer| t.memory().current(ferrotron_tensor::Category::Workspace);
    let pack = ferrotron_config::step_gemm_pack_bytes(&g.model, &g.parallel, 2, 24);
    let threads = blas.threads() as u64;
    assert_eq!(
        ws(&blas) as i64 - ws(&gemm) as i64,
        (threads * ferrotron_config::BLAS_SCRATCH_PER_THREAD) as i64 - pack as i64
    );
}
