//! Where the engine runs a configuration, the estimate equals its memory ledger exactly. The
//! expected numbers are derived by hand here from the engine's documented rules (and match
//! what crates/train's `ledger.rs` and `dp_parity.rs` tests assert against the ledger).

use ferrotron_config::{Config, DType};
use ferrotron_plan::{
    balanced_pp_layers, estimate, Category, Job, Layout, ModelSpec, Recompute, Schedule,
};

/// The model of crates/train `dp_parity.rs`: hidden 64, 2 layers, heads 4, kv 2, ffn 128,
/// seq 32, vocab 64, buckets of 0.05 MB. Units: embedding 4096, blocks 36992, head 4160;
/// Ψ = 82240. Buckets (backward order, f32 12500 or bf16 25000 elements): 41152 (head +
/// block 1), 36992, 4096. Over 3 ranks the largest shard is 27415 elements (ZeRO-3's unit
/// buckets give the same), over 4 ranks exactly 20560.
fn parity_config(dtype: DType, dp: usize, zero: u8) -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 128;
    c.model.seq_len = 32;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.dtype = dtype;
    c.parallel.bucket_mb = 0.05;
    c.parallel.dp = dp;
    c.parallel.zero = zero;
    c
}

#[test]
fn zero_shards_match_the_ledger_per_rank() {
    const PSI: u64 = 82_240;
    for (dp, psi_r) in [(3, 27_415u64), (4, 20_560)] {
        for (dtype, accum) in [
            (DType::F32, false),
            (DType::Bf16, false),
            (DType::Bf16, true),
        ] {
            let (w, g, o) = match (dtype, accum) {
                (DType::F32, _) => (4, 4, 8),
                (_, false) => (2, 2, 12),
                (_, true) => (2, 6, 12),
            };
            for zero in 0..=3u8 {
                let mut c = parity_config(dtype, dp, zero);
                c.train.fp32_grad_accum = accum;
                let e = estimate(&Job::from_config(&c).unwrap()).unwrap();
                let by = |stage: u8| if zero >= stage { psi_r } else { PSI };
                let what = format!("dp={dp} {dtype:?} accum={accum} zero={zero}");
                assert_eq!(e.params, PSI, "{what}");
                assert_eq!(e.memory.weights, w * by(3), "{what}");
                assert_eq!(e.memory.gradients, g * by(2), "{what}");
                assert_eq!(e.memory.optimizer, o * by(1), "{what}");
                assert_eq!(e.stages[0].shard, by(1), "{what}");
            }
        }
    }
}

/// crates/train `ledger.rs`: the default model with 3 layers, kv_heads 2, micro-batch 2
/// (T = 256 tokens, h 128, a 4, d 32, a_kv 2, h_ff 384): per block 256·1664 stored elements
/// + 2·256 + 2·4·128 f32 statistics; outside 256·128 stored + 256 f32.
#[test]
fn activation_peak_matches_the_ledger() {
    let mut c = Config::default();
    c.model.layers = 3;
    c.model.kv_heads = 2;
    c.train.micro_batch = 2;
    c.train.grad_accum = 4; // micro-batches run one after another: no effect on the peak
    let stored = 3 * 256 * 1664 + 256 * 128;
    let stats = 3 * (2 * 256 + 2 * 4 * 128) + 256;
    let e = estimate(&Job::from_config(&c).unwrap()).unwrap();
    assert_eq!(e.memory.activations, 4 * (stored + stats));
    assert_eq!(e.memory.activations, 5_262_336);
    c.train.dtype = DType::Bf16;
    let e = estimate(&Job::from_config(&c).unwrap()).unwrap();
    assert_eq!(e.memory.activations, 2 * stored + 4 * stats);
    assert_eq!(e.memory.activations, 2_640_896);
    assert_eq!(
        e.activation_per_layer,
        2 * 256 * 1664 + 4 * (2 * 256 + 2 * 4 * 128)
    );
    assert!(
        e.notes[1].starts_with("activations: exact"),
        "{:?}",
        e.notes
    );
}

/// Dimensions the engine does not run follow the playbook's rules on top of the same count.
#[test]
fn pipeline_schedules_and_recompute_scale_activations() {
    let mut model = ModelSpec::preset("llama3-8b").unwrap();
    model.config.seq_len = 4096;
    // The planner's compute-balanced split: 9, 9, 8 blocks, and 6 with the head.
    let layout = Layout::default().with(|l| {
        l.pp = 4;
        l.grad_accum = 16;
        l.pp_layers = Some(balanced_pp_layers(&model, 4));
    });
    let job = |l: Layout| Job {
        model: model.clone(),
        layout: l,
    };
    let one_f = estimate(&job(layout.clone())).unwrap();
    let afab = estimate(&job(layout.clone().with(|l| {
        l.pp_schedule = Schedule::Afab;
    })))
    .unwrap();
    // Stage 0 holds 9 blocks: 1F1B keeps p = 4 micro-batches, AFAB all 16.
    let block = one_f.activation_per_layer as f64;
    assert_eq!(one_f.stages[0].layers, 9);
    assert_eq!(one_f.stages[0].micro_batches_in_flight, 4.0);
    assert!((one_f.stages[0].activation_blocks as f64 - 36.0 * block).abs() <= 1.0);
    assert!((afab.stages[0].activation_blocks as f64 - 144.0 * block).abs() <= 1.0);
    assert_eq!(one_f.stages[3].micro_batches_in_flight, 1.0);
    assert_eq!(one_f.stages[3].layers, 6);
    // The engine's default split is even: 8 blocks per stage.
    let even = estimate(&job(layout.clone().with(|l| {
        l.pp_layers = None;
    })))
    .unwrap();
    assert_eq!(even.stages[0].layers, 8);
    assert!((even.stages[0].activation_blocks as f64 - 32.0 * block).abs() <= 1.0);
    // Full recomputation keeps only each block's input: T·h bf16 = 32 MiB per block.
    let full = estimate(&job(layout.clone().with(|l| {
        l.recompute = Recompute::Full;
    })))
    .unwrap();
    assert_eq!(full.activation_per_layer, 4096 * 4096 * 2);
    // TP 8 with SP divides everything by 8; CP 2 halves the tokens.
    let tp = estimate(&job(layout.clone().with(|l| {
        l.tp = 8;
        l.sequence_parallel = true;
    })))
    .unwrap();
    assert!((tp.activation_per_layer as f64 * 8.0 - block).abs() <= 8.0);
    let cp = estimate(&job(layout.clone().with(|l| {
        l.cp = 2;
    })))
    .unwrap();
    assert!((cp.activation_per_layer as f64 * 2.0 - block).abs() <= 2.0);
}

#[test]
fn the_dominant_category_and_the_fit_are_reported() {
    let model = ModelSpec::preset("llama3-70b").unwrap();
    let e = estimate(&Job {
        model,
        layout: Layout::default().with(|l| {
            l.dp = 8;
        }),
    })
    .unwrap();
    assert_eq!(e.dominant, Category::Optimizer);
    assert_eq!(e.memory.optimizer, 12 * 70_553_706_496);
    assert!(!e.fits(80 << 30));
    let model = ModelSpec::preset("tiny").unwrap();
    let e = estimate(&Job {
        model,
        layout: Layout::default(),
    })
    .unwrap();
    assert!(e.fits(80 << 30));
}

fn small(pp: usize) -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 4;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 160;
    c.model.seq_len = 32;
    c.model.vocab = 80;
    c.train.micro_batch = 3;
    c.train.grad_accum = 4;
    c.parallel.pp = pp;
    c
}

/// crates/train `tp_parity.rs`: per block `T_r·4h + T·(2ad + 2a_kv·d + 2h_ff)/t` stored +
/// `2·T_r + b·a·s/t` f32, outside `T_r·h + T_r`, `T_r = T/t` with sequence parallelism.
#[test]
fn tensor_and_sequence_parallel_activations_match_the_engine() {
    let (t_tokens, h, a, akv, d, f, layers) = (96, 64, 4, 2, 16, 160, 4);
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let mut c = small(1);
        c.parallel.tp = tp;
        c.parallel.sequence_parallel = sp;
        let tr = if sp { t_tokens / tp } else { t_tokens };
        let per_layer = tr * 4 * h
            + t_tokens * (2 * a * d + 2 * akv * d + 2 * f) / tp
            + 2 * tr
            + 3 * a * 32 / tp;
        let e = estimate(&Job::from_config(&c).unwrap()).unwrap();
        assert_eq!(
            e.memory.activations,
            4 * (layers * per_layer + tr * h + tr) as u64
        );
    }
}

/// Pipeline stages, measured on the engine's ledger (f32, 2 stages of 2 blocks, m = 4): a
/// block saves 297216 bytes per micro-batch; 1F1B keeps 2 micro-batches on stage 0 plus the
/// output being sent (96·64·4), 1 on stage 1 plus the head's input and statistics. Zero
/// bubble also keeps each block's weight-gradient inputs (430080 bytes) from B to W: the
/// replayed schedule peaks at 1579776 and 1845504 bytes, as the ledger does. DualPipeV holds
/// 2p + 1 = 5 chunks of one block on either rank at its peak, plus the head's input and
/// statistics on rank 0 (which holds the head) or the output being sent on rank 1: the
/// ledger's 1511040 and 1510656 bytes.
#[test]
fn pipeline_activation_peaks_match_the_engine() {
    let block = 297_216u64;
    let mut c = small(2);
    let e = estimate(&Job::from_config(&c).unwrap()).unwrap();
    assert_eq!(e.stages[0].memory.activations, 4 * block + 96 * 64 * 4);
    assert_eq!(
        e.stages[1].memory.activations,
        2 * block + (96 * 64 + 96) * 4
    );
    c.parallel.pp_schedule = ferrotron_config::PpSchedule::ZeroBubble;
    let e = estimate(&Job::from_config(&c).unwrap()).unwrap();
    assert_eq!(e.stages[0].memory.activations, 1_579_776);
    assert_eq!(e.stages[1].memory.activations, 1_845_504);
    c.parallel.pp_schedule = ferrotron_config::PpSchedule::DualPipeV;
    let e = estimate(&Job::from_config(&c).unwrap()).unwrap();
    assert_eq!(
        e.stages[0].memory.activations,
        5 * block + (96 * 64 + 96) * 4
    );
    assert_eq!(e.stages[1].memory.activations, 5 * block + 96 * 64 * 4);
}
