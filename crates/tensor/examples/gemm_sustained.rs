//! The f32 GEMM rate sustained over time, against its best burst (the peak `bench` caches):
//! `cargo run --release -p ferrotron-tensor --example gemm_sustained -- SIDE SECONDS THREADS`.
//! Runs `[SIDE×SIDE]·[SIDE×SIDE]ᵀ` back to back for SECONDS and prints the median rate of
//! each tenth of the run, the best call and the median of all, in GFLOP/s.

use ferrotron_tensor::linear::{matmul, Mat, Threads};
use std::time::{Duration, Instant};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments: SIDE SECONDS THREADS"))
        .collect();
    let [n, seconds, threads] = args[..] else {
        panic!("arguments: SIDE SECONDS THREADS")
    };
    let a: Vec<f32> = (0..n * n).map(|i| (i as f32 * 0.37).sin()).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i as f32 * 0.71).sin()).collect();
    let mut c = vec![0.0f32; n * n];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let flops = 2.0 * (n * n * n) as f64;
    let rates = pool.install(|| {
        let (start, mut rates) = (Instant::now(), Vec::new());
        while start.elapsed() < Duration::from_secs(seconds as u64) {
            let t = Instant::now();
            matmul(
                n,
                n,
                n,
                &mut c,
                Mat::rows(n),
                false,
                &a,
                Mat::rows(n),
                &b,
                Mat::transposed(n),
                Threads::Pool,
            );
            rates.push(flops / t.elapsed().as_secs_f64() / 1e9);
        }
        rates
    });
    let tenth = (rates.len() / 10).max(1);
    let deciles: Vec<String> = rates
        .chunks(tenth)
        .map(|c| format!("{:.0}", median(&mut c.to_vec())))
        .collect();
    let best = rates.iter().cloned().fold(0.0, f64::max);
    let all = median(&mut rates.clone());
    println!(
        "{n}³, {threads} threads, {} calls in {seconds} s: best {best:.0} GFLOP/s, median {all:.0} \
         ({:.0}% of the best); median of each tenth: {}",
        rates.len(),
        100.0 * all / best,
        deciles.join(" ")
    );
}
