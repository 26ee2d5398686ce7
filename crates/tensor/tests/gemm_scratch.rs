//! What `gemm` allocates inside a linear layer's products, measured by a counting allocator,
//! against the bound the ledger and the estimator count (`ferrotron_config::linear_pack_bytes`):
//! never above it (but for thread-pool bookkeeping, under 64 KiB), and within 1% of it
//! where it matters (the largest product of a step).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use ferrotron_config::{linear_pack_bytes, LinearProduct};
use ferrotron_tensor::linear::{
    linear_backward_input, linear_backward_weight, linear_forward, matmul, Mat, Threads,
};

/// The system allocator, counting the live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
        PEAK.fetch_max(live, Ordering::SeqCst);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes allocated above the live bytes at the start, at the peak of `f`.
fn peak_during(f: impl FnOnce()) -> usize {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    f();
    PEAK.load(Ordering::SeqCst) - base
}

/// One product of a linear layer over fresh operands; returns what `gemm` allocated.
fn measure(product: LinearProduct, t: usize, d_in: usize, d_out: usize) -> usize {
    let x = vec![0.5f32; t * d_in];
    let w = vec![0.25f32; d_out * d_in];
    let mut y = vec![0.0f32; t * d_out];
    let mut dx = vec![0.0f32; t * d_in];
    let mut dw = vec![0.0f32; d_out * d_in];
    let mut run = || match product {
        LinearProduct::Forward => linear_forward(&mut y, &x, &w, t, d_in, d_out),
        LinearProduct::BackwardInput => {
            linear_backward_input(&mut dx, &y, &w, t, d_in, d_out, false)
        }
        LinearProduct::BackwardWeight => linear_backward_weight(&mut dw, &y, &x, t, d_in, d_out),
    };
    run();
    peak_during(run)
}

/// `gemm` keeps one L2-sized slab per thread that multiplies, allocated by its first product
/// there and kept for the thread's life (a fixed cost per thread, like its stack): allocate
/// it on the calling thread and on every worker before measuring.
fn warm_every_thread() {
    let small = || {
        let (a, b) = (vec![1.0f32; 64 * 64], vec![1.0f32; 64 * 64]);
        let mut c = vec![0.0f32; 64 * 64];
        let rows = Mat::rows(64);
        matmul(
            64,
            64,
            64,
            &mut c,
            rows,
            false,
            &a,
            rows,
            &b,
            rows,
            Threads::Single,
        );
    };
    small();
    rayon::broadcast(|_| small());
}

#[test]
fn gemm_never_allocates_more_than_the_counted_bound() {
    let products = [
        LinearProduct::Forward,
        LinearProduct::BackwardInput,
        LinearProduct::BackwardWeight,
    ];
    // (t, in, out): the presets' projections, MLPs and LM heads (tiny, small, medium, with
    // tp = 2 shards), and odd sizes.
    let shapes = [
        (256, 64, 64),
        (256, 64, 256),
        (128, 64, 256),
        (1024, 512, 512),
        (1024, 512, 256),
        (1024, 512, 1536),
        (1024, 1536, 512),
        (256, 512, 8192),
        (1024, 768, 768),
        (1024, 768, 2048),
        (1024, 2048, 768),
        (256, 768, 32000),
        (256, 768, 16000),
        (1024, 1024, 384),
        (100, 300, 700),
        (37, 129, 1000),
        (2048, 96, 4100),
    ];
    warm_every_thread();
    let mut largest = (0, 0);
    for (t, d_in, d_out) in shapes {
        for p in products {
            let measured = measure(p, t, d_in, d_out);
            let bound = linear_pack_bytes(p, t, d_in, d_out) as usize;
            println!(
                "{p:?} t={t} in={d_in} out={d_out}: gemm allocated {measured} bytes, bound {bound}"
            );
            // Thread-pool bookkeeping rides along (up to 8 KiB seen).
            assert!(
                measured <= bound + (64 << 10),
                "{p:?} t={t} in={d_in} out={d_out}: {measured} > {bound}"
            );
            largest = largest.max((bound, measured));
        }
    }
    // The largest product (the LM head's weight gradient on medium) is counted tightly.
    let (bound, measured) = largest;
    assert!(measured > 30 << 20, "{measured}");
    assert!(
        bound as f64 <= 1.01 * measured as f64,
        "{bound} vs {measured}"
    );
}
