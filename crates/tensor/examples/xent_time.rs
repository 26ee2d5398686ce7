//! Times the LM head fused with cross-entropy (forward and both gradients) on one shape:
//! `cargo run --release --example xent_time -- TOKENS HIDDEN VOCAB CHUNK THREADS`. Prints the
//! best of 8 calls (docs/cpu-performance.md's LM-head figures).

use ferrotron_tensor::xent::{lm_head_xent, XentGrads};
use ferrotron_tensor::Ledger;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("arguments: TOKENS HIDDEN VOCAB CHUNK THREADS")
        })
        .collect();
    let [t, h, v, chunk, threads] = args[..] else {
        panic!("arguments: TOKENS HIDDEN VOCAB CHUNK THREADS")
    };
    let xn: Vec<f32> = (0..t * h).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..v * h).map(|i| (i as f32 * 0.71).sin() * 0.05).collect();
    let targets: Vec<u32> = (0..t).map(|i| ((i * 7919) % v) as u32).collect();
    let (mut dx, mut dw) = (vec![0.0; t * h], vec![0.0; v * h]);
    let ledger = Ledger::new();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    pool.install(|| {
        let mut best = f64::MAX;
        for _ in 0..8 {
            let grads = XentGrads {
                dx: &mut dx[..],
                dw: &mut dw[..],
                scale: 1.0 / t as f32,
            };
            let s = Instant::now();
            let loss = lm_head_xent(&Default::default(), &ledger, &xn, &w, &targets, h, v, chunk, Some(grads));
            best = best.min(s.elapsed().as_secs_f64());
            std::hint::black_box(loss);
        }
        let flops = 6.0 * (t * h * v) as f64;
        println!(
            "tokens {t} hidden {h} vocab {v} chunk {chunk}, {threads} threads: {:.1} ms, {:.1} GFLOP/s",
            best * 1e3,
            flops / best / 1e9
        );
    });
}
