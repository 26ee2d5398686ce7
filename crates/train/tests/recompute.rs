//! Activation recomputation: selective and full give the same losses and weights as keeping
//! everything (bit for bit: recomputation repeats the same kernels on the same inputs), alone
//! and under TP+SP, PP, and DP with ZeRO-3; and the activation peak drops by exactly what the
//! dropped tensors weigh.

use ferrotron_config::{Config, PpSchedule, Recompute};
use ferrotron_tensor::Category;
use ferrotron_train::launch::run_threads;
use ferrotron_train::Init;
use ferrotron_train::Trainer;

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 4;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 128;
    c.model.seq_len = 32;
    c.train.steps = 4;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.threads = 1;
    c
}

/// A change to the base configuration.
type Tweak = Box<dyn Fn(&mut Config)>;

fn run(c: &Config) -> Vec<(Vec<f64>, Vec<f32>, usize)> {
    run_threads(c, Init::Fresh, |_| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|o| {
            (
                o.steps.iter().map(|s| s.loss).collect(),
                o.params,
                o.memory.peak(Category::Activations),
            )
        })
        .collect()
}

#[test]
fn recomputation_changes_no_bit_of_training() {
    let layouts: Vec<(&str, Tweak)> = vec![
        ("single rank", Box::new(|_| {})),
        (
            "tp2 sp",
            Box::new(|c| {
                c.parallel.tp = 2;
                c.parallel.sequence_parallel = true;
            }),
        ),
        (
            "pp2 1f1b",
            Box::new(|c| {
                c.parallel.pp = 2;
                c.parallel.pp_schedule = PpSchedule::OneFOneB;
            }),
        ),
        (
            "pp2 zero bubble",
            Box::new(|c| {
                c.parallel.pp = 2;
                c.parallel.pp_schedule = PpSchedule::ZeroBubble;
            }),
        ),
        (
            "dp2 zero3",
            Box::new(|c| {
                c.parallel.dp = 2;
                c.parallel.zero = 3;
            }),
        ),
    ];
    for (name, layout) in &layouts {
        let mut c = base();
        layout(&mut c);
        let keep = run(&c);
        for mode in [Recompute::Selective, Recompute::Full] {
            c.parallel.recompute = mode;
            let again = run(&c);
            for (r, (a, b)) in keep.iter().zip(&again).enumerate() {
                assert_eq!(a.0, b.0, "{name} {mode:?} rank {r}: losses differ");
                assert!(a.1 == b.1, "{name} {mode:?} rank {r}: parameters differ");
                // Zero bubble's peak can sit in the weight-gradient inputs it defers, which
                // recomputation does not touch; elsewhere the peak must drop.
                let drops = if name.contains("zero bubble") {
                    b.2 <= a.2
                } else {
                    b.2 < a.2
                };
                assert!(
                    drops,
                    "{name} {mode:?} rank {r}: activation peak {} vs {} without recomputation",
                    b.2, a.2
                );
            }
        }
    }
}

/// One rank, f32. Without recomputation the peak is every block's saved tensors plus the last
/// block's output and the final norm's statistics (see `ferrotron_model::llama`). Selective
/// keeps each block's set less 2·T·h + T·a·d; its peak is while the last block's forward still
/// holds its full set and its output. Full keeps each block's input (T·h); its peak is one
/// block's full set and output while that block is computed (in forward, or again in
/// backward).
#[test]
fn activation_peak_drops_as_predicted() {
    let c = base();
    let m = &c.model;
    let (b, s, h, a, akv, d, f, layers) = (
        c.train.micro_batch,
        m.seq_len,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.head_dim(),
        m.ffn,
        m.layers,
    );
    let t = b * s;
    let block = t * (4 * h + 2 * a * d + 2 * akv * d + 2 * f) + 2 * t + b * a * s;
    let outside = t * h + t;
    let none = 4 * (layers * block + outside);
    let dropped = 2 * t * h + t * a * d;
    let selective = 4 * (layers * (block - dropped) + dropped + t * h);
    let full = 4 * ((layers - 1) * t * h + block + t * h);
    for (mode, expected) in [
        (Recompute::None, none),
        (Recompute::Selective, selective),
        (Recompute::Full, full),
    ] {
        let mut cfg = c.clone();
        cfg.parallel.recompute = mode;
        let mut trainer = Trainer::new(cfg).unwrap();
        trainer.step().unwrap();
        assert_eq!(
            trainer.memory().peak(Category::Activations),
            expected,
            "{mode:?}"
        );
    }
}
