//! Helpers shared by the parity tests.

use ferrotron_config::Config;
use ferrotron_model::ParamLayout;
use ferrotron_train::launch::{on_thread_ranks, run_threads};
use ferrotron_train::{Init, Trainer};

/// The parity suite's small model (hidden 64, 2 blocks of 4 heads over 2 key/value heads,
/// ffn 128, sequences of 32) training 3 steps of 2 micro-batches of 2 sequences, one thread
/// per rank, with small gradient buckets (several per rank).
#[allow(dead_code)] // used by the Muon and FP8 tests
pub fn small() -> Config {
    let mut c = Config::default();
    (c.model.hidden, c.model.layers, c.model.heads) = (64, 2, 4);
    (c.model.kv_heads, c.model.ffn, c.model.seq_len) = (2, 128, 32);
    (c.train.steps, c.train.micro_batch, c.train.grad_accum) = (3, 2, 2);
    (c.train.warmup_steps, c.train.threads) = (1, 1);
    c.parallel.bucket_mb = 0.02;
    c.parallel.comm_timeout_s = 60.0;
    c
}

/// Losses and parameters of a single-rank run of `c`.
#[allow(dead_code)] // not every test that shares these helpers runs a single rank
pub fn single(c: &ferrotron_config::Config) -> (Vec<f64>, Vec<f32>) {
    let mut t = ferrotron_train::Trainer::new(c.clone()).unwrap();
    let steps = t.run(|_| {}).unwrap();
    (
        steps.iter().map(|s| s.loss).collect(),
        t.full_params().unwrap(),
    )
}

/// Worst per-tensor relative L2 error and worst element error of `a` against `b`.
pub fn compare(layout: &ParamLayout, a: &[f32], b: &[f32]) -> (f64, f64, String) {
    let mut worst = (0.0f64, String::new());
    for spec in &layout.params {
        let (x, y) = (&a[spec.range()], &b[spec.range()]);
        let diff: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let norm: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
        let rel = (diff / norm.max(1e-30)).sqrt();
        if rel > worst.0 {
            worst = (rel, spec.name.clone());
        }
    }
    let element = a
        .iter()
        .zip(b)
        .map(|(p, q)| (p - q).abs() as f64 / (q.abs() as f64).max(1e-2))
        .fold(0.0, f64::max);
    (worst.0, element, worst.1)
}

/// Rank 0's losses over `steps` steps of `c` from `init`, the full parameters after them,
/// and, when `save` is set, the checkpoint written at the end under that root.
#[allow(dead_code)] // used by the checkpoint and data tests
pub fn run(
    c: &ferrotron_config::Config,
    init: ferrotron_train::Init<'_>,
    steps: usize,
    save: Option<&std::path::Path>,
) -> (Vec<f64>, Vec<f32>) {
    let out = ferrotron_train::launch::on_thread_ranks(c, init, |mut t| {
        let mut losses = Vec::new();
        for _ in 0..steps {
            losses.push(t.step()?.loss);
        }
        if let Some(root) = save {
            t.save_checkpoint(root, 2)?;
        }
        Ok((t.rank(), losses, t.full_params()?))
    })
    .unwrap();
    let (_, losses, params) = out.into_iter().find(|(r, _, _)| *r == 0).unwrap();
    (losses, params)
}

/// One step's gradients before the optimizer on every rank of `c`, against `single`'s: per tensor within relative 1e-5
/// (L2), per element within 1e-4·max(|g|, 1e-2), as `cp_parity.rs` checks the ring's.
#[allow(dead_code)] // used through check_layout
fn check_gradients(c: &Config, single: &Config, what: &str) {
    let layout = ParamLayout::new(&c.model);
    let mut reference = Trainer::new(single.clone()).unwrap();
    let (want_loss, _) = reference.compute_gradients().unwrap();
    let want = reference.full_grads().unwrap();
    // ZeRO keeps no whole reduced gradients; its gradients are those of the same layout
    // without it, which the parameters after the run check through the sharded optimizer.
    let mut c = c.clone();
    c.parallel.zero = 0;
    let results = on_thread_ranks(&c, Init::Fresh, |mut t| {
        let (loss, _) = t.compute_gradients()?;
        Ok((loss, t.full_grads()?))
    })
    .unwrap();
    for (rank, (loss, grads)) in results.iter().enumerate() {
        let (tensor, element, name) = compare(&layout, grads, &want);
        eprintln!("{what} rank {rank}: gradient of {name} differs by {tensor:.1e}, worst element {element:.1e}");
        assert!(
            (loss - want_loss).abs() <= 1e-6 * want_loss,
            "{what} rank {rank}: loss {loss} vs {want_loss}"
        );
        assert!(
            tensor <= 1e-5,
            "{what} rank {rank}: gradient of {name} differs by {tensor:e}"
        );
        assert!(
            element <= 1e-4,
            "{what} rank {rank}: gradient element differs by {element:e}"
        );
    }
}

/// `c` against the single-rank run `single` of the same global batch: one step's gradients
/// (as [`check_gradients`]), then every step's loss within relative 1e-5 and every parameter
/// tensor after the run within relative `param_tol` (L2).
#[allow(dead_code)] // used by the document-masking and Ulysses tests
pub fn check_layout(c: &Config, single: &Config, what: &str, param_tol: f64) {
    check_gradients(c, single, what);
    let want = self::single(single);
    let layout = ParamLayout::new(&c.model);
    let outcomes = run_threads(c, Init::Fresh, |_| {}, |_, _| {}).unwrap();
    assert_eq!(outcomes.len(), c.parallel.world_size());
    for o in outcomes {
        for (i, (a, b)) in o.steps.iter().map(|s| s.loss).zip(&want.0).enumerate() {
            let rel = (a - b).abs() / b;
            assert!(
                rel <= 1e-5,
                "{what} rank {} step {}: loss {a} vs {b}",
                o.rank,
                i + 1
            );
        }
        let (tensor, _, name) = compare(&layout, &o.params, &want.1);
        eprintln!("{what} rank {}: worst tensor {name} {tensor:.1e}", o.rank);
        assert!(
            tensor <= param_tol,
            "{what} rank {}: {name} differs by {tensor:e}",
            o.rank
        );
    }
}
