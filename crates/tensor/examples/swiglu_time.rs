//! Times SwiGLU forward and backward on one shape: `cargo run --release --example swiglu_time
//! -- TOKENS FFN THREADS`. Prints the best of 40 forward and backward calls, three times (the
//! docs/cpu-performance.md's SwiGLU figures).

use ferrotron_tensor::swiglu::{swiglu_backward, swiglu_forward};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments: TOKENS FFN THREADS"))
        .collect();
    let [t, f, threads] = args[..] else {
        panic!("arguments: TOKENS FFN THREADS")
    };
    let n = t * f;
    let data = |k: f32, s: f32| {
        (0..n)
            .map(|i| ((i as f32) * k).sin() * s)
            .collect::<Vec<_>>()
    };
    let (gate, up, dact) = (data(0.37, 4.0), data(0.71, 1.0), data(0.13, 0.1));
    let (mut act, mut dgate, mut dup) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    pool.install(|| {
        for _ in 0..3 {
            let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
            for _ in 0..40 {
                let s = Instant::now();
                swiglu_forward(&mut act, &gate, &up);
                fwd = fwd.min(s.elapsed().as_secs_f64());
                let s = Instant::now();
                swiglu_backward(&mut dgate, &mut dup, &dact, &gate, &up);
                bwd = bwd.min(s.elapsed().as_secs_f64());
            }
            std::hint::black_box((&act, &dgate, &dup));
            println!(
                "tokens {t} ffn {f}, {threads} threads: forward {:.3} ms, backward {:.3} ms",
                fwd * 1e3,
                bwd * 1e3
            );
        }
    });
}
