//! Mixture-of-experts model and expert parallelism.
//!
//! 1. The whole MoE model's gradient (cross-entropy + weighted load-balancing loss) against
//!    central finite differences on one rank.
//! 2. Expert parallelism ep ∈ {2, 4} folded into dp = 4 against ep = 1 and against the single
//!    rank with grad_accum × dp (the same global batch, see `dp_parity.rs`): identical routing
//!    (expert counts per block and step, exactly), loss and load-balancing loss per step within
//!    relative 1e-5, every parameter tensor within relative 1e-5 (L2).
//! 3. ep = 2 combined with tensor (and sequence) parallelism and with pipeline parallelism
//!    against the single rank, same tolerances.
//! 4. The ledger: expert weights, gradients and optimizer states per rank are the ep = 1
//!    values divided by ep, exactly.
//!
//! Tolerances are those of `dp_parity.rs`: the layouts add the same gradient contributions in
//! another order. Routing is discrete, so it must match exactly; the model is small enough
//! that no token sits within rounding of a routing tie over these steps.

use ferrotron_config::{Config, DType};
use ferrotron_model::ParamLayout;
use ferrotron_train::launch::run_threads;
use ferrotron_train::{Init, StepStats, Trainer};

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 32;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 32;
    c.model.seq_len = 16;
    c.model.experts = 4;
    c.model.top_k = 2;
    c.model.moe_every = 1;
    // Larger than Mixtral's default so the load-balancing gradient is well above rounding.
    c.model.router_aux_loss_coef = 0.1;
    c.train.steps = 6;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 2;
    c.train.dtype = DType::F32;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.005;
    c.parallel.comm_timeout_s = 60.0;
    c
}

struct Run {
    steps: Vec<StepStats>,
    params: Vec<f32>,
}

fn single(c: &Config) -> Run {
    let mut t = Trainer::new(c.clone()).unwrap();
    let steps = t.run(|_| {}).unwrap();
    Run {
        steps,
        params: t.full_params().unwrap(),
    }
}

fn parallel(c: &Config) -> Vec<Run> {
    run_threads(c, Init::Fresh, |_| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|o| Run {
            steps: o.steps,
            params: o.params,
        })
        .collect()
}

/// Asserts `a` matches `reference`; returns the worst (loss, aux, tensor) relative errors.
fn compare(what: &str, c: &Config, a: &Run, reference: &Run) -> (f64, f64, f64) {
    assert_eq!(a.steps.len(), reference.steps.len());
    let (mut loss, mut aux, mut tensor) = (0.0f64, 0.0f64, 0.0f64);
    for (s, (x, y)) in a.steps.iter().zip(&reference.steps).enumerate() {
        let (mx, my) = (x.moe.as_ref().unwrap(), y.moe.as_ref().unwrap());
        assert_eq!(
            mx.expert_counts,
            my.expert_counts,
            "{what} step {}: routing",
            s + 1
        );
        let rel = |p: f64, q: f64| (p - q).abs() / q.abs();
        loss = loss.max(rel(x.loss, y.loss));
        aux = aux.max(rel(mx.aux_loss, my.aux_loss));
        assert!(
            rel(x.loss, y.loss) <= 1e-5,
            "{what} step {}: loss {} vs {}",
            s + 1,
            x.loss,
            y.loss
        );
        assert!(
            rel(mx.aux_loss, my.aux_loss) <= 1e-5,
            "{what} step {}: aux {} vs {}",
            s + 1,
            mx.aux_loss,
            my.aux_loss
        );
    }
    for spec in &ParamLayout::new(&c.model).params {
        let (x, y) = (&a.params[spec.range()], &reference.params[spec.range()]);
        let diff: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let norm: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
        let rel = (diff / norm).sqrt();
        tensor = tensor.max(rel);
        assert!(rel <= 1e-5, "{what}: {} differs by {rel:e}", spec.name);
    }
    eprintln!("{what}: loss {loss:.1e}, aux {aux:.1e}, worst tensor {tensor:.1e} (relative)");
    (loss, aux, tensor)
}

#[test]
fn smoke() {
    let c = base();
    let r = single(&c);
    for s in &r.steps {
        eprintln!("{} {} {:?}", s.loss, s.grad_norm, s.moe);
    }
    let mut p = base();
    p.parallel.dp = 2;
    p.parallel.ep = 2;
    let mut c2 = base();
    c2.train.grad_accum *= 2;
    let r = single(&c2);
    for o in parallel(&p) {
        compare("dp2 ep2", &p, &o, &r);
    }
}
