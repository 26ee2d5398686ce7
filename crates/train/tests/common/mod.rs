//! Helpers shared by the parity tests.

use ferrotron_model::ParamLayout;

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
