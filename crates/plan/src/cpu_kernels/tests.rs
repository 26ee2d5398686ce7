//! The cost model's arithmetic on synthetic kernel times.

use super::*;
use ferrotron_config::ModelConfig;

/// The enumerated GEMMs and attention are the model's forward FLOPs, unit by unit.
#[test]
fn the_kernels_do_the_models_flops() {
    let model = ModelSpec::dense("tiny", ModelConfig::default());
    let l = Layout {
        micro_batch: 2,
        ..Layout::default()
    };
    let c = &model.config;
    let tokens = (l.micro_batch * c.seq_len) as f64;
    let k = unit_kernels(&model, &l, Unit::Block(0));
    let gemm: f64 = k.gemm.iter().map(GemmShape::flops).sum();
    let attention = 4.0 * (c.heads * c.head_dim() * c.seq_len) as f64 * tokens;
    let want = model.layer_forward_flops_per_token(0, false) * tokens;
    assert!(
        (gemm + attention - want).abs() <= 1e-9 * want,
        "{gemm} {want}"
    );
    let head = unit_kernels(&model, &l, Unit::Head).head.unwrap();
    let logits = 2.0 * (head.t * head.hidden * head.vocab) as f64;
    let want = model.head_forward_flops_per_token() * tokens;
    assert!((logits - want).abs() <= 1e-9 * want);
    // Backward: input and weight GEMM of every forward GEMM, twice the FLOPs.
    let back: f64 = backward(&k.gemm).iter().map(GemmShape::flops).sum();
    let fwd: f64 = k.gemm.iter().map(GemmShape::flops).sum();
    assert_eq!(back, 2.0 * fwd);
}

/// Synthetic times: every GEMM at 1 GFLOP/s exactly, attention 1 ms / 2 ms, the block's
/// element-wise kernels 0.5 ms / 1 ms, 1 GB/s, 1 µs per call. A block's forward is then
/// its GEMM FLOPs / 1e9 + 1.5 ms + its bytes / 1e9 + its calls × 1 µs + its allocations at
/// 2 GB/s (the backward allocates as much again), and full recomputation adds the forward
/// to the backward.
#[test]
fn a_unit_is_the_sum_of_its_kernels() {
    let model = ModelSpec::dense("tiny", ModelConfig::default());
    let l = Layout::default();
    let needs = kernel_needs(&model, &l);
    let rates = KernelRates {
        threads: 1,
        cores: 2,
        gemm: needs.gemm.iter().map(|g| (*g, g.flops() / 1e9)).collect(),
        attention: needs.attention.iter().map(|a| (*a, 1e-3, 2e-3)).collect(),
        elementwise: needs.elementwise.iter().map(|e| (*e, 5e-4, 1e-3)).collect(),
        head: needs.head.iter().map(|h| (*h, 3e-3)).collect(),
        bandwidth: 1e9,
        call_s: 1e-6,
        wake_s: 0.0,
        zero_fill: 2e9,
        skew: Vec::new(),
        peak_flops: 0.0,
    };
    assert_eq!(rates.missing(&needs), 0);
    let k = unit_kernels(&model, &l, Unit::Block(0));
    let gemm: f64 = k.gemm.iter().map(GemmShape::flops).sum();
    let (f, b) = rates.unit_seconds(&model, &l, Unit::Block(0)).unwrap();
    // Allocations at 2 GB/s: the forward's buffers, and as many again in the backward.
    let alloc = 4.0 * k.alloc / 2e9;
    let want_f = gemm / 1e9 + 1e-3 + 5e-4 + k.bytes / 1e9 + k.calls * 1e-6 + alloc;
    let want_b = 2.0 * gemm / 1e9 + 2e-3 + 1e-3 + 2.0 * (k.bytes / 1e9 + k.calls * 1e-6) + alloc;
    assert!(
        (f - want_f).abs() < 1e-12 && (b - want_b).abs() < 1e-12,
        "{f} {b}"
    );
    let full = Layout {
        parallel: ferrotron_config::ParallelConfig {
            recompute: crate::Recompute::Full,
            ..Default::default()
        },
        ..Layout::default()
    };
    let (f2, b2) = rates.unit_seconds(&model, &full, Unit::Block(0)).unwrap();
    // Full recomputation: the backward runs the forward again, allocations included.
    assert!((f2 - f).abs() < 1e-15 && (b2 - (b + f)).abs() < 1e-12);
    // Selective: attention's forward (1 ms) and the two norms (8 bytes per element of
    // t × hidden each at 1 GB/s, one call each) again.
    let selective = Layout {
        parallel: ferrotron_config::ParallelConfig {
            recompute: crate::Recompute::Selective,
            ..Default::default()
        },
        ..Layout::default()
    };
    let (f3, b3) = rates
        .unit_seconds(&model, &selective, Unit::Block(0))
        .unwrap();
    let e = k.elementwise.unwrap();
    let norms = 2.0 * (8.0 * (e.t_norm * e.hidden) as f64 / 1e9 + 1e-6);
    assert!((f3 - f).abs() < 1e-15 && (b3 - (b + 1e-3 + norms)).abs() < 1e-12);
    // Without a time or a peak, a shape is an error; with a peak, it is timed at it.
    let mut bare = rates.clone();
    bare.gemm.clear();
    assert!(bare.unit_seconds(&model, &l, Unit::Block(0)).is_err());
    bare.peak_flops = 1e9;
    assert!((bare.unit_seconds(&model, &l, Unit::Block(0)).unwrap().0 - f).abs() < 1e-12);
    // Four single-thread ranks on two cores compute at half speed.
    assert_eq!(rates.oversubscription(4), 2.0);
    assert_eq!(rates.oversubscription(2), 1.0);
}

/// A pool wake-up per parallel call: a dense block's forward makes its seven GEMMs, one
/// attention call, seven element-wise kernels and its other calls; the backward twice as many.
#[test]
fn each_parallel_call_wakes_the_pool() {
    let model = ModelSpec::dense("tiny", ModelConfig::default());
    let l = Layout::default();
    let mut rates = KernelRates {
        threads: 2,
        cores: 2,
        bandwidth: 1e9,
        call_s: 1e-6,
        peak_flops: 1e12,
        ..KernelRates::default()
    };
    let (f0, b0) = rates.unit_seconds(&model, &l, Unit::Block(0)).unwrap();
    rates.wake_s = 1e-5;
    let (f1, b1) = rates.unit_seconds(&model, &l, Unit::Block(0)).unwrap();
    let k = unit_kernels(&model, &l, Unit::Block(0));
    let calls = 7.0 + 1.0 + 7.0 + k.calls;
    assert!(
        (f1 - f0 - calls * 1e-5).abs() < 1e-12,
        "{} {}",
        f1 - f0,
        calls
    );
    assert!((b1 - b0 - 2.0 * calls * 1e-5).abs() < 1e-12);
}

/// Two timings averaged: each shape's times, and the rates; a shape or a rate only one side
/// measured keeps that side's value.
#[test]
fn two_timings_average_shape_by_shape() {
    let g = |d_out| GemmShape {
        form: GemmForm::Forward,
        t: 64,
        d_in: 32,
        d_out,
    };
    let a = KernelRates {
        threads: 2,
        cores: 2,
        gemm: vec![(g(8), 1.0), (g(16), 3.0)],
        bandwidth: 10.0,
        call_s: 0.0,
        ..KernelRates::default()
    };
    let b = KernelRates {
        threads: 1,
        gemm: vec![(g(16), 5.0), (g(32), 7.0)],
        bandwidth: 30.0,
        call_s: 4.0,
        ..KernelRates::default()
    };
    let att = AttnShape {
        batch: 1,
        seq: 64,
        heads: 2,
        kv_heads: 2,
        head_dim: 32,
        cp: 1,
    };
    let (mut a, mut b) = (a, b);
    a.attention = vec![(att, 1.0, 2.0)];
    b.attention = vec![(att, 3.0, 6.0)];
    a.skew = vec![(0.001, 0.1), (0.01, 0.02)];
    b.skew = vec![(0.001, 0.3), (0.01, 0.04)];
    let m = a.mean(&b);
    assert_eq!(m.attention, vec![(att, 2.0, 4.0)]);
    assert_eq!(m.skew.len(), 2);
    assert!((m.skew[0].1 - 0.2).abs() < 1e-12 && (m.skew[1].1 - 0.03).abs() < 1e-12);
    assert_eq!(m.gemm, vec![(g(8), 1.0), (g(16), 4.0)]);
    assert_eq!((m.threads, m.cores), (2, 2));
    assert_eq!(m.bandwidth, 20.0);
    assert_eq!(m.call_s, 4.0);
}

/// The arrival skew between measured segment lengths: linear in the logarithm of the
/// length, the nearest measurement's beyond them, none when not measured.
#[test]
fn the_skew_interpolates_in_log_length() {
    let mut rates = KernelRates {
        skew: vec![(0.001, 0.2), (0.004, 0.1), (0.016, 0.04)],
        ..KernelRates::default()
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
    assert!(close(rates.skew_fraction(0.0001), 0.2));
    assert!(close(rates.skew_fraction(0.002), 0.15));
    assert!(close(rates.skew_fraction(0.004), 0.1));
    assert!(close(rates.skew_fraction(0.008), 0.07));
    assert!(close(rates.skew_fraction(1.0), 0.04));
    // A length that is no number, or a table out of order, gives none (never a panic).
    assert_eq!(rates.skew_fraction(f64::NAN), 0.0);
    assert_eq!(rates.skew_fraction(-1.0), 0.0);
    rates.skew = vec![(0.004, 0.1), (0.001, 0.2)];
    assert_eq!(rates.skew_fraction(0.002), 0.0);
    rates.skew = vec![(0.001, 0.2)];
    assert!(close(rates.skew_fraction(0.5), 0.2));
    rates.skew.clear();
    assert_eq!(rates.skew_fraction(0.002), 0.0);
}

/// With an arrival skew of 10% at every segment length, a tensor-parallel step (no data
/// parallelism) is longer by 10% of its compute: every segment between two collectives
/// waits for the slower rank.
#[test]
fn ranks_wait_for_the_last_at_every_blocking_collective() {
    let mut config = ferrotron_config::Config::default();
    config.parallel.tp = 2;
    config.parallel.sequence_parallel = true;
    config.train.threads = 1;
    let job = crate::Job::from_config(&config).unwrap();
    let mut hw = crate::Hardware::builtin("cpu-local").unwrap();
    hw.gpus_per_node = hw.gpus_per_node.max(2);
    let mut rates = KernelRates {
        threads: 1,
        cores: 2,
        bandwidth: 1e10,
        call_s: 1e-6,
        peak_flops: 1e11,
        ..KernelRates::default()
    };
    hw.kernels = Some(rates.clone());
    let cm = crate::CostModel::default();
    let base = crate::step_cost(&job, &hw, &cm).unwrap();
    rates.skew = vec![(1e-3, 0.1)];
    hw.kernels = Some(rates);
    let skewed = crate::step_cost(&job, &hw, &cm).unwrap();
    let added = skewed.step_s - base.step_s;
    assert!(base.compute_s > 0.0);
    assert!(
        (added - 0.1 * base.compute_s).abs() < 1e-9 * base.step_s,
        "{added} against {}",
        0.1 * base.compute_s
    );
    assert_eq!(skewed.compute_s, base.compute_s);
}
