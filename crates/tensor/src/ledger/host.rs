//! Zeroed host buffers for a ledger on the host (the CPU backend): small ones from
//! `calloc`, larger ones filled over the calling rayon pool.

/// Host buffers from this size on (two of the fill's chunks) are zero-filled by the calling
/// rayon pool. At 1 MiB tiny's 512 KiB activations were filled by one thread while the other
/// waited: 128 KiB took the step's time outside kernels from 4.0 to 3.4 ms (three
/// alternating `bench --profile --configs tiny` pairs on the 2-vCPU Zen 4).
const PAR_ZERO_BYTES: usize = 1 << 17;

/// `len` zeros (`T::default()`) on the host.
///
/// Small buffers, and any buffer asked for outside a rayon pool (where a parallel fill would
/// start rayon's global pool beside the rank's own), are `vec!`'s: `calloc`, whose reused
/// blocks are zero-filled in one serial pass on the calling thread. From
/// [`PAR_ZERO_BYTES`] on, inside a pool, the buffer is allocated uninitialised and its
/// chunks are filled by the pool's threads: the serial pass was 5% of the CPU samples of
/// tiny's training step (`perf`), and the step's buffers are allocated between kernels
/// while the other threads wait.
pub(super) fn host_zeros<T: Copy + Default + Send>(len: usize) -> Vec<T> {
    let in_pool = rayon::current_thread_index().is_some();
    if !in_pool || len * std::mem::size_of::<T>() < PAR_ZERO_BYTES {
        return vec![T::default(); len];
    }
    let mut v = Vec::with_capacity(len);
    fill_zeros_par(&mut v, len);
    v
}

/// Writes `len` zeros into the empty `v`'s capacity, in chunks over the current rayon pool.
fn fill_zeros_par<T: Copy + Default + Send>(v: &mut Vec<T>, len: usize) {
    use rayon::prelude::*;
    assert!(
        v.is_empty() && v.capacity() >= len,
        "an empty vector with room"
    );
    v.spare_capacity_mut()[..len]
        .par_chunks_mut(crate::PAR_CHUNK)
        .for_each(|c| {
            for x in c {
                x.write(T::default());
            }
        });
    // SAFETY: the first `len` elements of the capacity were just written.
    unsafe { v.set_len(len) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Category, Ledger};

    #[test]
    fn large_zeros_are_zero_in_and_out_of_a_pool() {
        let ledger = Ledger::new();
        let len = 3 * PAR_ZERO_BYTES / 4 + 12_345; // f32: above the threshold, ragged chunks
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for in_pool in [false, true] {
            for _ in 0..3 {
                // A dirty block of the same size first, so the allocator may hand it back.
                drop(vec![f32::NAN; len]);
                let b = if in_pool {
                    pool.install(|| ledger.zeros::<f32>(Category::Workspace, len))
                } else {
                    ledger.zeros::<f32>(Category::Workspace, len)
                };
                assert_eq!(b.len(), len);
                assert!(
                    b.host().iter().all(|x| x.to_bits() == 0),
                    "in pool: {in_pool}"
                );
                assert_eq!(ledger.snapshot().current(Category::Workspace), len * 4);
            }
        }
    }

    #[test]
    fn the_parallel_fill_overwrites_dirty_memory() {
        let len = 3 * crate::PAR_CHUNK + 7;
        let mut v = vec![f32::NAN; len + 5];
        v.clear(); // the capacity keeps its NaNs
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| fill_zeros_par(&mut v, len));
        assert_eq!(v.len(), len);
        assert!(v.iter().all(|x| x.to_bits() == 0));
    }
}
