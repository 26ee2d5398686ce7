//! Times a linear layer's forward product on `gemm` two ways, alternating call by call (median and best of 41 pairs): the
//! weight read as stored (`[out, in]`, strided) and `linear_forward` as built (through a
//! transposed copy where `ferrotron_config::forward_transposes_weight` says so), and checks
//! that both give the same numbers:
//! `cargo run --release -p ferrotron-tensor --example fwd_layout -- TOKENS IN OUT THREADS`.

use ferrotron_tensor::linear::{linear_forward, matmul, Mat, Threads};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments: TOKENS IN OUT THREADS"))
        .collect();
    let [t, d_in, d_out, threads] = args[..] else {
        panic!("arguments: TOKENS IN OUT THREADS")
    };
    let x: Vec<f32> = (0..t * d_in).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..d_out * d_in)
        .map(|i| (i as f32 * 0.71).sin() * 0.05)
        .collect();
    let (mut stored, mut built) = (vec![0.0f32; t * d_out], vec![0.0f32; t * d_out]);
    let as_stored = |y: &mut [f32]| {
        let (rows, strided) = (Mat::rows(d_in), Mat::transposed(d_in));
        matmul(
            t,
            d_out,
            d_in,
            y,
            Mat::rows(d_out),
            false,
            &x,
            rows,
            &w,
            strided,
            Threads::Pool,
        )
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let (a, b) = pool.install(|| {
        let (mut a, mut b) = (vec![], vec![]);
        for _ in 0..41 {
            let s = Instant::now();
            as_stored(&mut stored);
            a.push(s.elapsed().as_secs_f64() * 1e3);
            let s = Instant::now();
            linear_forward(&mut built, &x, &w, t, d_in, d_out);
            b.push(s.elapsed().as_secs_f64() * 1e3);
        }
        (a, b)
    });
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let best = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
    let (amin, bmin) = (best(&a), best(&b));
    let (a, b) = (median(a), median(b));
    let flops = 2.0 * (t * d_in * d_out) as f64 / 1e6;
    let differ = stored.iter().zip(&built).filter(|(p, q)| p != q).count();
    println!(
        "{t}×{d_in}→{d_out}, {threads} threads: as stored {a:.2} ms ({:.0} GFLOP/s), \
         linear_forward {b:.2} ms ({:.0} GFLOP/s, transposed copy: {}), {:.2}× (best of 41: {:.2}×); {differ} of {} outputs differ",
        flops / a,
        flops / b,
        ferrotron_config::forward_transposes_weight(t, d_in, d_out),
        a / b,
        amin / bmin,
        stored.len()
    );
}
