//! Muon (`train.optimizer = "muon"`): one step against the reference's update computed on
//! the host in f64 (`ferrotron_tensor::muon::reference`, no code shared with the engine's), then every layout it composes with against the single rank,
//! checkpoints resumed bit for bit and resharded, and a resume under the other optimizer
//! refused.
//!
//! Layout tolerances (f32), as the parity suite's: one step's gradients as
//! `common::check_layout` checks them, losses within relative 1e-5 and parameters within
//! relative 1e-5 per tensor after three steps. Measured (EPYC Zen 4): at most 2.7e-6
//! (tp2 + SP; dp2 under every ZeRO stage 1.4e-6, ep2 2.0e-6, pp2 bit for bit). The margin is
//! smaller than for AdamW's elementwise step: the Newton–Schulz iteration maps a matrix's
//! singular values σ/‖G‖ through a quintic whose slope at 0 is a = 3.4445, five times, so
//! rounding differences along small singular directions (≈1e-7 relative, from the layouts'
//! other summation orders) grow by up to a⁵ ≈ 490×.

mod common;

use ferrotron_config::{Config, Optimizer};
use ferrotron_model::ParamLayout;
use ferrotron_tensor::muon::reference::newton_schulz_f64;
use ferrotron_train::checkpoint::Checkpoint;
use ferrotron_train::{Init, Trainer};

fn base() -> Config {
    let mut c = common::small();
    c.train.optimizer = Optimizer::Muon;
    c.train.muon.weight_decay = 0.1;
    c
}

/// One step from the initial weights: every Muon matrix moves to
/// `w·(1 − lr·wd) − lr·√max(1, rows/cols)·NS((1 − β²)·g)` (Nesterov from zero momentum:
/// `m = (1 − β)·g`, `u = (1 − β)·g + β·m`), with `lr` the step's rate times
/// `muon.lr / train.lr`; the rest moves as AdamW moves it.
#[test]
fn one_step_matches_the_reference_update() {
    let mut c = base();
    c.train.grad_clip = 0.0;
    let layout = ParamLayout::new(&c.model);
    let mut probe = Trainer::new(c.clone()).unwrap();
    probe.compute_gradients().unwrap();
    let grads = probe.full_grads().unwrap();
    let mut t = Trainer::new(c.clone()).unwrap();
    let before = t.full_params().unwrap();
    let lr = t.step().unwrap().lr * c.train.muon.lr / c.train.lr;
    let after = t.full_params().unwrap();
    let beta = c.train.muon.momentum;
    let matrices = layout.muon_matrices();
    assert_eq!(matrices.len(), 14);
    for &i in &matrices {
        let spec = &layout.params[i];
        let (rows, cols) = (spec.shape[0], spec.shape[1]);
        let u: Vec<f64> = grads[spec.range()]
            .iter()
            .map(|&g| (1.0 - beta * beta) * g as f64)
            .collect();
        let o = newton_schulz_f64(&u, rows, cols, c.train.muon.ns_steps);
        let scale = (rows as f64 / cols as f64).max(1.0).sqrt();
        let decay = 1.0 - lr * c.train.muon.weight_decay;
        let mut worst = 0.0f64;
        for (j, k) in spec.range().enumerate() {
            let want = before[k] as f64 * decay - lr * scale * o[j];
            worst = worst.max((after[k] as f64 - want).abs());
        }
        // The step moves each element by lr·scale·|O| ≈ 1e-3; f32 rounding of the weights
        // (≈0.02·6e-8) and of the f32 iteration leave about 1e-8.
        eprintln!("{} ({rows}×{cols}): worst {worst:.1e}", spec.name);
        assert!(worst < 1e-7, "{}: {worst:e}", spec.name);
    }
    // Everything else is AdamW's, bit for bit as an AdamW run steps it.
    let mut adamw = c.clone();
    adamw.train.optimizer = Optimizer::AdamW;
    adamw.train.muon = Default::default();
    let mut t = Trainer::new(adamw).unwrap();
    t.step().unwrap();
    let by_adamw = t.full_params().unwrap();
    for (i, spec) in layout.params.iter().enumerate() {
        let (ours, theirs) = (&after[spec.range()], &by_adamw[spec.range()]);
        if matrices.contains(&i) {
            assert_ne!(ours, theirs, "{} moved as AdamW moves it", spec.name);
        } else {
            assert_eq!(ours, theirs, "{} is AdamW's", spec.name);
        }
    }
}

/// `c` against one rank with the same model and global batch, three steps.
fn check(c: &Config, what: &str) {
    let mut single = base();
    single.model = c.model.clone();
    single.train.dtype = c.train.dtype;
    single.train.grad_accum = c.train.grad_accum * c.parallel.dp;
    common::check_layout(c, &single, what, 1e-5);
}

#[test]
fn muon_under_data_parallelism_and_zero_equals_the_single_rank() {
    for zero in 0..=3 {
        let mut c = base();
        (c.parallel.dp, c.parallel.zero) = (2, zero);
        c.train.grad_accum = 1;
        check(&c, &format!("muon dp2 zero-{zero}"));
    }
}

#[test]
fn muon_under_tensor_parallelism_equals_the_single_rank() {
    let mut c = base();
    (c.parallel.tp, c.parallel.sequence_parallel) = (2, true);
    check(&c, "muon tp2+sp");
    let mut c = base();
    (c.parallel.tp, c.parallel.dp, c.parallel.zero) = (2, 2, 1);
    c.train.grad_accum = 1;
    check(&c, "muon tp2·dp2 zero-1");
}

#[test]
fn muon_under_expert_and_pipeline_parallelism_equals_the_single_rank() {
    let mut c = base();
    (c.model.experts, c.model.top_k) = (4, 2);
    (c.parallel.dp, c.parallel.ep, c.parallel.zero) = (2, 2, 1);
    c.train.grad_accum = 1;
    check(&c, "muon ep2 zero-1");
    let mut c = base();
    (c.parallel.pp, c.parallel.pp_schedule) = (2, ferrotron_config::PpSchedule::OneFOneB);
    check(&c, "muon pp2");
    let mut c = base();
    (c.parallel.cp, c.parallel.zero) = (2, 1);
    check(&c, "muon cp2 zero-1");
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotron-muon-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Six steps straight against three, a checkpoint, and three more: bit for bit on the same
/// layout (dp2 ZeRO-1), and within the parity tolerances resharded onto tp2 (the momentum is
/// elementwise state, layout-independent like Adam's).
#[test]
fn muon_resumes_bit_for_bit_and_reshards() {
    let mut a = base();
    (a.parallel.dp, a.parallel.zero) = (2, 1);
    a.train.grad_accum = 1;
    a.train.steps = 6;
    let (straight, p_straight) = common::run(&a, Init::Fresh, 6, None);
    let root = scratch("resume");
    let (first, _) = common::run(&a, Init::Fresh, 3, Some(&root));
    let ck = Checkpoint::open(&root).unwrap();
    let (second, p_resumed) = common::run(&a, Init::Checkpoint(&ck), 3, None);
    let resumed: Vec<f64> = first.iter().copied().chain(second).collect();
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&resumed), bits(&straight));
    assert_eq!(p_resumed, p_straight, "parameters after 6 steps");
    let mut b = a.clone();
    (b.parallel.dp, b.parallel.zero, b.parallel.tp) = (1, 0, 2);
    b.train.grad_accum = 2;
    let (second, p_resharded) = common::run(&b, Init::Checkpoint(&ck), 3, None);
    for (x, y) in first.iter().chain(&second).zip(&straight) {
        assert!((x - y).abs() <= 1e-5 * y, "resharded loss {x} vs {y}");
    }
    let (tensor, _, name) = common::compare(&ParamLayout::new(&a.model), &p_resharded, &p_straight);
    assert!(tensor <= 1e-5, "resharded {name}: {tensor:e}");
    // The other optimizer would read the momentum as Adam's first moment: refused, by name.
    let mut adamw = a.clone();
    adamw.train.optimizer = Optimizer::AdamW;
    adamw.train.muon = Default::default();
    let err = Trainer::resume(adamw, &ck).err().unwrap().to_string();
    assert!(
        err.contains("train.optimizer") && err.contains("\"muon\""),
        "{err}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
