//! What OpenBLAS keeps touched for one calling thread, measured as the growth of this
//! process's resident memory, against the bound the ledger and the estimator count per
//! compute thread (`ferrotron_config::BLAS_SCRATCH_PER_THREAD`). The only test of its binary,
//! so nothing else allocates meanwhile. Needs a threaded `libopenblas.so.0` (`--features
//! openblas`).

#![cfg(feature = "openblas")]

use ferrotron_tensor::blas::{OpenBlas, BLAS_BLOCK, BLAS_SCRATCH_PER_THREAD};
use ferrotron_tensor::linear::HostMatmul;

/// This process's resident bytes (`/proc/self/statm`).
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

#[test]
fn openblas_keeps_at_most_the_counted_scratch_per_thread() {
    let mm = HostMatmul::OpenBlas(OpenBlas::load().unwrap_or_else(|e| panic!("{e}")));
    // Every dimension past one block, so each call packs the largest blocks there are.
    let (t, d_in, d_out) = (BLAS_BLOCK + 300, BLAS_BLOCK + 200, 2 * BLAS_BLOCK + 100);
    let x = vec![0.5f32; t * d_in];
    let w = vec![0.25f32; d_out * d_in];
    let dy = vec![0.125f32; t * d_out];
    let (mut y, mut dx, mut dw) = (
        vec![1.0f32; t * d_out],
        vec![1.0f32; t * d_in],
        vec![1.0f32; d_out * d_in],
    );
    // A pool of one fresh thread: the only caller, so OpenBLAS gives it one buffer.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| ());
    let before = resident();
    pool.install(|| {
        mm.linear_forward(&mut y, &x, &w, t, d_in, d_out);
        mm.linear_backward_input(&mut dx, &dy, &w, t, d_in, d_out, false);
        mm.linear_backward_weight(&mut dw, &dy, &x, t, d_in, d_out);
    });
    let grown = resident().saturating_sub(before);
    eprintln!("resident memory grew by {grown} bytes; bound {BLAS_SCRATCH_PER_THREAD}");
    assert!(
        grown <= BLAS_SCRATCH_PER_THREAD,
        "OpenBLAS kept {grown} bytes for one thread, above the counted {BLAS_SCRATCH_PER_THREAD}"
    );
    // The products ran (and the measurement saw OpenBLAS pack something).
    assert_eq!(y[0], 0.5 * 0.25 * d_in as f32);
    assert!(
        grown >= 256 * 1024,
        "only {grown} bytes: the buffer was not seen"
    );

    // Three more threads calling at once: each keeps its own buffer, so the growth is at
    // most the bound per thread that ever called.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| ());
    pool.install(|| {
        mm.linear_forward(&mut y, &x, &w, t, d_in, d_out);
        mm.linear_backward_input(&mut dx, &dy, &w, t, d_in, d_out, false);
        mm.linear_backward_weight(&mut dw, &dy, &x, t, d_in, d_out);
    });
    let grown = resident().saturating_sub(before);
    eprintln!(
        "after 3 more threads: {grown} bytes; bound {}",
        4 * BLAS_SCRATCH_PER_THREAD
    );
    assert!(
        grown <= 4 * BLAS_SCRATCH_PER_THREAD,
        "OpenBLAS kept {grown} bytes for 4 threads, above 4 × {BLAS_SCRATCH_PER_THREAD}"
    );
}
