//! A rank's device memory: a caching allocator over plain device allocations
//! (`cuMemAlloc`), whose buffers the memory ledger counts.
//!
//! The host cannot read this memory ([`DeviceMemory::host_accessible`] is false): the ledger
//! moves data in and out with ordered copies on the rank's stream, and collectives over the
//! threads or MPI transports stage their buffers through host copies (NCCL, which reads
//! device memory directly, is not wired yet). Freed blocks go back to a cache by size class
//! (multiples of 512 bytes up to 1 MiB, of 2 MiB above) and are reused in stream order:
//! every kernel of a rank runs on its one stream, so a block freed by the host while a kernel
//! still reads it is only handed to kernels issued after that one. When the driver refuses an
//! allocation, the cache is returned to the driver and the allocation is tried once more.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaStream};
use ferrotron_tensor::memory::DeviceMemory;

/// Size class of an allocation of `bytes` bytes.
pub fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 2 << 20;
    if bytes <= 1 << 20 {
        bytes.max(1).next_multiple_of(SMALL)
    } else {
        bytes.next_multiple_of(LARGE)
    }
}

/// The caching allocator of one rank (one stream) on one GPU.
pub struct CudaMemory {
    stream: Arc<CudaStream>,
    ordinal: usize,
    /// Free blocks by size class.
    cache: Mutex<BTreeMap<usize, Vec<sys::CUdeviceptr>>>,
    in_use: AtomicUsize,
    reserved: AtomicUsize,
    capacity: usize,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaMemory(GPU {}, {} in use, {} reserved)",
            self.ordinal,
            self.in_use(),
            self.reserved()
        )
    }
}

fn check<T>(what: &str, r: Result<T, result::DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what} failed: {e}"))
}

impl CudaMemory {
    /// The allocator of a rank whose kernels run on `stream`; `capacity` is the device's
    /// memory in bytes.
    pub fn new(stream: Arc<CudaStream>, capacity: usize) -> CudaMemory {
        let ordinal = stream.context().ordinal();
        CudaMemory {
            stream,
            ordinal,
            cache: Mutex::new(BTreeMap::new()),
            in_use: AtomicUsize::new(0),
            reserved: AtomicUsize::new(0),
            capacity,
        }
    }

    /// Bytes held from the driver: blocks in use plus the cache.
    pub fn reserved(&self) -> usize {
        self.reserved.load(Ordering::Relaxed)
    }

    /// The stream whose order the blocks are reused in.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn bind(&self) {
        check("context binding", self.stream.context().bind_to_thread());
    }

    fn driver_alloc(&self, size: usize) -> Option<sys::CUdeviceptr> {
        // SAFETY: a fresh allocation; the context is bound.
        let ptr = unsafe { result::malloc_sync(size) }.ok()?;
        self.reserved.fetch_add(size, Ordering::Relaxed);
        Some(ptr)
    }

    /// Returns every cached block to the driver.
    pub fn empty_cache(&self) {
        self.bind();
        check("synchronize", self.stream.synchronize());
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        for (size, blocks) in std::mem::take(&mut *cache) {
            for ptr in blocks {
                // SAFETY: a block of ours that no kernel uses any more (stream drained).
                check("free", unsafe { result::free_sync(ptr) });
                self.reserved.fetch_sub(size, Ordering::Relaxed);
            }
        }
    }
}

impl DeviceMemory for CudaMemory {
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>> {
        let size = size_class(bytes);
        let cached = {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.get_mut(&size).and_then(Vec::pop)
        };
        self.bind();
        let ptr = match cached {
            Some(p) => p,
            None => match self.driver_alloc(size) {
                Some(p) => p,
                None => {
                    self.empty_cache();
                    self.driver_alloc(size)?
                }
            },
        };
        self.in_use.fetch_add(size, Ordering::Relaxed);
        NonNull::new(ptr as *mut u8)
    }

    fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        let size = size_class(bytes);
        self.in_use.fetch_sub(size, Ordering::Relaxed);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(size)
            .or_default()
            .push(ptr.as_ptr() as sys::CUdeviceptr);
    }

    fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    unsafe fn write(&self, dst: NonNull<u8>, src: *const u8, bytes: usize) {
        self.bind();
        // SAFETY: the caller's contract: `src` is readable for `bytes` bytes.
        let host = unsafe { std::slice::from_raw_parts(src, bytes) };
        let stream = self.stream.cu_stream();
        // SAFETY: `dst` is a block of ours holding `bytes` bytes.
        // From pageable host memory the driver stages `host` before it returns, so the
        // caller may reuse it at once; the copy itself runs in stream order, before every
        // kernel launched after it. No wait for the device. (Pinned or registered host
        // memory would not be staged: callers free `src` right after this call, so such a
        // source would need a wait here.)
        check("copy to device", unsafe {
            result::memcpy_htod_async(dst.as_ptr() as sys::CUdeviceptr, host, stream)
        });
    }

    unsafe fn read(&self, dst: *mut u8, src: NonNull<u8>, bytes: usize) {
        self.bind();
        // SAFETY: the caller's contract: `dst` is writable for `bytes` bytes.
        let host = unsafe { std::slice::from_raw_parts_mut(dst, bytes) };
        let stream = self.stream.cu_stream();
        // SAFETY: `src` is a block of ours holding `bytes` bytes.
        check("copy to host", unsafe {
            result::memcpy_dtoh_async(host, src.as_ptr() as sys::CUdeviceptr, stream)
        });
        check("synchronize", self.stream.synchronize());
    }

    unsafe fn zero(&self, dst: NonNull<u8>, bytes: usize) {
        self.bind();
        let stream = self.stream.cu_stream();
        // SAFETY: `dst` is a block of ours holding `bytes` bytes.
        // In stream order, before every kernel launched after it: no wait for the device.
        check("memset", unsafe {
            result::memset_d8_async(dst.as_ptr() as sys::CUdeviceptr, 0, bytes, stream)
        });
    }

    fn host_accessible(&self) -> bool {
        false
    }

    fn synchronize(&self) {
        self.bind();
        check("synchronize", self.stream.synchronize());
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        self.empty_cache();
    }
}

/// A block of a rank's device memory that the backend itself owns (kernel arguments such as
/// positions and routing tables, RoPE tables, reduction partials, the GEMM workspace),
/// returned to the cache when dropped. Counted by the allocator, not by the ledger.
pub struct DeviceVec {
    memory: Arc<CudaMemory>,
    ptr: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the block is device memory owned by this value; the host never reads it.
unsafe impl Send for DeviceVec {}
// SAFETY: as above.
unsafe impl Sync for DeviceVec {}

impl DeviceVec {
    /// `bytes` bytes, zeroed.
    pub fn zeros(memory: &Arc<CudaMemory>, bytes: usize) -> DeviceVec {
        let v = DeviceVec::uninit(memory, bytes);
        // SAFETY: our block of `bytes` bytes.
        unsafe { memory.zero(v.ptr, bytes.max(1)) };
        v
    }

    /// A copy of `data`.
    pub fn upload<T: Copy>(memory: &Arc<CudaMemory>, data: &[T]) -> DeviceVec {
        let bytes = std::mem::size_of_val(data);
        let v = DeviceVec::uninit(memory, bytes);
        if bytes > 0 {
            // SAFETY: our block holds `bytes` bytes; `data` is that many readable bytes.
            unsafe { memory.write(v.ptr, data.as_ptr().cast(), bytes) };
        }
        v
    }

    fn uninit(memory: &Arc<CudaMemory>, bytes: usize) -> DeviceVec {
        let ptr = memory.alloc(bytes.max(1)).unwrap_or_else(|| {
            panic!(
                "GPU memory exhausted: {bytes} bytes of backend scratch with {} in use",
                memory.in_use()
            )
        });
        DeviceVec {
            memory: memory.clone(),
            ptr,
            bytes: bytes.max(1),
        }
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Reads the block back as `n` values of `T`.
    pub fn download<T: Copy + Default>(&self, n: usize) -> Vec<T> {
        assert!(
            n * std::mem::size_of::<T>() <= self.bytes,
            "read past the block"
        );
        let mut out = vec![T::default(); n];
        // SAFETY: `out` has room for `n` values; the block holds at least that many bytes.
        unsafe {
            self.memory.read(
                out.as_mut_ptr().cast(),
                self.ptr,
                std::mem::size_of_val(&out[..]),
            )
        };
        out
    }
}

impl Drop for DeviceVec {
    fn drop(&mut self) {
        self.memory.free(self.ptr, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up_to_512_bytes_then_2_mib() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class((2 << 20) + 1), 4 << 20);
    }
}
