//! The ledger's weights, gradients and optimizer bytes equal Ψ × the bytes per parameter of
//! each precision regime (playbook §3), exactly — before and after a training step.

use ferrotron_config::{Config, DType};
use ferrotron_tensor::Category;
use ferrotron_train::Trainer;

fn check(dtype: DType, fp32_accum: bool, expect: [usize; 3]) {
    let mut c = Config::default();
    c.model.layers = 2;
    c.model.kv_heads = 2;
    c.train.steps = 1;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.dtype = dtype;
    c.train.fp32_grad_accum = fp32_accum;
    c.train.threads = 2;
    let psi = c.model.num_params();
    // Between steps, workspace holds only the host kernels' scratch, counted for the run:
    // gemm's largest packing and the attention tiles' scratch per compute thread.
    let (t, p) = (&c.train, &c.parallel);
    let gemm = ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
    let mut trainer = Trainer::new(c.clone()).unwrap();
    let (t, p) = (&c.train, &c.parallel);
    let batch = (t.micro_batch, t.loss_chunk);
    let standing = ferrotron_config::step_matmul_scratch_bytes(
        t.matmul,
        trainer.threads(),
        &c.model,
        p,
        batch,
    );
    for when in ["before", "after"] {
        let mem = trainer.memory();
        for (cat, bytes) in [Category::Weights, Category::Gradients, Category::Optimizer]
            .iter()
            .zip(expect)
        {
            assert_eq!(
                mem.current(*cat),
                bytes * psi,
                "{dtype:?} accum={fp32_accum} {when}: {}",
                cat.name()
            );
            assert_eq!(
                mem.peak(*cat),
                bytes * psi,
                "{dtype:?} accum={fp32_accum} {when}: peak {}",
                cat.name()
            );
        }
        if when == "before" {
            trainer.step().unwrap();
        }
    }
    let mem = trainer.memory();
    assert!(mem.peak(Category::Activations) > 0);
    assert_eq!(mem.current(Category::Activations), 0);
    assert!(gemm > 0);
    let attention =
        trainer.threads() as u64 * ferrotron_config::attention_scratch_per_thread(&c.model);
    assert_eq!(standing, gemm + attention);
    assert_eq!(mem.current(Category::Workspace), standing as usize);
}

#[test]
fn f32_is_4_4_8() {
    check(DType::F32, false, [4, 4, 8]);
}

#[test]
fn bf16_is_2_2_12() {
    check(DType::Bf16, false, [2, 2, 12]);
}

#[test]
fn bf16_with_fp32_grad_accum_is_2_6_12() {
    check(DType::Bf16, true, [2, 6, 12]);
}

/// Saved activations in f32, as documented in `ferrotron_model::llama`: per block
/// T·(4h + 2·a·d + 2·a_kv·d + 2·h_ff) stored elements + T·2 + b·a·s f32 statistics, plus the
/// last block's output and the final norm's statistics, against the ledger's peak.
#[test]
fn activation_peak_matches_the_documented_count() {
    let mut c = Config::default();
    c.model.layers = 3;
    c.model.kv_heads = 2;
    c.train.micro_batch = 2;
    c.train.threads = 1;
    let m = &c.model;
    let (b, s, h, a, akv, d, f) = (
        2,
        m.seq_len,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.head_dim(),
        m.ffn,
    );
    let t = b * s;
    let per_layer = t * (4 * h + 2 * a * d + 2 * akv * d + 2 * f) + 2 * t + b * a * s;
    // The last block's output (input of the final norm) and the final norm's statistics.
    let outside = t * h + t;
    let expected_bytes = 4 * (m.layers * per_layer + outside);
    let mut trainer = Trainer::new(c).unwrap();
    trainer.step().unwrap();
    assert_eq!(trainer.memory().peak(Category::Activations), expected_bytes);
}

/// With `train.threads = 0` the ranks of a pipeline share the machine's cores (each stage's
/// pool has all of them) while data-parallel ranks split them; each rank's standing
/// workspace counts the attention scratch of the threads its pool has.
#[test]
fn unset_threads_give_each_pipeline_stage_the_cores() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (pp, dp, threads) in [(2, 1, cores), (1, 2, (cores / 2).max(1))] {
        let mut c = Config::default();
        c.model.layers = 2;
        c.model.kv_heads = 2;
        (c.train.steps, c.train.micro_batch, c.train.grad_accum) = (1, 2, 2);
        (c.parallel.pp, c.parallel.dp, c.train.threads) = (pp, dp, 0);
        let (t, p) = (&c.train, &c.parallel);
        let gemm = ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
        let attention = ferrotron_config::attention_scratch_per_thread(&c.model);
        let ranks = ferrotron_train::launch::on_thread_ranks(
            &c,
            ferrotron_train::Init::Fresh,
            |mut trainer| {
                trainer.step()?;
                Ok((
                    trainer.threads(),
                    trainer.memory().current(Category::Workspace),
                ))
            },
        )
        .unwrap();
        assert_eq!(ranks.len(), 2);
        for (got, workspace) in ranks {
            assert_eq!(got, threads, "pp{pp} dp{dp}: threads per rank");
            assert_eq!(workspace as u64, gemm + threads as u64 * attention);
        }
    }
}
