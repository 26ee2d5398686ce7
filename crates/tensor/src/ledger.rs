//! The memory ledger: every buffer belongs to a named category and is counted.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::memory::DeviceMemory;
use crate::DeviceSlice;

mod host;
mod recycle;
mod transfers;

use host::host_zeros;
pub use recycle::Recycling;
pub use transfers::TransferCount;

/// What a new device buffer holds.
enum Fill<'a, T> {
    /// Zeros.
    Zeros,
    /// A copy of host data.
    Data(&'a [T]),
    /// Whatever the allocator's block held (a kernel overwrites it whole).
    Unset,
}

/// What a buffer holds: the one category list (weights, gradients, optimizer states,
/// activations, communication, workspace) that the estimator and the reports use too.
pub use ferrotron_config::MemoryCategory as Category;

struct Counters {
    current: [AtomicUsize; Category::COUNT],
    peak: [AtomicUsize; Category::COUNT],
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
    /// Freed buffers kept for [`Ledger::overwritten`].
    recycler: recycle::Recycler,
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
            recycler: Default::default(),
        }
    }
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
    pub current: [usize; Category::COUNT],
    /// Highest bytes ever held, per category.
    pub peak: [usize; Category::COUNT],
    /// Highest bytes held in all categories at once.
    pub total_peak: usize,
    /// Bytes of every buffer handed out so far, freed or not (the difference of two
    /// snapshots is what a step allocated: on the host, zero-filled but for `reused_bytes`).
    pub allocated: usize,
    /// Buffers handed out so far.
    pub allocations: usize,
    /// Of those, buffers served from recycled memory (see [`Ledger::overwritten`]).
    pub reused: usize,
    /// Bytes of the reused buffers.
    pub reused_bytes: usize,
    /// Bytes of freed buffers kept for reuse now: counted in the total of all categories
    /// (the process holds them) and in none of them (a trainer releases them after each
    /// step and evaluation).
    pub recycled: usize,
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
        fill: Fill<'_, T>,
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
        match fill {
            // SAFETY: `ptr` holds `bytes` bytes; `d` has `len` elements of `T`.
            Fill::Data(d) => unsafe { memory.write(ptr, d.as_ptr().cast(), bytes) },
            // SAFETY: as above; all-zero bytes are the zero of every element type used here
            // (floats, bf16, integers).
            Fill::Zeros => unsafe { memory.zero(ptr, bytes) },
            Fill::Unset => {}
        }
        Mem::Device(ptr.cast::<T>(), len)
    }

    /// A device buffer of `len` f32 counted under `cat`, its bytes as the allocator hands
    /// them over (no pass of zeros), or NaN when `poison`: see [`Ledger::overwritten`].
    fn device_unset(
        &self,
        memory: &Arc<dyn DeviceMemory>,
        cat: Category,
        len: usize,
        poison: bool,
    ) -> Buf<f32> {
        self.admit(cat, len * 4);
        let mem = match poison {
            true => self.device_storage(memory, cat, len, Fill::Data(&vec![f32::NAN; len])),
            false => self.device_storage::<f32>(memory, cat, len, Fill::Unset),
        };
        self.counted_as(cat, mem)
    }

    fn add(&self, cat: Category, bytes: usize) {
        let i = cat.index();
        let now = self.counters.current[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.counters.peak[i].fetch_max(now, Ordering::Relaxed);
        self.add_total(bytes);
    }

    /// Counts `bytes` in the total only (recycled memory, which belongs to no category).
    fn add_total(&self, bytes: usize) {
        let total = self
            .counters
            .total_current
            .fetch_add(bytes, Ordering::Relaxed)
            + bytes;
        self.counters.total_peak.fetch_max(total, Ordering::Relaxed);
    }

    fn sub(&self, cat: Category, bytes: usize) {
        self.counters.current[cat.index()].fetch_sub(bytes, Ordering::Relaxed);
        self.sub_total(bytes);
    }

    fn sub_total(&self, bytes: usize) {
        self.counters
            .total_current
            .fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Resets every peak to the current value (e.g. to measure one step's peak).
    pub fn reset_peaks(&self) {
        for i in 0..Category::COUNT {
            let now = self.counters.current[i].load(Ordering::Relaxed);
            self.counters.peak[i].store(now, Ordering::Relaxed);
        }
        let total = self.counters.total_current.load(Ordering::Relaxed);
        self.counters.total_peak.store(total, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> LedgerSnapshot {
        let mut s = LedgerSnapshot::default();
        for i in 0..Category::COUNT {
            s.current[i] = self.counters.current[i].load(Ordering::Relaxed);
            s.peak[i] = self.counters.peak[i].load(Ordering::Relaxed);
        }
        s.total_peak = self.counters.total_peak.load(Ordering::Relaxed);
        s.allocated = self.counters.allocated.load(Ordering::Relaxed);
        s.allocations = self.counters.allocations.load(Ordering::Relaxed);
        s.reused = self.counters.recycler.reused.load(Ordering::Relaxed);
        s.reused_bytes = self.counters.recycler.reused_bytes.load(Ordering::Relaxed);
        s.recycled = self.counters.recycler.bytes.load(Ordering::Relaxed);
        s
    }

    /// A zero-filled buffer of `len` elements counted under `cat`.
    pub fn zeros<T: Copy + Default + Send>(&self, cat: Category, len: usize) -> Buf<T> {
        self.admit(cat, len * std::mem::size_of::<T>());
        let mem = match &self.memory {
            None => Mem::Host(host_zeros(len)),
            Some(m) => self.device_storage::<T>(m, cat, len, Fill::Zeros),
        };
        self.counted_as(cat, mem)
    }

    /// Takes ownership of `data`, counting it under `cat`: for code that runs on the device
    /// (a collective library's transport, a backend's kernels). The engine uploads host data
    /// with [`Ledger::upload`], which counts the transfer.
    pub fn from_vec<T: Copy>(&self, cat: Category, data: Vec<T>) -> Buf<T> {
        self.admit(cat, std::mem::size_of_val(data.as_slice()));
        let mem = match &self.memory {
            None => Mem::Host(data),
            Some(m) => self.device_storage(m, cat, data.len(), Fill::Data(&data)),
        };
        self.counted_as(cat, mem)
    }

    /// A buffer over `mem` under `cat`, counted as handed out; its bytes were added by the
    /// caller ([`Ledger::admit`]'s).
    fn counted_as<T>(&self, cat: Category, mem: Mem<T>) -> Buf<T> {
        let len = match &mem {
            Mem::Host(v) => v.len(),
            Mem::Device(_, n) => *n,
        };
        let bytes = len * std::mem::size_of::<T>();
        self.counters.allocated.fetch_add(bytes, Ordering::Relaxed);
        self.counters.allocations.fetch_add(1, Ordering::Relaxed);
        Buf {
            mem,
            cat,
            bytes,
            ledger: self.clone(),
            recycle: None,
        }
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
        self.admit(cat, bytes);
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
    /// Where the host vector goes when the buffer is dropped, when not back to the allocator
    /// (a recycled buffer's: see [`Ledger::overwritten`]).
    recycle: Option<fn(&Ledger, Vec<T>, Category)>,
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
        if let (Some(keep), Mem::Host(v)) = (self.recycle, &mut self.mem) {
            return keep(&self.ledger, std::mem::take(v), self.cat);
        }
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
}
