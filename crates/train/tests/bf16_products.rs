//! The bf16 regime's products in bf16 (`train.matmul = "bf16"`, AVX-512 BF16): parallel
//! layouts against the single rank on the same products, that single rank against the bf16
//! regime on `gemm`'s f32 products, and the ledger's count of their packing blocks. On a CPU
//! without AVX-512 BF16 the products cannot run, and the tests say so.
//!
//! Tolerances. Layouts against the single rank: as `dp_parity.rs`'s bf16 case (loss within
//! relative 2e-3, every tensor within 3e-2 in L2), since the bf16 regime's gradient rounding
//! sets the scale there too. bf16 against f32 products: each product's operands are rounded
//! to 8-bit mantissas (relative 2⁻⁹ each), so a logit moves by about 2⁻⁸ of its terms' size
//! and the loss by less; after six steps the loss must stay within 1e-2 relative and every
//! tensor within 5e-2 (L2) of the f32 products' run, and the two must differ.

mod common;

use common::single;

use ferrotron_config::{Config, DType, Matmul};
use ferrotron_model::ParamLayout;
use ferrotron_train::launch::run_threads;
use ferrotron_train::{Init, Trainer};

fn skip() -> bool {
    let no = !ferrotron_tensor::bf16_gemm::available();
    if no {
        eprintln!("this CPU lacks AVX-512 BF16: the bf16 products cannot run here");
    }
    no
}

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
    c.train.dtype = DType::Bf16;
    c.train.threads = 2;
    c.train.loss_chunk = 24;
    // lr/ε as in openblas_parity.rs: rounding stays rounding.
    c.train.eps = 1e-5;
    c.train.matmul = Matmul::Bf16;
    c.parallel.bucket_mb = 0.05;
    c.parallel.comm_timeout_s = 60.0;
    c
}

/// Losses within `loss_tol` and every tensor within `tensor_tol` of `reference`.
fn assert_close(
    what: &str,
    (losses, params): (&[f64], &[f32]),
    reference: &(Vec<f64>, Vec<f32>),
    (loss_tol, tensor_tol): (f64, f64),
) {
    let layout = ParamLayout::new(&base().model);
    assert_eq!(losses.len(), reference.0.len(), "{what}: steps");
    for (i, (a, b)) in losses.iter().zip(&reference.0).enumerate() {
        assert!(
            (a - b).abs() <= loss_tol * b,
            "{what} step {}: loss {a} vs {b}",
            i + 1
        );
    }
    let (tensor, _, name) = common::compare(&layout, params, &reference.1);
    eprintln!("{what}: worst tensor {tensor:.2e} ({name})");
    assert!(tensor <= tensor_tol, "{what}: {name} differs by {tensor:e}");
}

#[test]
fn bf16_products_train_like_f32_products() {
    if skip() {
        return;
    }
    let c = base();
    let bf16 = single(&c);
    let mut g = c.clone();
    g.train.matmul = Matmul::Gemm;
    let f32_products = single(&g);
    assert_close(
        "bf16 vs f32 products",
        (&bf16.0, &bf16.1),
        &f32_products,
        (1e-2, 5e-2),
    );
    assert_ne!(
        bf16.1, f32_products.1,
        "the two runs gave identical parameters"
    );
    let (first, last) = (bf16.0[0], bf16.0[bf16.0.len() - 1]);
    assert!(last < first, "the loss did not fall: {first} → {last}");
}

#[test]
fn bf16_product_layouts_match_the_single_rank() {
    if skip() {
        return;
    }
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
            let who = format!("{what} rank {}", o.rank);
            assert_close(&who, (&losses, &o.params), &reference, (2e-3, 3e-2));
        }
    }
}

/// The ledger counts the packed blocks (one shared, one per compute thread) as workspace
/// for the whole run, in place of `gemm`'s packing.
#[test]
fn the_ledger_counts_the_bf16_packing() {
    if skip() {
        return;
    }
    let c = base();
    let bf16 = Trainer::new(c.clone()).unwrap();
    let mut g = c.clone();
    g.train.matmul = Matmul::Gemm;
    let gemm = Trainer::new(g.clone()).unwrap();
    let ws = |t: &Trainer| t.memory().current(ferrotron_tensor::Category::Workspace);
    let pack = ferrotron_config::step_gemm_pack_bytes(&g.model, &g.parallel, 2, 24);
    let threads = bf16.threads() as u64;
    let blocks = ferrotron_config::BF16_GEMM_SHARED_BYTES
        + threads * ferrotron_config::BF16_GEMM_PER_THREAD_BYTES;
    assert_eq!(
        ws(&bf16) as i64 - ws(&gemm) as i64,
        blocks as i64 - pack as i64
    );
}
