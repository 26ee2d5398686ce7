//! The whole model's gradient against central finite differences on a tiny config with
//! grouped-query attention (kv_heads < heads) and two micro-batch sequences.
//!
//! Objective: mean token loss (f64 sum of f32 per-token losses). Central differences with step
//! 1e-2; tolerance per derivative `1e-3 + 2e-2·|analytic|`, checked on every 5th element of
//! every parameter tensor (all tensors covered).

use ferrotron_config::ModelConfig;
use ferrotron_model::{init_params, Grads, Llama, StepCtx};
use ferrotron_tensor::{Category, CpuBackend, Ledger, Store, StoreDType};

fn tiny(tie: bool) -> ModelConfig {
    ModelConfig {
        hidden: 16,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ffn: 24,
        vocab: 19,
        seq_len: 9,
        tie_embeddings: tie,
        ..ModelConfig::default()
    }
}

fn run(tie: bool) {
    let cfg = tiny(tie);
    let model = Llama::new(&cfg);
    let ledger = Ledger::new();
    let mut weights = ledger.zeros::<f32>(Category::Weights, model.layout.total);
    init_params(&model.layout, 11, weights.host_mut());
    // Larger weights than the default init so every gradient is well above rounding noise.
    for spec in &model.layout.params {
        if spec.init_std.is_some() {
            weights[spec.range()]
                .host_mut()
                .iter_mut()
                .for_each(|w| *w *= 15.0);
        } else {
            weights[spec.range()]
                .host_mut()
                .iter_mut()
                .enumerate()
                .for_each(|(i, w)| *w = 1.0 + 0.1 * (i as f32).sin());
        }
    }
    let mut weights = Store::F32(weights);
    let t = 2 * cfg.seq_len;
    let inputs: Vec<u32> = (0..t as u32)
        .map(|i| (i * 7 + 3) % cfg.vocab as u32)
        .collect();
    let targets: Vec<u32> = (0..t as u32)
        .map(|i| (i * 5 + 1) % cfg.vocab as u32)
        .collect();
    let ids = |v: &[u32]| ledger.upload(Category::Workspace, "test", v);
    let (inputs, targets) = (ids(&inputs), ids(&targets));
    let backend = CpuBackend::default();
    let ctx = StepCtx {
        ledger: &ledger,
        backend: &backend,
        act_dtype: StoreDType::F32,
        loss_chunk: 5,
        tp: None,
        cp: None,
        trace: None,
        micro_batch: Default::default(),
        recompute: ferrotron_config::Recompute::None,
        moe: ferrotron_model::MoeStep::new(&cfg, None, 0.0),
        documents: None,
        fp8: ferrotron_config::Fp8::Off,
        fp8_history: None,
    };
    let scale = 1.0 / t as f32;
    let mut grads = Grads::new(&ledger, StoreDType::F32, false, model.layout.total);
    let loss = model
        .forward_backward(&ctx, &weights, Some(&mut grads), &inputs, &targets, scale)
        .unwrap()
        / t as f64;
    assert!(loss.is_finite());
    let analytic = grads
        .optimizer_view(ctx.device(), 0..model.layout.total)
        .host()
        .to_vec();
    let step = 1e-2f32;
    let mut checked = 0;
    for spec in &model.layout.params {
        for i in spec.range().step_by(5) {
            let Store::F32(w) = &mut weights else {
                unreachable!()
            };
            let orig = w.host()[i];
            w.host_mut()[i] = orig + step;
            let plus = model
                .forward_backward(&ctx, &weights, None, &inputs, &targets, scale)
                .unwrap();
            let Store::F32(w) = &mut weights else {
                unreachable!()
            };
            w.host_mut()[i] = orig - step;
            let minus = model
                .forward_backward(&ctx, &weights, None, &inputs, &targets, scale)
                .unwrap();
            let Store::F32(w) = &mut weights else {
                unreachable!()
            };
            w.host_mut()[i] = orig;
            let fd = (plus - minus) / (2.0 * step as f64) / t as f64;
            let an = analytic[i] as f64;
            assert!(
                (fd - an).abs() <= 1e-3 + 2e-2 * an.abs(),
                "{}[{}]: finite difference {fd} vs analytic {an}",
                spec.name,
                i - spec.offset
            );
            checked += 1;
        }
    }
    assert!(checked > 200);
    // Nothing but the weights and gradients outlives the step.
    drop((grads, inputs, targets));
    assert_eq!(ledger.snapshot().current(Category::Activations), 0);
    assert_eq!(ledger.snapshot().current(Category::Workspace), 0);
}

#[test]
fn whole_model_gradient_matches_finite_differences() {
    run(false);
}

#[test]
fn whole_model_gradient_with_tied_embeddings() {
    run(true);
}
