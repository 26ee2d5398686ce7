//! Recycled host buffers: a step's f32 buffers that a kernel overwrites whole are served from
//! the memory of buffers the step has freed, of the same length, without a pass of zeros.
//!
//! The bytes a freed buffer keeps stay in the ledger's total of all categories until they are
//! served again or released (the process holds them), and leave its category as a freed
//! buffer's do: every category counts what is in use, exactly as without recycling. A fresh
//! allocation first releases recycled buffers until it fits under the total peak so far, so
//! recycling never raises that peak either: it only fills memory the step had already held
//! at once.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{Buf, Category, Ledger};

/// Buffers shorter than this are not recycled (`calloc`'s small blocks are cheap to fill).
pub(super) const RECYCLE_MIN_BYTES: usize = 1 << 17;

/// Room the list of kept buffers reserves when recycling is turned on: a list that grew in
/// the middle of a step would be a small long-lived allocation among the step's buffers.
const KEPT: usize = 64;

/// Whether a ledger recycles the buffers [`Ledger::overwritten`] hands out (host f32 buffers
/// of at least 128 KiB; smaller host ones are always fresh zeros). On a device ledger the
/// mode says only whether such a buffer is filled: zeros when off, nothing when on (the
/// allocator's block as it is), NaN when poisoned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recycling {
    /// Every buffer is a fresh zero-filled allocation (a new ledger's default).
    Off,
    /// A freed buffer of [`Ledger::overwritten`]'s is kept for the next request of its length.
    On,
    /// As [`Recycling::On`], but every buffer [`Ledger::overwritten`] would recycle (host,
    /// 128 KiB or more; on a device, every one) is handed out full of NaNs, kept or fresh:
    /// for tests that prove each kernel given one overwrites all of it.
    Poisoned,
}

/// A ledger's recycled buffers (shared by its clones). The list's lock also orders every
/// allocation against the kept bytes while any are kept, so that the total peak check and
/// the count it guards happen at once.
#[derive(Default)]
pub(super) struct Recycler {
    mode: AtomicU8,
    free: Mutex<Vec<Vec<f32>>>,
    /// Bytes of the buffers in `free`.
    pub(super) bytes: AtomicUsize,
    /// Buffers served from `free` (never decreasing).
    pub(super) reused: AtomicUsize,
    /// Their bytes.
    pub(super) reused_bytes: AtomicUsize,
}

impl Recycler {
    fn mode(&self) -> Recycling {
        match self.mode.load(Ordering::Relaxed) {
            1 => Recycling::On,
            2 => Recycling::Poisoned,
            _ => Recycling::Off,
        }
    }

    fn free(&self) -> std::sync::MutexGuard<'_, Vec<Vec<f32>>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Ledger {
    /// Turns recycling on or off (off releases what is kept). A device ledger keeps no
    /// buffers (they are blocks of the backend's memory, which caches them); the mode only
    /// says how it fills an overwritten one (see [`Recycling`]).
    pub fn set_recycling(&self, mode: Recycling) {
        let r = &self.counters.recycler;
        let code = match mode {
            Recycling::Off => 0,
            Recycling::On => 1,
            Recycling::Poisoned => 2,
        };
        {
            let mut free = r.free();
            r.mode.store(code, Ordering::Relaxed);
            let room = KEPT.saturating_sub(free.len());
            free.reserve(room);
        }
        if mode == Recycling::Off {
            self.release_recycled();
        }
    }

    /// Frees every recycled buffer (the end of a step: between steps the ledger counts only
    /// what is in use). The list keeps its room.
    pub fn release_recycled(&self) {
        let mut free = self.counters.recycler.free();
        for v in free.drain(..) {
            self.uncache(v.len() * 4);
        }
    }

    /// A buffer of `len` f32 counted under `cat` whose contents are unspecified: for an output
    /// that the kernel writing it overwrites whole. With recycling on, a host buffer of at
    /// least 128 KiB is one of the same length the step freed (no pass of zeros) where one is
    /// kept, and a device buffer is the allocator's block as it is (no pass of zeros); with
    /// recycling poisoned, either is NaN; otherwise zeros.
    pub fn overwritten(&self, cat: Category, len: usize) -> Buf<f32> {
        let r = &self.counters.recycler;
        let mode = r.mode();
        if let (Some(memory), Recycling::On | Recycling::Poisoned) = (&self.memory, mode) {
            return self.device_unset(memory, cat, len, mode == Recycling::Poisoned);
        }
        if mode == Recycling::Off || self.memory.is_some() || len * 4 < RECYCLE_MIN_BYTES {
            return self.zeros(cat, len);
        }
        let kept = {
            let mut free = r.free();
            let at = free.iter().rposition(|v| v.len() == len);
            at.map(|i| {
                let v = free.remove(i);
                // Under the lock: no allocation sees the total without these bytes.
                self.uncache(len * 4);
                self.add(cat, len * 4);
                v
            })
        };
        let mut buf = match kept {
            Some(v) => {
                r.reused.fetch_add(1, Ordering::Relaxed);
                r.reused_bytes.fetch_add(len * 4, Ordering::Relaxed);
                self.counted_as(cat, super::Mem::Host(v))
            }
            None => self.zeros(cat, len),
        };
        if mode == Recycling::Poisoned {
            buf.host_mut().fill(f32::NAN);
        }
        buf.recycle = Some(Ledger::keep_freed);
        buf
    }

    /// Keeps a freed buffer of [`Ledger::overwritten`]'s for the next request of its length,
    /// counted in the total meanwhile (or frees it when recycling is off).
    fn keep_freed(&self, v: Vec<f32>, cat: Category) {
        let bytes = v.len() * 4;
        let r = &self.counters.recycler;
        let mut free = r.free();
        self.sub(cat, bytes);
        // Read under the lock: a concurrent switch off either releases this buffer with the
        // rest or makes it go back to the allocator here.
        if r.mode() == Recycling::Off {
            return;
        }
        self.add_total(bytes);
        r.bytes.fetch_add(bytes, Ordering::Relaxed);
        free.push(v);
    }

    /// Counts `bytes` more under `cat` for a fresh allocation, first releasing recycled
    /// buffers, in the order they were kept, until the bytes fit under the total peak so far
    /// (or none is left): kept memory never raises the peak.
    pub(super) fn admit(&self, cat: Category, bytes: usize) {
        let r = &self.counters.recycler;
        if r.mode() == Recycling::Off && r.bytes.load(Ordering::Relaxed) == 0 {
            return self.add(cat, bytes);
        }
        let mut free = r.free();
        let c = &self.counters;
        while !free.is_empty()
            && c.total_current.load(Ordering::Relaxed) + bytes
                > c.total_peak.load(Ordering::Relaxed)
        {
            let v = free.remove(0);
            self.uncache(v.len() * 4);
        }
        self.add(cat, bytes);
    }

    /// Stops counting `bytes` of recycled memory (served again, or freed).
    fn uncache(&self, bytes: usize) {
        self.sub_total(bytes);
        self.counters
            .recycler
            .bytes
            .fetch_sub(bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: usize = RECYCLE_MIN_BYTES / 4;

    /// A step-like sequence: saved activations and workspaces of a few lengths, freed and
    /// asked for again, with zeroed buffers and held bytes between. Returns the ledger.
    fn replay(mode: Recycling) -> Ledger {
        let ledger = Ledger::new();
        ledger.set_recycling(mode);
        for _ in 0..3 {
            let mut saved = Vec::new();
            for layer in 0..4 {
                let a = ledger.overwritten(Category::Activations, N);
                let w = ledger.overwritten(Category::Workspace, 3 * N);
                let z = ledger.zeros::<f32>(Category::Workspace, 2 * N + layer);
                drop((w, z));
                saved.push(a);
            }
            let held = ledger.hold(Category::Communication, 5 * N);
            while let Some(a) = saved.pop() {
                drop(a);
                let d = ledger.overwritten(Category::Workspace, N);
                let e = ledger.overwritten(Category::Workspace, 3 * N);
                drop((d, e));
            }
            drop(held);
            ledger.release_recycled();
        }
        ledger
    }

    #[test]
    fn recycling_keeps_every_peak_and_frees_at_release() {
        let (off, on) = (
            replay(Recycling::Off).snapshot(),
            replay(Recycling::On).snapshot(),
        );
        assert_eq!(on.total_peak, off.total_peak);
        for cat in Category::ALL {
            assert_eq!(on.peak(cat), off.peak(cat), "{}", cat.name());
            assert_eq!(on.current(cat), 0, "{}", cat.name());
        }
        assert_eq!(on.recycled, 0);
        assert_eq!((off.reused, off.reused_bytes), (0, 0));
        assert!(on.reused > 0 && on.reused_bytes >= on.reused * N * 4);
        assert_eq!(on.allocations, off.allocations, "handed out alike");
        assert_eq!(on.allocated, off.allocated);
    }

    #[test]
    fn a_recycled_buffer_is_served_again_and_released_for_room() {
        let ledger = Ledger::new();
        ledger.set_recycling(Recycling::Poisoned);
        let b = N * 4;
        let mut a = ledger.overwritten(Category::Activations, N);
        let first = a.host().iter().all(|x| x.is_nan());
        assert!(first, "a fresh one is poisoned too");
        drop(ledger.hold(Category::Communication, 12)); // the peak: b + 12
        a.host_mut().fill(1.0);
        drop(a);
        let s = ledger.snapshot();
        assert_eq!((s.current(Category::Activations), s.recycled), (0, b));
        let held = ledger.hold(Category::Communication, 8);
        assert_eq!(
            ledger.snapshot().recycled,
            b,
            "room under the peak: still kept"
        );
        let more = ledger.hold(Category::Communication, 8);
        assert_eq!(
            ledger.snapshot().recycled,
            0,
            "past the peak: released first"
        );
        assert_eq!(ledger.snapshot().total_peak, b + 12);
        drop((held, more));
        drop(ledger.overwritten(Category::Activations, N)); // fresh, then kept
        let c = ledger.overwritten(Category::Activations, N);
        assert!(
            c.host().iter().all(|x| x.is_nan()),
            "a recycled one is poisoned"
        );
        let s = ledger.snapshot();
        assert_eq!((s.reused, s.reused_bytes, s.recycled), (1, b, 0));
        assert_eq!(s.current(Category::Activations), b);
        assert_eq!(s.total_peak, b + 12);
        // Another length is not served from it; switching off releases what is kept.
        drop(c);
        drop(ledger.overwritten(Category::Workspace, N + 8));
        assert_eq!(ledger.snapshot().recycled, b + 32);
        ledger.set_recycling(Recycling::Off);
        assert_eq!(
            (ledger.snapshot().recycled, ledger.snapshot().reused),
            (0, 1)
        );
    }

    #[test]
    fn small_buffers_and_an_unrecycled_ledger_get_zeros() {
        let ledger = Ledger::new();
        let a = ledger.overwritten(Category::Workspace, N);
        assert!(a.host().iter().all(|&x| x == 0.0));
        drop(a);
        assert_eq!(ledger.snapshot().recycled, 0, "off: freed");
        ledger.set_recycling(Recycling::On);
        drop(ledger.overwritten(Category::Workspace, 8));
        assert_eq!(ledger.snapshot().recycled, 0, "small: freed");
    }

    #[test]
    fn a_device_ledger_hands_out_blocks_unfilled_poisoned_or_zeroed_by_mode() {
        use crate::memory::Arena;
        let ledger = Ledger::on(std::sync::Arc::new(Arena::new(1 << 20)));
        let read = |b: &Buf<f32>| ledger.download("test", b);
        // A block written with ones, then freed: the arena serves the same block again.
        drop(ledger.upload(Category::Workspace, "test", &[1.0f32; 64]));
        ledger.set_recycling(Recycling::On);
        let a = ledger.overwritten(Category::Activations, 64);
        assert!(read(&a).iter().all(|&x| x == 1.0), "no pass of zeros");
        assert_eq!(ledger.snapshot().current(Category::Activations), 256);
        drop(a);
        ledger.set_recycling(Recycling::Poisoned);
        let p = ledger.overwritten(Category::Activations, 64);
        assert!(read(&p).iter().all(|x| x.is_nan()), "poisoned");
        drop(p);
        ledger.set_recycling(Recycling::Off);
        let z = ledger.overwritten(Category::Activations, 64);
        assert!(read(&z).iter().all(|&x| x == 0.0), "off: zeros");
    }
}
