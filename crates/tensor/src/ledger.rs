//! The memory ledger: every buffer belongs to a named category and is counted.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::memory::DeviceMemory;
use crate::DeviceSlice;

/// What a buffer holds: the one category list (weights, gradients, optimizer states,
/// activations, communication, workspace) that the estimator and the reports use too.
pub use ferrotron_config::MemoryCategory as Category;

struct Counters {
    current: [AtomicUsize; 6],
    peak: [AtomicUsize; 6],
    total_current: AtomicUsize,
    total_peak: AtomicUsize,
    /// Bytes of every buffer the ledger allocated, and how many (never decreasing; not
    /// [`Ledger::hold`]'s bytes, which live elsewhere).
    allocated: AtomicUsize,
    allocations: AtomicUsize,
    /// Transfers by label, in first-seen order. Its room is reserved with the ledger: a
    /// table that grew in the middle of a step would be a small long-lived allocation among
    /// the step's freed buffers, which keeps the C allocator from returning them to the
    /// system (measured: +230 MiB of RSS on the small preset).
    transfers: Mutex<Vec<(&'static str, TransferCount)>>,
}

/// Labels a ledger has room for before its transfer table grows.
const LABELS: usize = 32;

impl Default for Counters {
    fn default() -> Self {
        Counters {
            current: Default::default(),
            peak: Default::default(),
            total_current: Default::default(),
            total_peak: Default::default(),
            allocated: Default::default(),
            allocations: Default::default(),
            transfers: Mutex::new(Vec::with_capacity(LABELS)),
        }
    }
}

/// Explicit host↔device transfers made under one label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferCount {
    /// Host-to-device transfers.
    pub to_device: usize,
    /// Bytes moved host-to-device.
    pub to_device_bytes: usize,
    /// Device-to-host transfers.
    pub to_host: usize,
    /// Bytes moved device-to-host.
    pub to_host_bytes: usize,
}

/// The device's allocator accounting: current and peak bytes per category, and every
/// explicit host↔device transfer by label. Cheap to clone (shared counters).
///
/// A ledger allocates its buffers itself: host vectors (the CPU backend), or blocks of a
/// backend's [`DeviceMemory`] ([`Ledger::on`]). What it counts is what was allocated.
#[derive(Clone, Default)]
pub struct Ledger {
    counters: Arc<Counters>,
    memory: Option<Arc<dyn DeviceMemory>>,
}

/// A frozen copy of the ledger's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LedgerSnapshot {
    /// Bytes held now, per category (indexed like [`Category::ALL`]).
    pub current: [usize; 6],
    /// Highest bytes ever held, per category.
    pub peak: [usize; 6],
    /// Highest bytes held in all categories at once.
    pub total_peak: usize,
    /// Bytes of every buffer allocated so far, freed or not (the difference of two snapshots
    /// is what a step allocated: on the host, zero-filled by the C allocator).
    pub allocated: usize,
    /// Buffers allocated so far.
    pub allocations: usize,
}

impl LedgerSnapshot {
    /// Bytes held now in `cat`.
    pub fn current(&self, cat: Category) -> usize {
        self.current[cat.index()]
    }
    /// Peak bytes of `cat`.
    pub fn peak(&self, cat: Category) -> usize {
        self.peak[cat.index()]
    }
}

impl fmt::Display for LedgerSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<14} {:>14} {:>14}",
            "category", "current MiB", "peak MiB"
        )?;
        for cat in Category::ALL {
            writeln!(
                f,
                "{:<14} {:>14.3} {:>14.3}",
                cat.name(),
                self.current(cat) as f64 / (1 << 20) as f64,
                self.peak(cat) as f64 / (1 << 20) as f64
            )?;
        }
        write!(
            f,
            "{:<14} {:>14} {:>14.3}",
            "all (peak)",
            "",
            self.total_peak as f64 / (1 << 20) as f64
        )
    }
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Ledger({:?})", self.snapshot())
    }
}

impl Ledger {
    /// A fresh ledger with every counter at zero, allocating host vectors.
    pub fn new() -> Self {
        Self::default()
    }

    /// A fresh ledger whose buffers are blocks of `memory` (a backend's device memory).
    pub fn on(memory: Arc<dyn DeviceMemory>) -> Self {
        Ledger {
            counters: Default::default(),
            memory: Some(memory),
        }
    }

    /// The device memory buffers come from (None: host vectors).
    pub fn memory(&self) -> Option<&Arc<dyn DeviceMemory>> {
        self.memory.as_ref()
    }

    /// Device storage for `len` elements of `T`: zeros, or a copy of `data` (`len` elements).
    fn device_storage<T: Copy>(
        &self,
        memory: &Arc<dyn DeviceMemory>,
        cat: Category,
        len: usize,
        data: Option<&[T]>,
    ) -> Mem<T> {
        let bytes = len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Mem::Device(std::ptr::NonNull::dangling(), len);
        }
        let ptr = memory.alloc(bytes).unwrap_or_else(|| {
            panic!(
                "device memory exhausted: a {} buffer of {bytes} bytes with {} of {} in use",
                cat.name(),
                memory.in_use(),
                memory.capacity()
            )
        });
        match data {
            // SAFETY: `ptr` holds `bytes` bytes; `d` has `len` elements of `T`.
            Some(d) => unsafe { memory.write(ptr, d.as_ptr().cast(), bytes) },
            // SAFETY: as above; all-zero bytes are the zero of every element type used here
            // (floats, bf16, integers).
            None => unsafe { memory.zero(ptr, bytes) },
        }
        Mem::Device(ptr.cast::<T>(), len)
    }

    fn add(&self, cat: Category, bytes: usize) {
        let i = cat.index();
        let now = self.counters.current[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.counters.peak[i].fetch_max(now, Ordering::Relaxed);
        let total = self
            .counters
            .total_current
            .fetch_add(bytes, Ordering::Relaxed)
            + bytes;
        self.counters.total_peak.fetch_max(total, Ordering::Relaxed);
    }

    fn sub(&self, cat: Category, bytes: usize) {
        self.counters.current[cat.index()].fetch_sub(bytes, Ordering::Relaxed);
        self.counters
            .total_current
            .fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Resets every peak to the current value (e.g. to measure one step's peak).
    pub fn reset_peaks(&self) {
        for i in 0..6 {
            let now = self.counters.current[i].load(Ordering::Relaxed);
            self.counters.peak[i].store(now, Ordering::Relaxed);
        }
        let total = self.counters.total_current.load(Ordering::Relaxed);
        self.counters.total_peak.store(total, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> LedgerSnapshot {
        let mut s = LedgerSnapshot::default();
        for i in 0..6 {
            s.current[i] = self.counters.current[i].load(Ordering::Relaxed);
            s.peak[i] = self.counters.peak[i].load(Ordering::Relaxed);
        }
        s.total_peak = self.counters.total_peak.load(Ordering::Relaxed);
        s.allocated = self.counters.allocated.load(Ordering::Relaxed);
        s.allocations = self.counters.allocations.load(Ordering::Relaxed);
        s
    }

    /// A zero-filled buffer of `len` elements counted under `cat`.
    pub fn zeros<T: Copy + Default + Send>(&self, cat: Category, len: usize) -> Buf<T> {
        let mem = match &self.memory {
            None => Mem::Host(host_zeros(len)),
            Some(m) => self.device_storage::<T>(m, cat, len, None),
        };
        self.counted(cat, mem)
    }

    /// Takes ownership of `data`, counting it under `cat`: for code that runs on the device
    /// (a collective library's transport, a backend's kernels). The engine uploads host data
    /// with [`Ledger::upload`], which counts the transfer.
    pub fn from_vec<T: Copy>(&self, cat: Category, data: Vec<T>) -> Buf<T> {
        let mem = match &self.memory {
            None => Mem::Host(data),
            Some(m) => self.device_storage(m, cat, data.len(), Some(&data)),
        };
        self.counted(cat, mem)
    }

    fn counted<T>(&self, cat: Category, mem: Mem<T>) -> Buf<T> {
        let len = match &mem {
            Mem::Host(v) => v.len(),
            Mem::Device(_, n) => *n,
        };
        let bytes = len * std::mem::size_of::<T>();
        self.add(cat, bytes);
        self.counters.allocated.fetch_add(bytes, Ordering::Relaxed);
        self.counters.allocations.fetch_add(1, Ordering::Relaxed);
        Buf {
            mem,
            cat,
            bytes,
            ledger: self.clone(),
        }
    }
}

impl Ledger {
    fn count(&self, what: &'static str, f: impl FnOnce(&mut TransferCount)) {
        let mut t = self
            .counters
            .transfers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match t.iter().position(|(label, _)| *label == what) {
            Some(i) => f(&mut t[i].1),
            None => {
                let mut c = TransferCount::default();
                f(&mut c);
                t.push((what, c));
            }
        }
    }

    /// A new device buffer under `cat` holding a copy of the host data `src`: a counted
    /// host-to-device transfer labelled `what` (e.g. `"token ids"`).
    pub fn upload<T: Copy>(&self, cat: Category, what: &'static str, src: &[T]) -> Buf<T> {
        self.count(what, |c| {
            c.to_device += 1;
            c.to_device_bytes += std::mem::size_of_val(src);
        });
        self.from_vec(cat, src.to_vec())
    }

    /// Copies host data into existing device memory: a counted host-to-device transfer.
    pub fn upload_into<T: Copy>(&self, what: &'static str, dst: &mut DeviceSlice<T>, src: &[T]) {
        self.count(what, |c| {
            c.to_device += 1;
            c.to_device_bytes += std::mem::size_of_val(src);
        });
        assert_eq!(dst.len(), src.len(), "upload_into: lengths differ");
        match &self.memory {
            None => dst.host_mut().copy_from_slice(src),
            Some(m) => {
                if let Some(ptr) = std::ptr::NonNull::new(dst.host_mut().as_mut_ptr()) {
                    // SAFETY: `dst` is device memory of this ledger holding `src.len()`
                    // elements; `src` is host memory of the same size.
                    unsafe { m.write(ptr.cast(), src.as_ptr().cast(), size_of_val(src)) }
                }
            }
        }
    }

    /// A host copy of device memory: a counted device-to-host transfer labelled `what`
    /// (e.g. `"loss"`). It waits for the kernels issued before it.
    pub fn download<T: Copy>(&self, what: &'static str, src: &DeviceSlice<T>) -> Vec<T> {
        self.count(what, |c| {
            c.to_host += 1;
            c.to_host_bytes += src.len() * std::mem::size_of::<T>();
        });
        match &self.memory {
            None => src.host().to_vec(),
            Some(m) => {
                let mut out = Vec::<T>::with_capacity(src.len());
                if let Some(ptr) = std::ptr::NonNull::new(src.host().as_ptr() as *mut T) {
                    // SAFETY: `src` is device memory of this ledger holding `src.len()`
                    // elements; `out` has room for them, and every bit pattern read is one a
                    // kernel wrote as a `T`.
                    unsafe {
                        m.read(
                            out.as_mut_ptr().cast(),
                            ptr.cast(),
                            src.len() * size_of::<T>(),
                        );
                        out.set_len(src.len());
                    }
                }
                out
            }
        }
    }

    /// Counts a host value a kernel returned (a loss, a norm, a routing table): a
    /// device-to-host transfer of `bytes` labelled `what`. Kernels with host results call it.
    pub fn count_to_host(&self, what: &'static str, bytes: usize) {
        self.count(what, |c| {
            c.to_host += 1;
            c.to_host_bytes += bytes;
        });
    }

    /// Counts host tables a kernel reads as its arguments (a mixture of experts' dispatch
    /// tables): a host-to-device transfer of `bytes` labelled `what`.
    pub fn count_to_device(&self, what: &'static str, bytes: usize) {
        self.count(what, |c| {
            c.to_device += 1;
            c.to_device_bytes += bytes;
        });
    }

    /// Every explicit transfer so far, by label.
    pub fn transfers(&self) -> BTreeMap<&'static str, TransferCount> {
        self.counters
            .transfers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect()
    }

    /// Forgets the transfers counted so far (e.g. to count one step's).
    pub fn reset_transfers(&self) {
        self.counters
            .transfers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

/// Bytes held in the ledger for memory that lives in another structure (index tables, plans
/// built by code that knows nothing of the ledger), until the guard is dropped.
pub struct Held {
    cat: Category,
    bytes: usize,
    ledger: Ledger,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.ledger.sub(self.cat, self.bytes);
    }
}

impl Ledger {
    /// Counts `bytes` under `cat` until the returned guard is dropped.
    pub fn hold(&self, cat: Category, bytes: usize) -> Held {
        self.add(cat, bytes);
        Held {
            cat,
            bytes,
            ledger: self.clone(),
        }
    }
}

/// A counted buffer of device memory: its bytes are held in the ledger until it is dropped.
/// It dereferences to a [`DeviceSlice`], which kernels and collectives take and the engine
/// cannot read (see [`crate::device`]).
pub struct Buf<T> {
    mem: Mem<T>,
    cat: Category,
    bytes: usize,
    ledger: Ledger,
}

/// Where a buffer's elements are.
enum Mem<T> {
    /// A host vector (the CPU backend).
    Host(Vec<T>),
    /// `n` elements in the ledger's device memory.
    Device(std::ptr::NonNull<T>, usize),
}

// SAFETY: a buffer owns its elements exclusively, as a `Vec` does; device blocks are never
// shared between buffers.
unsafe impl<T: Send> Send for Buf<T> {}
// SAFETY: shared access only reads, as for a `Vec`.
unsafe impl<T: Sync> Sync for Buf<T> {}

impl<T> Buf<T> {
    /// The category this buffer is counted under.
    pub fn category(&self) -> Category {
        self.cat
    }
}

impl<T> Deref for Buf<T> {
    type Target = DeviceSlice<T>;
    fn deref(&self) -> &DeviceSlice<T> {
        match &self.mem {
            Mem::Host(v) => DeviceSlice::of(v),
            // SAFETY: `p` holds `n` initialised elements owned by this buffer.
            Mem::Device(p, n) => {
                DeviceSlice::of(unsafe { std::slice::from_raw_parts(p.as_ptr(), *n) })
            }
        }
    }
}

impl<T> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut DeviceSlice<T> {
        match &mut self.mem {
            Mem::Host(v) => DeviceSlice::of_mut(v),
            // SAFETY: `p` holds `n` initialised elements owned exclusively by this buffer.
            Mem::Device(p, n) => {
                DeviceSlice::of_mut(unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), *n) })
            }
        }
    }
}

impl<T> Drop for Buf<T> {
    fn drop(&mut self) {
        self.ledger.sub(self.cat, self.bytes);
        if let (Mem::Device(p, _), Some(memory)) = (&self.mem, &self.ledger.memory) {
            if self.bytes > 0 {
                memory.free(p.cast(), self.bytes);
            }
        }
    }
}

impl<T> fmt::Debug for Buf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Buf<{}>[{}; {}]",
            std::any::type_name::<T>(),
            self.len(),
            self.cat.name()
        )
    }
}

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
fn host_zeros<T: Copy + Default + Send>(len: usize) -> Vec<T> {
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

    #[test]
    fn held_bytes_count_until_dropped() {
        let ledger = Ledger::new();
        let held = ledger.hold(Category::Activations, 96);
        let buf = ledger.zeros::<f32>(Category::Activations, 8);
        assert_eq!(ledger.snapshot().current(Category::Activations), 128);
        drop(held);
        assert_eq!(ledger.snapshot().current(Category::Activations), 32);
        drop(buf);
        assert_eq!(ledger.snapshot().peak(Category::Activations), 128);
    }

    #[test]
    fn counts_current_and_peak() {
        let ledger = Ledger::new();
        let a = ledger.zeros::<f32>(Category::Activations, 100);
        {
            let _b = ledger.zeros::<u16>(Category::Activations, 50);
            assert_eq!(ledger.snapshot().current(Category::Activations), 500);
        }
        assert_eq!(ledger.snapshot().current(Category::Activations), 400);
        assert_eq!(ledger.snapshot().peak(Category::Activations), 500);
        drop(a);
        let s = ledger.snapshot();
        assert_eq!(s.current(Category::Activations), 0);
        assert_eq!(s.total_peak, 500);
    }

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
