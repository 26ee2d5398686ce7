//! Data parallelism and ZeRO against the single-rank run with the same global batch:
//! dp ∈ {2, 4} × zero ∈ {0, 1, 2, 3} × dtype ∈ {f32, bf16, fp16}, grad_accum 2, 10 steps.
//!
//! The reference is one rank with grad_accum = 2·dp: its micro-batch `micro·dp + d` holds
//! exactly the samples DP rank `d` sees in micro-batch `micro`, so both runs consume the same
//! global batch in the same order and differ only in the order gradients are summed.
//!
//! Tolerances. The two runs add the same gradient contributions in a different order, so
//! they differ by rounding, which Adam then amplifies for elements whose gradient is itself
//! at rounding level (m/√v normalises a 1e-9 gradient to a full-size step). Parameters are
//! therefore compared per tensor in the L2 norm, `‖a − b‖ / ‖b‖`, which is what a difference
//! in training means; the worst single element is bounded more loosely as a guard.
//! - f32: loss per step within relative 1e-5; every tensor within relative 1e-5 (L2);
//!   every element within 1e-4·max(|b|, 1e-2).
//! - bf16: each gradient is rounded to bf16 (relative 2⁻⁹ ≈ 2e-3) at different points of the
//!   two sums, and that rounding, not the parallelism, sets the scale: loss within 2e-3
//!   relative; every tensor within 3e-2 relative (L2; measured worst 9.2e-3 at dp=4, the
//!   drift of ten Adam steps on gradients that differ by a few roundings); elements are not
//!   compared (one Adam step of ±lr on a sign-flipped tiny gradient is 15% of a 0.02 weight).
//! - fp16 (loss-scaled): each micro-batch's gradient is rounded to fp16 where it is computed,
//!   on every rank as on the single one, and accumulated and reduced in fp32 (ZeRO-2/3's
//!   reduced pieces join the fp32 buffer without a second rounding), so the two runs differ
//!   by fp32 summation order alone and f32's tolerances hold (measured worst tensor 3.2e-9,
//!   element 1.6e-7, at dp=4).

use ferrotron_config::{Config, DType};
use ferrotron_parallel::buckets::BucketPlan;
use ferrotron_tensor::Category;
use ferrotron_train::launch::run_threads;
use ferrotron_train::Init;
use ferrotron_train::Trainer;

fn base(dtype: DType) -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 128;
    c.model.seq_len = 32;
    c.train.steps = 10;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 2;
    c.train.dtype = dtype;
    c.train.threads = 1;
    // Small buckets: several reductions per step, launched during backward.
    c.parallel.bucket_mb = 0.05;
    c.parallel.comm_timeout_s = 60.0;
    c
}

fn reference(dtype: DType, dp: usize) -> (Vec<f64>, Vec<f32>) {
    let mut c = base(dtype);
    c.train.grad_accum *= dp;
    let mut t = Trainer::new(c).unwrap();
    let steps = t.run(|_| {}).unwrap();
    (
        steps.iter().map(|s| s.loss).collect(),
        t.full_params().unwrap(),
    )
}

fn check(dtype: DType, dp: usize, zero: u8, reference: &(Vec<f64>, Vec<f32>)) {
    let mut c = base(dtype);
    c.parallel.dp = dp;
    c.parallel.zero = zero;
    let (loss_tol, tensor_tol, element_tol) = match dtype {
        DType::F32 => (1e-5, 1e-5, Some(1e-4)),
        DType::Bf16 => (2e-3, 3e-2, None),
        DType::F16 => (1e-5, 1e-5, Some(1e-4)),
    };
    let layout = ferrotron_model::ParamLayout::new(&c.model);
    let outcomes = run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap();
    assert_eq!(outcomes.len(), dp);
    for o in &outcomes {
        let what = format!("{dtype:?} dp={dp} zero={zero} rank {}", o.rank);
        assert_eq!(o.steps.len(), reference.0.len());
        for (step, (a, b)) in o.steps.iter().map(|s| s.loss).zip(&reference.0).enumerate() {
            assert!(
                (a - b).abs() <= loss_tol * b.abs(),
                "{what} step {}: loss {a} vs {b}",
                step + 1
            );
        }
        let mut worst_tensor = 0.0f64;
        for spec in &layout.params {
            let (a, b) = (&o.params[spec.range()], &reference.1[spec.range()]);
            let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
            let rel = (diff / norm).sqrt();
            worst_tensor = worst_tensor.max(rel);
            assert!(
                rel <= tensor_tol,
                "{what}: {} differs by {rel:e} (relative L2)",
                spec.name
            );
        }
        let worst_element = o
            .params
            .iter()
            .zip(&reference.1)
            .map(|(a, b)| (a - b).abs() as f64 / (b.abs() as f64).max(1e-2))
            .fold(0.0, f64::max);
        if let Some(tol) = element_tol {
            assert!(
                worst_element <= tol,
                "{what}: worst element differs by {worst_element:e}"
            );
        }
        eprintln!(
            "{what}: worst tensor {worst_tensor:.2e} (L2), worst element {worst_element:.2e}"
        );
    }
}

#[test]
fn dp_and_zero_match_single_rank_f32() {
    for dp in [2, 4] {
        let r = reference(DType::F32, dp);
        for zero in 0..=3 {
            check(DType::F32, dp, zero, &r);
        }
    }
}

#[test]
fn dp_and_zero_match_single_rank_bf16() {
    for dp in [2, 4] {
        let r = reference(DType::Bf16, dp);
        for zero in 0..=3 {
            check(DType::Bf16, dp, zero, &r);
        }
    }
}

#[test]
fn dp_and_zero_match_single_rank_fp16() {
    for dp in [2, 4] {
        let r = reference(DType::F16, dp);
        for zero in 0..=3 {
            check(DType::F16, dp, zero, &r);
        }
    }
}

/// Per rank, weights, gradients and optimizer bytes are the playbook's ZeRO formulas with
/// Ψ_r, this rank's shard (its pieces of every bucket; Σ_r Ψ_r = Ψ).
#[test]
fn ledger_matches_zero_formulas_per_rank() {
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for zero in 0..=3u8 {
            let mut c = base(dtype);
            c.parallel.dp = 4;
            c.parallel.zero = zero;
            c.train.steps = 1;
            let psi = c.model.num_params();
            let outcomes = run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap();
            let layout = ferrotron_model::ParamLayout::new(&c.model);
            let bucket_elems = ferrotron_config::bucket_elems(c.parallel.bucket_mb, dtype.size());
            let plan = BucketPlan::new(&layout, bucket_elems, 4, zero >= 1, zero >= 3);
            if zero >= 1 {
                let total: usize = (0..4).map(|r| plan.shard_len(r)).sum();
                assert_eq!(total, psi);
            }
            for o in &outcomes {
                let psi_r = plan.shard_len(o.rank);
                let b = dtype.size();
                let weights = b * if zero >= 3 { psi_r } else { psi };
                // fp16 gradients also accumulate in an fp32 buffer; a ZeRO-2/3 shard keeps
                // only that.
                let g = match (dtype, zero) {
                    (DType::F16, 0 | 1) => b + 4,
                    (DType::F16, _) => 4,
                    _ => b,
                };
                let grads = g * if zero >= 2 { psi_r } else { psi };
                let optimizer = match (dtype, zero) {
                    (DType::F32, 0) => 8 * psi,
                    (DType::F32, _) => 8 * psi_r,
                    (_, 0) => 12 * psi,
                    (_, _) => 12 * psi_r,
                };
                let m = &o.memory;
                assert_eq!(
                    m.peak(Category::Weights),
                    weights,
                    "{dtype:?} zero={zero} rank {}",
                    o.rank
                );
                assert_eq!(
                    m.peak(Category::Gradients),
                    grads,
                    "{dtype:?} zero={zero} rank {}",
                    o.rank
                );
                assert_eq!(
                    m.peak(Category::Optimizer),
                    optimizer,
                    "{dtype:?} zero={zero} rank {}",
                    o.rank
                );
            }
        }
    }
}

/// A rank that fails mid-step stops every rank promptly with an error naming it.
#[test]
fn a_failing_rank_stops_the_run_with_its_name() {
    let mut c = base(DType::F32);
    c.parallel.dp = 4;
    c.parallel.zero = 2;
    c.parallel.comm_timeout_s = 30.0;
    let start = std::time::Instant::now();
    let err = run_threads(
        &c,
        Init::Fresh,
        |t| {
            if t.rank() == 2 {
                t.faults.fail_at_step = Some(3);
            }
        },
        |_, _| {},
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("rank 2 failed: injected failure at step 3"),
        "{msg}"
    );
    // The others noticed the failure instead of waiting out the 30 s timeout.
    assert!(
        start.elapsed().as_secs_f64() < 10.0,
        "took {:?}",
        start.elapsed()
    );
}
