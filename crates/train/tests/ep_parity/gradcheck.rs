//! Item 1 of the suite: the whole MoE model's gradient (cross-entropy + weighted
//! load-balancing loss) against central finite differences on one rank.

use super::*;

/// Objective `J = Σ token losses / t + w · aux` of the tiny MoE model at `weights`, its
/// expert counts per block (to detect routing flips) and, with `grads`, its gradient.
fn objective(
    model: &Llama,
    weights: &Store,
    grads: Option<&mut Grads>,
    aux_weight: f64,
) -> (f64, Vec<Vec<f64>>) {
    let cfg = &model.cfg;
    let t = 2 * cfg.seq_len;
    let inputs: Vec<u32> = (0..t as u32)
        .map(|i| (i * 7 + 3) % cfg.vocab as u32)
        .collect();
    let targets: Vec<u32> = (0..t as u32)
        .map(|i| (i * 5 + 1) % cfg.vocab as u32)
        .collect();
    let ledger = Ledger::new();
    let ctx = StepCtx {
        ledger: &ledger,
        backend: &CpuBackend::default(),
        act_dtype: StoreDType::F32,
        loss_chunk: 5,
        tp: None,
        cp: None,
        trace: None,
        micro_batch: Default::default(),
        recompute: Recompute::None,
        moe: MoeStep::new(cfg, None, aux_weight),
        documents: None,
        fp8: ferrotron_config::Fp8::Off,
        fp8_history: None,
    };
    let scale = 1.0 / t as f32;
    let grads = grads.map(|g| g as &mut dyn ferrotron_model::GradSink);
    let ce = model
        .forward_backward(
            &ctx,
            weights,
            grads,
            &ledger.upload(Category::Workspace, "test", &inputs),
            &ledger.upload(Category::Workspace, "test", &targets),
            scale,
        )
        .unwrap();
    let report = ctx.moe.report();
    (
        ce / t as f64 + aux_weight * report.aux_sum,
        report.counts.into_values().collect(),
    )
}

/// Every gradient in `g`, read on the host (CPU memory).
fn host(g: &Grads) -> Vec<f32> {
    let ledger = Ledger::new();
    let dev = ferrotron_tensor::Device {
        ledger: &ledger,
        backend: &CpuBackend::default(),
    };
    g.optimizer_view(dev, 0..g.len()).host().to_vec()
}

/// Central differences (step 3e-3) on every router element and eight elements of every other
/// tensor; the relative error `‖fd − analytic‖ / ‖fd‖` per kind of parameter must stay below
/// 1e-2 (measured 1e-4 to 2e-3, the f32 rounding of the objective over the step). Elements
/// whose step changes the routing (a discontinuity) are skipped: at most 10%.
#[test]
fn moe_gradient_matches_finite_differences() {
    let cfg = ModelConfig {
        hidden: 16,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ffn: 24,
        vocab: 19,
        seq_len: 9,
        experts: 4,
        top_k: 2,
        ..ModelConfig::default()
    };
    let model = Llama::new(&cfg);
    let ledger = Ledger::new();
    let mut w = ledger.zeros::<f32>(Category::Weights, model.layout.total);
    init_params(&model.layout, 11, w.host_mut());
    // Larger weights than the default init: gradients well above rounding, routing margins
    // well above the finite-difference step.
    for spec in &model.layout.params {
        if spec.init_std.is_some() {
            w[spec.range()]
                .host_mut()
                .iter_mut()
                .for_each(|x| *x *= 15.0);
        } else {
            let r = spec.range();
            w[r].host_mut()
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = 1.0 + 0.1 * (i as f32).sin());
        }
    }
    let aux_weight = 0.5;
    let mut weights = Store::F32(w);
    let mut grads = Grads::new(&ledger, StoreDType::F32, false, model.layout.total);
    let (_, base_counts) = objective(&model, &weights, Some(&mut grads), aux_weight);
    let analytic = host(&grads);
    // The load-balancing term is a sizeable part of the router's gradient, so it is tested.
    let mut without = Grads::new(&ledger, StoreDType::F32, false, model.layout.total);
    objective(&model, &weights, Some(&mut without), 0.0);
    let without = host(&without);
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for spec in model
        .layout
        .params
        .iter()
        .filter(|p| p.name.contains("gate.weight"))
    {
        for i in spec.range() {
            diff += ((analytic[i] - without[i]) as f64).powi(2);
            norm += (analytic[i] as f64).powi(2);
        }
    }
    let share = (diff / norm).sqrt();
    eprintln!("load-balancing share of the router gradient: {share:.2}");
    assert!(share > 0.1, "{share}");
    let kinds = [
        ("router", "block_sparse_moe.gate"),
        ("w1", ".w1."),
        ("w2", ".w2."),
        ("w3", ".w3."),
        ("attention", "self_attn"),
        ("norms", "norm"),
        ("embedding/head", ""),
    ];
    let mut sums = vec![(0.0f64, 0.0f64, 0usize); kinds.len()];
    let (mut checked, mut skipped) = (0, 0);
    let step = 3e-3f32;
    for spec in &model.layout.params {
        let kind = kinds
            .iter()
            .position(|(_, key)| spec.name.contains(key))
            .unwrap();
        // Every router element (their gradient carries the load-balancing term), eight of
        // every other tensor.
        let stride = if kind == 0 {
            1
        } else {
            spec.numel().div_ceil(8)
        };
        for i in spec.range().step_by(stride) {
            let mut at = |delta: f32| {
                let Store::F32(w) = &mut weights else {
                    unreachable!()
                };
                let orig = w.host()[i];
                w.host_mut()[i] = orig + delta;
                let out = objective(&model, &weights, None, aux_weight);
                let Store::F32(w) = &mut weights else {
                    unreachable!()
                };
                w.host_mut()[i] = orig;
                out
            };
            let ((plus, cp), (minus, cm)) = (at(step), at(-step));
            if cp != base_counts || cm != base_counts {
                skipped += 1;
                continue;
            }
            let fd = (plus - minus) / (2.0 * step as f64);
            let s = &mut sums[kind];
            s.0 += (fd - analytic[i] as f64).powi(2);
            s.1 += fd * fd;
            s.2 += 1;
            checked += 1;
        }
    }
    assert!(
        skipped * 10 <= checked,
        "{skipped} of {checked} steps flip routing"
    );
    for ((name, _), (num, den, n)) in kinds.iter().zip(&sums) {
        assert!(*n >= 3, "{name}: only {n} elements checked");
        let rel = (num / den).sqrt();
        eprintln!("d/d{name}: relative error {rel:.2e} over {n} elements");
        assert!(rel < 1e-2, "d/d{name}: relative error {rel:e}");
    }
}
