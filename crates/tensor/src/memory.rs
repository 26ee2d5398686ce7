//! Where a ledger's buffers live when they are not host vectors: a backend's device memory,
//! behind the [`DeviceMemory`] allocator the ledger counts.
//!
//! The CPU backend keeps every buffer in an ordinary `Vec` (no allocator here). A GPU
//! backend's caching allocator implements [`DeviceMemory`] over device memory. [`Arena`] is
//! the allocator of the test suite's second backend ([`crate::ArenaBackend`]): one region
//! reserved up front, cut first-fit, from which every buffer of a rank is allocated, so that
//! nothing the step touches is an ordinary host allocation.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Mutex;

/// Alignment of every device allocation, in bytes (a cache line; what kernels assume).
pub const ALIGN: usize = 64;

/// A device allocator: what a [`Ledger`](crate::Ledger) allocates its buffers from.
pub trait DeviceMemory: Send + Sync {
    /// `bytes` bytes (a multiple of nothing in particular), aligned to [`ALIGN`], or `None`
    /// when the memory is exhausted.
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>>;
    /// Returns an allocation of `bytes` bytes made by [`DeviceMemory::alloc`].
    fn free(&self, ptr: NonNull<u8>, bytes: usize);
    /// Bytes allocated now (the allocator's own count, to compare with the ledger's).
    fn in_use(&self) -> usize;
    /// Bytes the memory holds in all.
    fn capacity(&self) -> usize;

    /// Copies `bytes` bytes of host memory at `src` to device memory at `dst`, after every
    /// kernel issued before it and before every kernel issued after it; `src` may be reused
    /// when the call returns. Host-accessible memory is written before the call returns. The
    /// default is a host copy (the memory is host memory).
    ///
    /// # Safety
    /// `src` is readable and `dst` (an allocation of this memory) writable for `bytes` bytes.
    unsafe fn write(&self, dst: NonNull<u8>, src: *const u8, bytes: usize) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_ptr(), bytes) }
    }

    /// Copies `bytes` bytes of device memory at `src` to host memory at `dst`, after every
    /// kernel issued before it. The default is a host copy.
    ///
    /// # Safety
    /// `src` (an allocation of this memory) is readable and `dst` writable for `bytes` bytes.
    unsafe fn read(&self, dst: *mut u8, src: NonNull<u8>, bytes: usize) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, bytes) }
    }

    /// Sets `bytes` bytes at `dst` to zero, after every kernel issued before it and before
    /// every kernel and copy issued after it. Host-accessible memory is zeroed before the
    /// call returns (a transport may then write the block from the host); memory the host
    /// cannot access is only ever written through this memory's own ordered calls.
    ///
    /// # Safety
    /// `dst` (an allocation of this memory) is writable for `bytes` bytes.
    unsafe fn zero(&self, dst: NonNull<u8>, bytes: usize) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::write_bytes(dst.as_ptr(), 0, bytes) }
    }

    /// Whether the host may read and write this memory (after [`DeviceMemory::synchronize`]).
    /// When it may not (a GPU's own memory), collectives stage their buffers through host
    /// copies. The default: it may (host memory).
    fn host_accessible(&self) -> bool {
        true
    }

    /// Waits for every kernel issued on this memory's device so far: called before a
    /// collective library's transport reads buffers from the host. The default does nothing
    /// (kernels of host memory run to completion when called).
    fn synchronize(&self) {}
}

/// One region of memory, reserved when the arena is made and cut first-fit into aligned
/// allocations; freed blocks merge with their free neighbours.
pub struct Arena {
    base: NonNull<u8>,
    capacity: usize,
    /// Free blocks: offset → length, non-adjacent.
    free: Mutex<BTreeMap<usize, usize>>,
    in_use: std::sync::atomic::AtomicUsize,
    /// Reported as not host-accessible, so collectives stage through host copies as they do
    /// for a GPU's memory.
    opaque: bool,
}

// SAFETY: the region is owned by the arena and handed out in disjoint blocks under a lock;
// the arena itself never reads it.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    /// An arena of `capacity` bytes (rounded up to [`ALIGN`]), zero-filled lazily by the
    /// operating system.
    ///
    /// # Panics
    /// If the process cannot reserve the region.
    pub fn new(capacity: usize) -> Arena {
        let capacity = capacity.max(ALIGN).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(capacity, ALIGN).expect("arena layout");
        // SAFETY: the layout has a non-zero size.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(base).expect("the arena's region could not be reserved");
        Arena {
            base,
            capacity,
            free: Mutex::new(BTreeMap::from([(0, capacity)])),
            in_use: Default::default(),
            opaque: false,
        }
    }

    /// An arena that says the host cannot access it ([`DeviceMemory::host_accessible`]), like
    /// a GPU's memory: collectives then stage their buffers through host copies.
    pub fn opaque(capacity: usize) -> Arena {
        let mut arena = Arena::new(capacity);
        arena.opaque = true;
        arena
    }

    /// Whether `ptr..ptr + bytes` lies inside the region.
    pub fn holds(&self, ptr: *const u8, bytes: usize) -> bool {
        let (start, p) = (self.base.as_ptr() as usize, ptr as usize);
        p >= start && p + bytes <= start + self.capacity
    }
}

impl DeviceMemory for Arena {
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>> {
        let size = bytes.max(1).next_multiple_of(ALIGN);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (&at, &len) = free.iter().find(|(_, &len)| len >= size)?;
        free.remove(&at);
        if len > size {
            free.insert(at + size, len - size);
        }
        self.in_use
            .fetch_add(size, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `at + size <= capacity`, inside the region.
        Some(unsafe { NonNull::new_unchecked(self.base.as_ptr().add(at)) })
    }

    fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        let size = bytes.max(1).next_multiple_of(ALIGN);
        let mut at = ptr.as_ptr() as usize - self.base.as_ptr() as usize;
        let mut len = size;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((&prev, &prev_len)) = free.range(..at).next_back() {
            if prev + prev_len == at {
                free.remove(&prev);
                at = prev;
                len += prev_len;
            }
        }
        if let Some(next_len) = free.remove(&(at + len)) {
            len += next_len;
        }
        free.insert(at, len);
        self.in_use
            .fetch_sub(size, std::sync::atomic::Ordering::Relaxed);
    }

    fn in_use(&self) -> usize {
        self.in_use.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn host_accessible(&self) -> bool {
        !self.opaque
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.capacity, ALIGN).expect("arena layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.base.as_ptr(), layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_disjoint_aligned_and_merge_when_freed() {
        let arena = Arena::new(4096);
        let a = arena.alloc(100).unwrap();
        let b = arena.alloc(1).unwrap();
        let c = arena.alloc(640).unwrap();
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.as_ptr() as usize - a.as_ptr() as usize, 128);
        assert_eq!(c.as_ptr() as usize - b.as_ptr() as usize, 64);
        assert_eq!(arena.in_use(), 128 + 64 + 640);
        assert!(arena.alloc(4096).is_none(), "more than is free");
        arena.free(b, 1);
        arena.free(a, 100);
        // The freed neighbours merged: a 192-byte block at the start holds 150 bytes.
        assert_eq!(arena.alloc(150).unwrap(), a);
        arena.free(a, 150);
        arena.free(c, 640);
        assert_eq!(arena.in_use(), 0);
        assert_eq!(*arena.free.lock().unwrap(), BTreeMap::from([(0, 4096)]));
        assert!(arena.holds(c.as_ptr(), 640) && !arena.holds(c.as_ptr(), 4096));
    }
}
