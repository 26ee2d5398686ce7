//! The library call `Run`: the metrics it streams and the summary it returns are the run's
//! own (the same losses, bit for bit, as driving the trainers step by step), and the
//! settings it does not honour are refused before any work, naming the field.

use ferrotron_config::{CommBackend, Config, DType, Device};
use ferrotron_train::launch::on_thread_ranks;
use ferrotron_train::{Init, Run};

fn small() -> Config {
    let mut c = Config::default();
    c.model.hidden = 32;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 32;
    c.model.seq_len = 16;
    c.train.steps = 4;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 1;
    c.train.dtype = DType::F32;
    c.train.threads = 1;
    c.parallel.dp = 2;
    c.parallel.comm_timeout_s = 60.0;
    c
}

#[test]
fn a_run_streams_its_steps_and_returns_its_summary() {
    let c = small();
    let mut run = Run::new(c.clone()).peak_flops(1e12).start().unwrap();
    let streamed: Vec<_> = run.by_ref().collect();
    let summary = run.wait().unwrap();
    let steps: Vec<usize> = streamed.iter().map(|s| s.step).collect();
    assert_eq!(steps, [1, 2, 3, 4]);
    assert_eq!(summary.steps, 4);
    assert_eq!(summary.final_loss.to_bits(), streamed[3].loss.to_bits());
    assert!(summary.mfu.is_some_and(|m| m > 0.0), "{:?}", summary.mfu);
    // The same run, driven step by step on the same ranks.
    let driven = on_thread_ranks(&c, Init::Fresh, |mut t| {
        (0..c.train.steps)
            .map(|_| t.step().map(|s| s.loss))
            .collect::<Result<Vec<f64>, _>>()
    })
    .unwrap();
    let want: Vec<u64> = driven[0].iter().map(|l| l.to_bits()).collect();
    let got: Vec<u64> = streamed.iter().map(|s| s.loss.to_bits()).collect();
    assert_eq!(got, want, "the library call's losses are the run's");
}

#[test]
fn settings_a_library_run_cannot_honour_are_refused_before_any_work() {
    type Set = fn(&mut Config);
    let cases: [(&str, Set); 3] = [
        ("checkpoint.every", |c| c.checkpoint.every = 2),
        ("parallel.backend", |c| {
            c.parallel.backend = CommBackend::Mpi
        }),
        ("train.device", |c| c.train.device = Device::Cuda),
    ];
    for (field, set) in cases {
        let mut c = small();
        set(&mut c);
        let err = Run::new(c).start().err().expect(field).to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    let err = Run::new(small()).from_weights(vec![0.0; 3]).start().err();
    let err = err.expect("a wrong weight count").to_string();
    assert!(err.contains("3 weights for a model of"), "{err}");
}

#[test]
fn a_stopped_run_ends_every_rank_after_the_same_step() {
    let mut c = small();
    c.train.steps = 10_000;
    let mut run = Run::new(c.clone()).start().unwrap();
    let first = run.next().expect("a first step");
    run.stop();
    let rest: Vec<_> = run.by_ref().collect();
    let summary = run.wait().expect("a stopped run is not a failure");
    let taken = 1 + rest.len();
    assert_eq!(first.step, 1);
    assert_eq!(summary.status, "interrupted");
    assert_eq!(summary.stopped_by.as_deref(), Some("requested"));
    assert_eq!(summary.stopped_at_step, Some(taken));
    assert_eq!(summary.steps, taken);
    assert!(taken < 10_000, "stopped at {taken}");
    // Every rank stopped after that step: a rank that went on would have waited in its next
    // step's collectives and failed the run with a timeout instead.
    let last = rest.last().unwrap_or(&first);
    assert_eq!(summary.final_loss.to_bits(), last.loss.to_bits());
}

/// A peak far below the machine's (as one measured while other processes took the cores):
/// the denominator is raised to what the run's own products reached, so MFU stays at most
/// 100% on every step and in the summary.
#[test]
fn mfu_never_exceeds_what_the_runs_own_products_reached() {
    let mut c = small();
    // Products of 2 × 256 × 128 × 512 FLOPs and more: large enough to be timed.
    c.model.hidden = 128;
    c.model.ffn = 512;
    c.model.seq_len = 64;
    c.train.micro_batch = 4;
    c.train.grad_accum = 1;
    c.train.steps = 3;
    let injected = 1e6;
    let mut run = Run::new(c).peak_flops(injected).start().unwrap();
    let steps: Vec<_> = run.by_ref().collect();
    let summary = run.wait().unwrap();
    assert!(summary.peak_from_products);
    let peak = summary.peak_gflops.unwrap() * 1e9;
    assert!(
        peak > 1000.0 * injected,
        "raised to the products' rate: {peak}"
    );
    for s in &steps {
        let mfu = s.mfu.unwrap();
        assert!(mfu > 0.0 && mfu <= 1.0, "step {}: MFU {mfu}", s.step);
    }
    let mfu = summary.mfu.unwrap();
    assert!(mfu > 0.0 && mfu <= 1.0, "MFU {mfu}");
    // Against the injected peak the same run would have claimed thousands of percent.
    assert!(mfu * peak / injected > 10.0);
}
