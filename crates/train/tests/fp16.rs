//! fp16 (`train.dtype = "fp16"`) with dynamic loss scaling.
//!
//! - Layouts: every rank rounds what it stores (weights, saved activations, each
//!   micro-batch's gradient) to fp16 at the same points as the single rank, and sums
//!   gradients in fp32. dp2 and pp2 then differ from the single rank by fp32 summation order
//!   alone. Under TP the row-parallel products' partial sums meet in an fp32 all-reduce, so
//!   an activation whose f32 value moves by rounding can land on the other side of an fp16
//!   rounding boundary (a step of 2⁻¹¹ of itself) on one side only: one step's gradients are
//!   held to one fp16 step per tensor, the parameters after three steps to 1e-3.
//! - Overflow: a loss scale too large turns the scaled gradients infinite; those steps are
//!   skipped on every rank alike, the scale halves, and training goes on as the single rank
//!   does.
//! - The scale is why fp16 trains: at scale 1 the small gradients are fp16 subnormals, with
//!   fewer significant bits the smaller they are (below 2⁻²⁵ zero); at the default 65536
//!   they keep fp16's precision.
//! - A checkpoint resumes bit for bit, the scale and its count of clean steps included.

mod common;

use ferrotron_config::{Config, DType};
use ferrotron_model::ParamLayout;
use ferrotron_train::checkpoint::Checkpoint;
use ferrotron_train::launch::run_threads;
use ferrotron_train::{Init, Trainer};

fn base() -> Config {
    let mut c = common::small();
    c.train.dtype = DType::F16;
    c
}

/// dp2 (ZeRO 0 and 1) and pp2 round at the same points as the single rank: the parity
/// suite's tolerances hold (measured: dp2 9.9e-10, pp2 0).
#[test]
fn fp16_under_data_and_pipeline_parallelism_equals_the_single_rank() {
    let mut single = base();
    single.train.grad_accum = 4;
    for (what, dp, zero, pp) in [("dp2", 2, 0, 1), ("dp2 zero-1", 2, 1, 1), ("pp2", 1, 0, 2)] {
        let mut c = base();
        (c.parallel.dp, c.parallel.zero, c.parallel.pp) = (dp, zero, pp);
        c.train.grad_accum = 4 / dp;
        common::check_layout(&c, &single, &format!("fp16 {what}"), 1e-5);
    }
}

/// One fp16 rounding step: 2⁻¹¹ of a value.
const FP16_STEP: f64 = 1.0 / 2048.0;

/// tp2, tp2 + SP and tp2·dp2: an activation may round to the neighbouring fp16 value on one
/// side only, so one step's gradients are within one fp16 step per tensor (measured at most
/// 4.9e-5), the losses within 1e-5 (measured 1.8e-8) and the parameters after three steps
/// within 1e-3 (measured 4.0e-5).
#[test]
fn fp16_under_tensor_parallelism_is_within_one_fp16_rounding() {
    let mut single = base();
    single.train.grad_accum = 4;
    let want = common::single(&single);
    let layout = ParamLayout::new(&single.model);
    let mut reference = Trainer::new(single.clone()).unwrap();
    reference.compute_gradients().unwrap();
    let want_grads = reference.full_grads().unwrap();
    for (what, dp, sp) in [
        ("tp2", 1, false),
        ("tp2+sp", 1, true),
        ("tp2·dp2", 2, false),
    ] {
        let mut c = base();
        (c.parallel.tp, c.parallel.dp, c.parallel.sequence_parallel) = (2, dp, sp);
        c.train.grad_accum = 4 / dp;
        let grads = ferrotron_train::launch::on_thread_ranks(&c, Init::Fresh, |mut t| {
            t.compute_gradients()?;
            t.full_grads()
        })
        .unwrap();
        for g in &grads {
            let (tensor, _, name) = common::compare(&layout, g, &want_grads);
            assert!(
                tensor <= FP16_STEP,
                "{what}: gradient of {name} by {tensor:e}"
            );
        }
        for o in run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap() {
            for (a, b) in o.steps.iter().map(|s| s.loss).zip(&want.0) {
                assert!((a - b).abs() <= 1e-5 * b, "{what}: loss {a} vs {b}");
            }
            let (tensor, _, name) = common::compare(&layout, &o.params, &want.1);
            eprintln!("{what} rank {}: worst tensor {name} {tensor:.1e}", o.rank);
            assert!(tensor <= 1e-3, "{what}: {name} differs by {tensor:e}");
        }
    }
}

/// A loss scale far too large: the first steps' scaled gradients overflow fp16. Every rank
/// skips the same steps, the scale halves at each, and the applied steps match the single
/// rank's as above.
#[test]
fn overflowing_steps_are_skipped_alike_and_the_scale_backs_off() {
    let mut single = base();
    single.train.grad_accum = 4;
    single.train.steps = 8;
    single.train.loss_scale.init = 2f64.powi(26);
    let mut t = Trainer::new(single.clone()).unwrap();
    let steps = t.run(|_| {}).unwrap();
    let skipped: Vec<bool> = steps.iter().map(|s| s.skipped).collect();
    let scales: Vec<f64> = steps.iter().map(|s| s.loss_scale.unwrap()).collect();
    eprintln!("skipped {skipped:?}, scales {scales:?}");
    let first_applied = skipped.iter().position(|s| !s).expect("an applied step");
    assert!(first_applied >= 2, "{skipped:?}");
    assert!(skipped[first_applied..].iter().all(|s| !s), "{skipped:?}");
    for (i, pair) in scales.windows(2).enumerate() {
        let want = if skipped[i] { pair[0] / 2.0 } else { pair[0] };
        assert_eq!(pair[1], want, "step {}", i + 2);
    }
    let mut c = single.clone();
    (c.parallel.dp, c.train.grad_accum) = (2, 2);
    let layout = ParamLayout::new(&c.model);
    let want = t.full_params().unwrap();
    for o in run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap() {
        let got: Vec<bool> = o.steps.iter().map(|s| s.skipped).collect();
        assert_eq!(got, skipped, "rank {}", o.rank);
        let (tensor, _, name) = common::compare(&layout, &o.params, &want);
        assert!(tensor <= 1e-5, "rank {}: {name} by {tensor:e}", o.rank);
    }
}

/// One step's gradients at loss scale `scale`, unscaled (a power of two: exactly).
fn unscaled_gradients(scale: f64, accum: usize) -> Vec<f32> {
    let mut c = base();
    c.train.grad_accum = accum;
    (c.train.loss_scale.init, c.train.loss_scale.min_scale) = (scale, 1.0);
    let mut t = Trainer::new(c).unwrap();
    t.compute_gradients().unwrap();
    let g = t.full_grads().unwrap();
    g.iter().map(|g| (*g as f64 / scale) as f32).collect()
}

/// Eight micro-batches make each one's gradient small, as a large batch does. At the
/// default scale every stored gradient is a normal fp16 number; at scale 1 the small ones
/// are subnormal (fewer significant bits the smaller they are) or zero: measured, 0.02% of
/// the elements underflow to zero and 22% land more than one fp16 step from the scaled
/// run's (at one micro-batch 9%, at 32 47%).
#[test]
fn the_loss_scale_keeps_small_gradients_from_underflowing() {
    let (at_one, scaled) = (unscaled_gradients(1.0, 8), unscaled_gradients(65536.0, 8));
    let n = scaled.len() as f64;
    let zeroed = at_one
        .iter()
        .zip(&scaled)
        .filter(|(a, s)| **a == 0.0 && **s != 0.0)
        .count() as f64;
    let coarse = at_one
        .iter()
        .zip(&scaled)
        .filter(|(a, s)| ((**a - **s) as f64).abs() > FP16_STEP * (**s as f64).abs())
        .count() as f64;
    eprintln!(
        "at scale 1: {:.2}% of the gradients underflow to zero, {:.1}% are off by more than \
         one fp16 step",
        100.0 * zeroed / n,
        100.0 * coarse / n
    );
    assert!(zeroed > 0.0, "no gradient underflowed");
    assert!(coarse > 0.05 * n, "{coarse} of {n}");
}

/// The scale grows every 2 clean steps here, and the first step overflows: a checkpoint
/// taken between them resumes the scale and its count, so the run goes on bit for bit.
#[test]
fn fp16_resumes_bit_for_bit_with_its_loss_scale() {
    let mut c = base();
    c.train.steps = 6;
    c.train.loss_scale.init = 2f64.powi(22);
    c.train.loss_scale.growth_interval = 2;
    let scales = |c: &Config, init: Init<'_>, steps: usize, save: Option<&std::path::Path>| {
        ferrotron_train::launch::on_thread_ranks(c, init, |mut t| {
            let mut out = Vec::new();
            for _ in 0..steps {
                let s = t.step()?;
                out.push((s.loss.to_bits(), s.skipped, s.loss_scale));
            }
            if let Some(root) = save {
                t.save_checkpoint(root, 2)?;
            }
            Ok((out, t.full_params()?))
        })
        .unwrap()
        .remove(0)
    };
    let (straight, p_straight) = scales(&c, Init::Fresh, 6, None);
    eprintln!("{straight:?}");
    assert!(straight.iter().any(|s| s.1), "a step overflows");
    let root = std::env::temp_dir().join(format!("ferrotron-fp16-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (mut first, _) = scales(&c, Init::Fresh, 3, Some(&root));
    let ck = Checkpoint::open(&root).unwrap();
    assert!(ck.manifest.loss_scale.is_some());
    let (second, p_resumed) = scales(&c, Init::Checkpoint(&ck), 3, None);
    first.extend(second);
    assert_eq!(first, straight);
    assert_eq!(p_resumed, p_straight);
    std::fs::remove_dir_all(&root).unwrap();
}

/// Steps skipped on overflow are not optimizer steps: the first applied one is Adam's first,
/// whose bias-corrected update is `lr · g/|g|`, so the weights move by the learning rate
/// (had the skips counted, Adam's seventh step would move them by about half of it).
#[test]
fn skipped_steps_do_not_count_as_adam_steps() {
    let mut c = base();
    (c.train.steps, c.train.weight_decay) = (10, 0.0);
    c.train.loss_scale.init = 2f64.powi(26);
    let mut t = Trainer::new(c).unwrap();
    let mut before = t.full_params().unwrap();
    let stats = loop {
        let s = t.step().unwrap();
        if !s.skipped {
            break s;
        }
        before = t.full_params().unwrap();
    };
    assert!(stats.step > 3, "several steps overflowed first");
    let after = t.full_params().unwrap();
    let mut moves: Vec<f64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| (a - b).abs() as f64 / stats.lr)
        .filter(|m| *m > 0.0)
        .collect();
    moves.sort_by(f64::total_cmp);
    let median = moves[moves.len() / 2];
    assert!((median - 1.0).abs() < 0.05, "median move {median} × lr");
}
