//! The playbook's §3 reference figures, reproduced within 5% under the assumptions that
//! produced them:
//! - ZeRO (Llama-3 8B, DP=8) and TP (Llama-3 70B): exact parameter counts (8.03B, 70.55B),
//!   bf16 weights and gradients, **8 bytes** of optimizer state (fp32 Adam m and v, no master
//!   copy: [`ByteRegime::playbook_figures`]), shards of Ψ/N_d (the engine's buckets, 25 MB),
//!   TP ÷t with norms replicated, and "GB" meaning GiB (2³⁰ bytes).
//! - Activations (8B, b=1): the Korthikanti formula `s·b·h·(34 + 5·a·s/h)` bytes per layer
//!   × 32 layers, selective `34·s·b·h`, full `2·s·b·h`; the logits outside the blocks are not
//!   part of the figures.

use ferrotron_config::DType;
use ferrotron_plan::{
    estimate_with, ActivationModel, Assumptions, ByteRegime, Job, Layout, ModelSpec, Recompute, GIB,
};

fn within(got: f64, want: f64, what: &str) {
    let err = (got - want).abs() / want;
    assert!(
        err <= 0.05,
        "{what}: {got:.3} vs playbook {want} ({:.1}% off)",
        100.0 * err
    );
    eprintln!(
        "{what}: {got:.3} vs playbook {want} ({:+.1}%)",
        100.0 * (got / want - 1.0)
    );
}

fn figures() -> Assumptions {
    Assumptions {
        activations: ActivationModel::Korthikanti,
        bytes: Some(ByteRegime::playbook_figures()),
    }
}

#[test]
fn zero_table_llama3_8b_dp8() {
    let model = ModelSpec::preset("llama3-8b").unwrap();
    // (zero, weights, gradients, optimizer) in GB (= GiB) per rank.
    let table = [
        (0u8, 15.0, 15.0, 60.0),
        (1, 15.0, 15.0, 7.5),
        (2, 15.0, 1.9, 7.5),
        (3, 1.9, 1.9, 7.5),
    ];
    for (zero, w, g, o) in table {
        let job = Job {
            model: model.clone(),
            layout: Layout::default().with(|l| {
                l.dp = 8;
                l.zero = zero;
            }),
        };
        let e = estimate_with(&job, &figures()).unwrap();
        let m = e.memory;
        within(
            m.weights as f64 / GIB,
            w,
            &format!("8B ZeRO-{zero} weights"),
        );
        within(
            m.gradients as f64 / GIB,
            g,
            &format!("8B ZeRO-{zero} gradients"),
        );
        within(
            m.optimizer as f64 / GIB,
            o,
            &format!("8B ZeRO-{zero} optimizer"),
        );
    }
    // The exact engine regime (12 bytes: fp32 master + m + v) for comparison: 89.8 GiB.
    let job = Job {
        model,
        layout: Layout::default().with(|l| {
            l.dp = 8;
        }),
    };
    let e = estimate_with(&job, &Assumptions::default()).unwrap();
    assert_eq!(e.memory.optimizer, 12 * 8_030_261_248);
}

#[test]
fn tp_table_llama3_70b() {
    let model = ModelSpec::preset("llama3-70b").unwrap();
    for (tp, w, g, o) in [(1, 131.5, 131.5, 526.0), (8, 16.4, 16.4, 65.75)] {
        let job = Job {
            model: model.clone(),
            layout: Layout::default().with(|l| {
                l.tp = tp;
                l.sequence_parallel = true;
            }),
        };
        let m = estimate_with(&job, &figures()).unwrap().memory;
        within(m.weights as f64 / GIB, w, &format!("70B t={tp} weights"));
        within(
            m.gradients as f64 / GIB,
            g,
            &format!("70B t={tp} gradients"),
        );
        within(
            m.optimizer as f64 / GIB,
            o,
            &format!("70B t={tp} optimizer"),
        );
    }
    // Norms stay replicated: at t=8 a rank holds (Ψ − norms)/8 + norms exactly, plus its
    // share of the vocabulary's padding (Megatron's rule: 128,256 rows padded to a multiple
    // of 128 × 8, 129,024, in the embedding and the untied head).
    let job = Job {
        model: model.clone(),
        layout: Layout::default().with(|l| {
            l.tp = 8;
            l.dtype = DType::F32;
        }),
    };
    let norms = 8192 * (2 * 80 + 1);
    let e = estimate_with(&job, &Assumptions::default()).unwrap();
    let padding = 2 * (129_024 - 128_256) * 8192 / 8;
    assert_eq!(
        e.stages[0].params,
        (70_553_706_496 - norms) / 8 + norms + padding
    );
}

#[test]
fn activation_table_llama3_8b() {
    let model = ModelSpec::preset("llama3-8b").unwrap();
    let table = [
        (Recompute::None, [9.3, 28.5, 97.0, 354.0]),
        (Recompute::Selective, [4.25, 8.5, 17.0, 34.0]),
        (Recompute::Full, [0.25, 0.5, 1.0, 2.0]),
    ];
    for (recompute, gib) in table {
        for (seq, want) in [1024, 2048, 4096, 8192].into_iter().zip(gib) {
            let mut model = model.clone();
            model.config.seq_len = seq;
            let job = Job {
                model,
                layout: Layout::default().with(|l| {
                    l.recompute = recompute;
                }),
            };
            let e = estimate_with(&job, &figures()).unwrap();
            let blocks = e.stages[0].activation_blocks as f64 / GIB;
            within(blocks, want, &format!("8B {recompute:?} seq {seq}"));
        }
    }
}

/// The engine's own count for the same model, to show the difference: flash attention keeps
/// no scores, so activations grow linearly in s (13.5 GiB at 4k in bf16 instead of 97).
#[test]
fn engine_activations_are_linear_in_seq() {
    let mut per_seq = Vec::new();
    for seq in [1024, 2048, 4096, 8192] {
        let mut model = ModelSpec::preset("llama3-8b").unwrap();
        model.config.seq_len = seq;
        let job = Job {
            model,
            layout: Layout::default(),
        };
        let e = estimate_with(&job, &Assumptions::default()).unwrap();
        per_seq.push(e.stages[0].activation_blocks as f64 / GIB);
    }
    eprintln!("engine bf16 8B activations (GiB) at 1k/2k/4k/8k: {per_seq:.2?}");
    // Per block per token: 2·(4h + 2·a·d + 2·a_kv·d + 2·h_ff) + 4·(2 + a) bytes.
    let per_token = 2.0 * (4.0 * 4096.0 + 2.0 * 4096.0 + 2.0 * 1024.0 + 2.0 * 14336.0) + 4.0 * 34.0;
    let want = 32.0 * 4096.0 * per_token / GIB;
    assert!((per_seq[2] - want).abs() < 1e-9, "{} vs {want}", per_seq[2]);
    assert!((per_seq[3] / per_seq[0] - 8.0).abs() < 1e-9);
}
