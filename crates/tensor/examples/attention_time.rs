//! Times the attention kernels on one shape: `cargo run --release --example attention_time --
//! BATCH SEQ HEADS HEAD_DIM THREADS`. Prints the best of 60 forward and backward calls, three
//! times (docs/cpu-performance.md's attention figures).

use ferrotron_tensor::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("arguments: BATCH SEQ HEADS HEAD_DIM THREADS")
        })
        .collect();
    let [b, s, h, d, threads] = args[..] else {
        panic!("arguments: BATCH SEQ HEADS HEAD_DIM THREADS")
    };
    let sh = AttnShape {
        batch: b,
        seq: s,
        heads: h,
        kv_heads: h,
        head_dim: d,
    };
    let n = b * s * h * d;
    let data = |f: f32| (0..n).map(|i| ((i as f32) * f).sin()).collect::<Vec<_>>();
    let (q, k, v) = (data(0.37), data(0.71), data(0.13));
    let (mut out, mut lse) = (vec![0.0; n], vec![0.0; b * h * s]);
    let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let mut delta = vec![0.0; b * h * s];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    pool.install(|| {
        for _ in 0..3 {
            let (mut fwd, mut bwd) = (f64::MAX, f64::MAX);
            for _ in 0..60 {
                let t = Instant::now();
                attention_forward(&mut out, &mut lse, &q, &k, &v, sh);
                fwd = fwd.min(t.elapsed().as_secs_f64());
                let saved: AttnSaved = AttnSaved {
                    q: &q,
                    k: &k,
                    v: &v,
                    out: &out,
                    lse: &lse,
                };
                let t = Instant::now();
                attention_backward(&mut dq, &mut dk, &mut dv, &mut delta, &q, saved, sh);
                bwd = bwd.min(t.elapsed().as_secs_f64());
            }
            println!(
                "batch {b} seq {s} heads {h} head_dim {d}, {threads} threads: forward {:.3} ms, backward {:.3} ms",
                fwd * 1e3,
                bwd * 1e3
            );
        }
    });
}
