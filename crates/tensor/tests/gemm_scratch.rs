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
    // The largest product (the LM head's weight gradient on medium) is counted tightly: the
    // bound is gemm's packed right operand, whole. Where it exceeds what gemm keeps of it in
    // the L3 cache ((ways − 1)/ways of it), gemm packs it in `split` equal blocks of columns,
    // one at a time, and the bound is then `split` times the block.
    let (bound, measured) = largest;
    assert!(bound > 30 << 20, "{bound}");
    let split = (bound as f64 / measured as f64).round().max(1.0);
    if split > 1.0 {
        let l3 =
            l3_rhs_bytes().expect("gemm split the product: this machine's L3 cache explains it");
        assert!(
            bound as f64 > l3 as f64 && bound as f64 / split <= 1.01 * l3 as f64,
            "{bound} split {split} times, L3 keeps {l3}"
        );
    }
    assert!(
        bound as f64 / split <= 1.01 * measured as f64,
        "{bound} vs {measured} (packed in {split} blocks)"
    );
}

/// The bytes of a packed right operand `gemm` keeps in the L3 cache, (ways − 1)/ways of it
/// (gemm-common's `kernel_params`), read from Linux's cache description of CPU 0.
fn l3_rhs_bytes() -> Option<usize> {
    let dir = (0..8)
        .map(|i| format!("/sys/devices/system/cpu/cpu0/cache/index{i}"))
        .find(|d| std::fs::read_to_string(format!("{d}/level")).is_ok_and(|l| l.trim() == "3"))?;
    let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
    let size = read("size")?;
    let kib: usize = size.trim().strip_suffix('K')?.parse().ok()?;
    let ways: usize = read("ways_of_associativity")?.trim().parse().ok()?;
    Some(kib * 1024 / ways * (ways - 1))
}
