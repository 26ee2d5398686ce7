//! Pipeline parallelism against the single-rank run: pp ∈ {2, 4} × every schedule (DualPipeV
//! included: rank 0 holds the embedding and the head, rank p−1 turns the V in place), alone,
//! with dp = 2 (ZeRO 0 and 1) and with tp = 2; and the activation memory of AFAB against 1F1B.
//!
//! Tolerances (f32) as argued in `dp_parity.rs`: loss per step within relative 1e-5, every
//! parameter tensor within relative 1e-5 (L2), every element within 1e-3·max(|b|, 1e-2).
//! Gradients accumulate over micro-batches in the same order on every stage, so pipelines
//! differ from the single rank only in summation order inside the data- and tensor-parallel
//! reductions.

use ferrotron_config::{Config, PpSchedule};
use ferrotron_model::ParamLayout;
use ferrotron_tensor::Category;
use ferrotron_train::launch::run_threads;
use ferrotron_train::Init;
use ferrotron_train::Trainer;

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 32;
    c.model.layers = 8;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 64;
    c.model.seq_len = 16;
    c.train.steps = 6;
    c.train.micro_batch = 2;
    c.train.grad_accum = 8;
    c.train.warmup_steps = 2;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.02;
    c.parallel.comm_timeout_s = 60.0;
    c
}

const SCHEDULES: [(PpSchedule, usize); 5] = [
    (PpSchedule::Afab, 1),
    (PpSchedule::OneFOneB, 1),
    (PpSchedule::Interleaved, 2),
    (PpSchedule::ZeroBubble, 1),
    (PpSchedule::DualPipeV, 1),
];

fn reference(dp: usize) -> (Vec<f64>, Vec<f32>) {
    let mut c = base();
    c.train.grad_accum *= dp;
    let mut t = Trainer::new(c).unwrap();
    let steps = t.run(|_| {}).unwrap();
    (
        steps.iter().map(|s| s.loss).collect(),
        t.full_params().unwrap(),
    )
}

#[test]
fn every_schedule_matches_single_rank_alone_and_with_dp_and_tp() {
    let layout = ParamLayout::new(&base().model);
    let refs = [reference(1), reference(2)];
    for pp in [2, 4] {
        for (schedule, v) in SCHEDULES {
            for (dp, tp, zero) in [(1, 1, 0), (2, 1, 0), (2, 1, 1), (1, 2, 0)] {
                let mut c = base();
                c.parallel.zero = zero;
                c.parallel.pp = pp;
                c.parallel.pp_schedule = schedule;
                c.parallel.virtual_stages = v;
                c.parallel.dp = dp;
                c.parallel.tp = tp;
                let what = format!("pp={pp} {schedule:?} v={v} dp={dp} zero={zero} tp={tp}");
                let (ref_losses, ref_params) = &refs[dp - 1];
                for o in run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap() {
                    for (i, (a, b)) in o.steps.iter().map(|s| s.loss).zip(ref_losses).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * b,
                            "{what} rank {} step {}: loss {a} vs {b}",
                            o.rank,
                            i + 1
                        );
                    }
                    for spec in &layout.params {
                        let (x, y) = (&o.params[spec.range()], &ref_params[spec.range()]);
                        let diff: f64 =
                            x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
                        let norm: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
                        let rel = (diff / norm).sqrt();
                        assert!(
                            rel <= 1e-5,
                            "{what} rank {}: {} differs by {rel:e}",
                            o.rank,
                            spec.name
                        );
                    }
                    let element = o
                        .params
                        .iter()
                        .zip(ref_params)
                        .map(|(p, q)| (p - q).abs() as f64 / (q.abs() as f64).max(1e-2))
                        .fold(0.0, f64::max);
                    assert!(
                        element <= 1e-3,
                        "{what} rank {}: worst element {element:e}",
                        o.rank
                    );
                }
            }
        }
    }
}

/// AFAB keeps every micro-batch's activations on the first stage; 1F1B at most p of them.
#[test]
fn afab_activation_peak_grows_with_m_and_1f1b_is_bounded_by_p() {
    let peak = |schedule: PpSchedule, m: usize| {
        let mut c = base();
        c.parallel.pp = 4;
        c.parallel.pp_schedule = schedule;
        c.train.grad_accum = m;
        c.train.steps = 1;
        let outcomes = run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap();
        outcomes[0].memory.peak(Category::Activations)
    };
    let (afab4, afab8, afab16) = (
        peak(PpSchedule::Afab, 4),
        peak(PpSchedule::Afab, 8),
        peak(PpSchedule::Afab, 16),
    );
    let (ofob4, ofob8, ofob16) = (
        peak(PpSchedule::OneFOneB, 4),
        peak(PpSchedule::OneFOneB, 8),
        peak(PpSchedule::OneFOneB, 16),
    );
    // One micro-batch's saved activations on stage 0 (embedding output + two blocks).
    let per_mb = afab8 - afab4;
    assert!(per_mb > 0);
    assert_eq!(
        afab8 - afab4,
        (afab16 - afab8) / 2,
        "AFAB grows linearly in m"
    );
    assert_eq!(ofob4, ofob8, "1F1B does not grow with m");
    assert_eq!(ofob8, ofob16, "1F1B does not grow with m");
    assert!(
        ofob16 <= afab4,
        "1F1B at m=16 holds no more than AFAB at m=p=4"
    );
    eprintln!("rank 0 activation peak (bytes): afab m=4/8/16 {afab4}/{afab8}/{afab16}; 1f1b {ofob4}/{ofob8}/{ofob16}");
}

/// Tied embeddings under DualPipeV: rank 0 holds the embedding and the head, so the tied
/// pair stays one weight, as on one rank (the single rank's tied model is checked against
/// transformers in `hf_reference.rs`). Every other schedule is refused with pp > 1.
#[test]
fn dualpipev_pipelines_tied_embeddings() {
    let tied = |c: &mut Config| c.model.tie_embeddings = true;
    let mut single = base();
    tied(&mut single);
    single.train.grad_accum = 8;
    let mut t = Trainer::new(single.clone()).unwrap();
    let losses: Vec<f64> = t.run(|_| {}).unwrap().iter().map(|s| s.loss).collect();
    let want = t.full_params().unwrap();
    let layout = ParamLayout::new(&single.model);
    assert!(layout.find("lm_head.weight").is_none(), "one tied weight");
    for (pp, dp) in [(2, 1), (4, 1), (2, 2)] {
        let mut c = single.clone();
        (c.parallel.pp, c.parallel.dp) = (pp, dp);
        c.parallel.pp_schedule = PpSchedule::DualPipeV;
        c.train.grad_accum = 8 / dp;
        for o in run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap() {
            for (a, b) in o.steps.iter().map(|s| s.loss).zip(&losses) {
                assert!((a - b).abs() <= 1e-5 * b, "pp={pp} dp={dp}: {a} vs {b}");
            }
            for spec in &layout.params {
                let (x, y) = (&o.params[spec.range()], &want[spec.range()]);
                let d: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
                let n: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
                let rel = (d / n).sqrt();
                assert!(rel <= 1e-5, "pp={pp} dp={dp}: {} by {rel:e}", spec.name);
            }
        }
        c.parallel.pp_schedule = PpSchedule::OneFOneB;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("model.tie_embeddings") && e.contains("dualpipev"),
            "{e}"
        );
    }
}
