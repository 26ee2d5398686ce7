//! Document masking against the model run on each document alone: two packed sequences, cut
//! into documents of different lengths (one of a single token), give the same summed loss and
//! the same weight gradients as every document run as a sequence of its own, with RoPE
//! positions from 0 — under every recomputation policy. The unmasked run differs, so the
//! comparison can fail.

use ferrotron_config::{ModelConfig, Recompute};
use ferrotron_model::{init_params, Documents, Grads, Llama, StepCtx};
use ferrotron_tensor::{Category, CpuBackend, Ledger, Store, StoreDType};

const SEQ: usize = 40;

fn config(seq_len: usize) -> ModelConfig {
    ModelConfig {
        hidden: 32,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        ffn: 48,
        vocab: 23,
        seq_len,
        ..ModelConfig::default()
    }
}

/// Where each sequence's documents start.
fn cuts() -> [Vec<usize>; 2] {
    [vec![0, 13, 14, 29], vec![0, 21]]
}

fn starts() -> Vec<usize> {
    cuts()
        .iter()
        .flat_map(|c| (0..SEQ).map(move |i| *c.iter().rev().find(|&&s| s <= i).unwrap()))
        .collect()
}

/// Tokens of the two sequences: `(inputs, targets)`.
fn tokens() -> (Vec<u32>, Vec<u32>) {
    let t = 2 * SEQ as u32;
    let inputs = (0..t).map(|i| (i * 7 + 3) % 23).collect();
    let targets = (0..t).map(|i| (i * 5 + 1) % 23).collect();
    (inputs, targets)
}

/// Summed token loss and the weight gradients (scaled by 1 / all tokens) of `runs`, each a
/// (model, token range, documents) forward and backward into the same gradients.
struct Step {
    loss: f64,
    grads: Vec<f32>,
}

fn weights(ledger: &Ledger, model: &Llama) -> Store {
    let mut w = ledger.zeros::<f32>(Category::Weights, model.layout.total);
    init_params(&model.layout, 5, w.host_mut());
    Store::F32(w)
}

fn ctx<'a>(
    (ledger, backend): (&'a Ledger, &'a CpuBackend),
    cfg: &ModelConfig,
    recompute: Recompute,
    documents: Option<&'a Documents>,
) -> StepCtx<'a> {
    StepCtx {
        ledger,
        backend,
        act_dtype: StoreDType::F32,
        loss_chunk: 7,
        tp: None,
        cp: None,
        trace: None,
        micro_batch: Default::default(),
        recompute,
        moe: ferrotron_model::MoeStep::new(cfg, None, 0.0),
        documents,
        fp8: ferrotron_config::Fp8::Off,
        fp8_history: None,
    }
}

/// One forward and backward of `model` over the tokens `span` (of both sequences'
/// `2·SEQ`), each token's loss scaled by 1 / all tokens, into `grads`; the summed loss.
fn train_on(
    model: &Llama,
    (ctx, w): (&StepCtx<'_>, &Store),
    grads: &mut Grads,
    span: std::ops::Range<usize>,
) -> f64 {
    let (inputs, targets) = tokens();
    let up = |v: &[u32]| {
        ctx.ledger
            .upload(Category::Workspace, "test", &v[span.clone()])
    };
    let scale = 1.0 / inputs.len() as f32;
    let (inputs, targets) = (up(&inputs), up(&targets));
    model
        .forward_backward(ctx, w, Some(grads), &inputs, &targets, scale)
        .unwrap()
}

/// The packed batch in one forward and backward, with or without document masking.
fn packed(recompute: Recompute, masked: bool) -> Step {
    let cfg = config(SEQ);
    let model = Llama::new(&cfg);
    let (ledger, backend) = (Ledger::new(), CpuBackend::default());
    let w = weights(&ledger, &model);
    let docs = Documents::new();
    docs.set(&ledger, 0, starts());
    let ctx = ctx(
        (&ledger, &backend),
        &cfg,
        recompute,
        masked.then_some(&docs),
    );
    let mut grads = Grads::new(&ledger, StoreDType::F32, false, model.layout.total);
    let loss = train_on(&model, (&ctx, &w), &mut grads, 0..2 * SEQ);
    let grads = grads
        .optimizer_view(ctx.device(), 0..model.layout.total)
        .host()
        .to_vec();
    Step { loss, grads }
}

/// Every document as a sequence of its own (positions from 0), into one set of gradients.
fn per_document() -> Step {
    let full = Llama::new(&config(SEQ));
    let (ledger, backend) = (Ledger::new(), CpuBackend::default());
    let w = weights(&ledger, &full);
    let mut grads = Grads::new(&ledger, StoreDType::F32, false, full.layout.total);
    let mut loss = 0.0;
    for (row, cuts) in cuts().iter().enumerate() {
        for (i, &a) in cuts.iter().enumerate() {
            let e = cuts.get(i + 1).copied().unwrap_or(SEQ);
            let cfg = config(e - a);
            let model = Llama::new(&cfg);
            assert_eq!(model.layout.total, full.layout.total, "same parameters");
            let ctx = ctx((&ledger, &backend), &cfg, Recompute::None, None);
            loss += train_on(&model, (&ctx, &w), &mut grads, row * SEQ + a..row * SEQ + e);
        }
    }
    let dev = ferrotron_tensor::Device {
        ledger: &ledger,
        backend: &backend,
    };
    let grads = grads
        .optimizer_view(dev, 0..full.layout.total)
        .host()
        .to_vec();
    Step { loss, grads }
}

/// Largest gradient difference relative to the largest gradient.
fn grad_error(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
    diff / scale
}

#[test]
fn a_packed_batch_trains_as_its_documents_alone() {
    let want = per_document();
    for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
        let got = packed(recompute, true);
        let loss_err = (got.loss - want.loss).abs() / want.loss;
        let grad_err = grad_error(&got.grads, &want.grads);
        eprintln!(
            "{recompute:?}: loss {} vs {} (rel {loss_err:.1e}), gradients rel {grad_err:.1e}",
            got.loss, want.loss
        );
        assert!(
            loss_err < 1e-6,
            "{recompute:?}: loss {} vs per-document {}",
            got.loss,
            want.loss
        );
        assert!(
            grad_err < 1e-5,
            "{recompute:?}: gradients differ by {grad_err:.1e}"
        );
    }
    let plain = packed(Recompute::None, false);
    assert!(
        (plain.loss - want.loss).abs() / want.loss > 1e-4,
        "masking changed nothing"
    );
    assert!(grad_error(&plain.grads, &want.grads) > 1e-3);
}
