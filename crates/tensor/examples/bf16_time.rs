//! Times a linear layer's three products on `gemm` (f32) and on the bf16 products
//! (`train.matmul = "bf16"`, AVX-512 BF16), alternating call by call:
//! `cargo run --release -p ferrotron-tensor --example bf16_time -- TOKENS IN OUT THREADS`.
//! Prints each product's median GFLOP/s over 15 alternating pairs and the median of the
//! pairs' ratios.

use ferrotron_tensor::linear::HostMatmul;
use std::time::Instant;

const USAGE: &str = "arguments: TOKENS IN OUT THREADS";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect(USAGE))
        .collect();
    let [t, d_in, d_out, threads] = args[..] else {
        panic!("{USAGE}")
    };
    if !ferrotron_tensor::bf16_gemm::available() {
        eprintln!("this CPU lacks AVX-512 BF16");
        return;
    }
    let x: Vec<f32> = (0..t * d_in).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..d_out * d_in).map(|i| (i as f32 * 0.71).sin()).collect();
    let dy: Vec<f32> = (0..t * d_out).map(|i| (i as f32 * 0.13).sin()).collect();
    let (mut y, mut dx, mut dw) = (
        vec![0.0; t * d_out],
        vec![0.0; t * d_in],
        vec![0.0; d_out * d_in],
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let flops = 2.0 * (t * d_in * d_out) as f64 / 1e9;
    pool.install(|| {
        for (name, product) in ["forward", "backward input", "backward weight"].iter().zip(0..) {
            let mut run = |mm: &HostMatmul| {
                let s = Instant::now();
                match product {
                    0 => mm.linear_forward(&mut y, &x, &w, t, d_in, d_out),
                    1 => mm.linear_backward_input(&mut dx, &dy, &w, t, d_in, d_out, false),
                    _ => mm.linear_backward_weight(&mut dw, &dy, &x, t, d_in, d_out),
                }
                flops / s.elapsed().as_secs_f64()
            };
            let (mut f32s, mut bf16s, mut ratios) = (vec![], vec![], vec![]);
            for i in 0..17 {
                let (a, b) = (run(&HostMatmul::Gemm), run(&HostMatmul::Bf16));
                if i >= 2 {
                    f32s.push(a);
                    bf16s.push(b);
                    ratios.push(b / a);
                }
            }
            println!(
                "{t}×{d_in}→{d_out} {name}: gemm f32 {:.1} GFLOP/s, bf16 {:.1} GFLOP/s, ratio {:.2}",
                median(f32s),
                median(bf16s),
                median(ratios)
            );
        }
    });
}
