//! Device memory as the engine sees it: elements it hands to kernels and collectives but
//! cannot read or write itself.
//!
//! Every [`Buf`](crate::Buf) dereferences to a [`DeviceSlice`], and every [`Backend`]
//! kernel takes device slices. A device slice has a length and can be cut into sub-slices;
//! it has no element access. The engine (model, parallel techniques, trainer) moves data
//! between host and device only through the ledger's explicit transfers,
//! [`Ledger::upload`](crate::Ledger::upload) and [`Ledger::download`](crate::Ledger::download),
//! each counted under a label (token ids in, the loss out, …), so a test can assert what
//! crosses the bus in a step.
//!
//! Only code that runs *on* the device reads the elements: a backend's kernels and a
//! collective library's transport ([`DeviceSlice::host`], [`DeviceSlice::host_mut`]). For
//! the CPU backend that memory is host memory and costs nothing; a GPU backend's is device
//! memory handed to its kernels and to NCCL. The architecture test checks that the engine
//! crates never call those two accessors.
//!
//! [`Backend`]: crate::Backend

use std::ops::{Index, IndexMut};
use std::slice::SliceIndex;

/// A run of device elements: passed to kernels and collectives, never read by the engine.
#[repr(transparent)]
pub struct DeviceSlice<T>([T]);

impl<T> DeviceSlice<T> {
    /// Host memory seen as the CPU backend's device memory: for that backend and for tests,
    /// under the same rule as [`DeviceSlice::host`] (the engine crates never call it).
    pub fn from_host(s: &[T]) -> &DeviceSlice<T> {
        DeviceSlice::of(s)
    }

    /// Mutable version of [`DeviceSlice::from_host`].
    pub fn from_host_mut(s: &mut [T]) -> &mut DeviceSlice<T> {
        DeviceSlice::of_mut(s)
    }

    /// Views host memory owned by a buffer as device memory (the CPU backend's memory).
    pub(crate) fn of(s: &[T]) -> &DeviceSlice<T> {
        // SAFETY: `DeviceSlice<T>` is `repr(transparent)` over `[T]`.
        unsafe { &*(s as *const [T] as *const DeviceSlice<T>) }
    }

    /// Mutable version of [`DeviceSlice::of`].
    pub(crate) fn of_mut(s: &mut [T]) -> &mut DeviceSlice<T> {
        // SAFETY: `DeviceSlice<T>` is `repr(transparent)` over `[T]`.
        unsafe { &mut *(s as *mut [T] as *mut DeviceSlice<T>) }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The elements, for code that runs on the device: a backend's kernels and a collective
    /// library's transport. The engine crates never call it (architecture test); they use
    /// the ledger's counted transfers.
    pub fn host(&self) -> &[T] {
        &self.0
    }

    /// Mutable version of [`DeviceSlice::host`], under the same rule.
    pub fn host_mut(&mut self) -> &mut [T] {
        &mut self.0
    }

    /// Two pieces: `[0, mid)` and `[mid, len)`.
    pub fn split_at(&self, mid: usize) -> (&DeviceSlice<T>, &DeviceSlice<T>) {
        let (a, b) = self.0.split_at(mid);
        (DeviceSlice::of(a), DeviceSlice::of(b))
    }

    /// Two disjoint mutable pieces: `[0, mid)` and `[mid, len)`.
    pub fn split_at_mut(&mut self, mid: usize) -> (&mut DeviceSlice<T>, &mut DeviceSlice<T>) {
        let (a, b) = self.0.split_at_mut(mid);
        (DeviceSlice::of_mut(a), DeviceSlice::of_mut(b))
    }

    /// Consecutive pieces of `size` elements (the last may be shorter).
    pub fn chunks(&self, size: usize) -> impl Iterator<Item = &DeviceSlice<T>> {
        self.0.chunks(size).map(DeviceSlice::of)
    }

    /// Mutable version of [`DeviceSlice::chunks`].
    pub fn chunks_mut(&mut self, size: usize) -> impl Iterator<Item = &mut DeviceSlice<T>> {
        self.0.chunks_mut(size).map(DeviceSlice::of_mut)
    }
}

impl<T, I: SliceIndex<[T], Output = [T]>> Index<I> for DeviceSlice<T> {
    type Output = DeviceSlice<T>;
    fn index(&self, i: I) -> &DeviceSlice<T> {
        DeviceSlice::of(&self.0[i])
    }
}

impl<T, I: SliceIndex<[T], Output = [T]>> IndexMut<I> for DeviceSlice<T> {
    fn index_mut(&mut self, i: I) -> &mut DeviceSlice<T> {
        DeviceSlice::of_mut(&mut self.0[i])
    }
}

impl<T> std::fmt::Debug for DeviceSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceSlice[{}]", self.0.len())
    }
}

impl DeviceSlice<f32> {
    /// These elements as a kernel's [`Operand`].
    pub fn operand(&self) -> Operand<'_> {
        Operand::F32(self)
    }
}

impl DeviceSlice<half::bf16> {
    /// These elements as a kernel's [`Operand`].
    pub fn operand(&self) -> Operand<'_> {
        Operand::Bf16(self)
    }
}

/// A kernel's input in the precision it is stored in: f32 or bf16 device elements. A kernel
/// that takes one reads bf16 directly (widened inside, exactly), so no f32 copy is made.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    /// f32 elements.
    F32(&'a DeviceSlice<f32>),
    /// bf16 elements.
    Bf16(&'a DeviceSlice<half::bf16>),
}

impl<'a> Operand<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Operand::F32(s) => s.len(),
            Operand::Bf16(s) => s.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements of `range`.
    pub fn range(self, range: std::ops::Range<usize>) -> Operand<'a> {
        match self {
            Operand::F32(s) => Operand::F32(&s[range]),
            Operand::Bf16(s) => Operand::Bf16(&s[range]),
        }
    }

    /// Bytes per element: 4 or 2.
    pub fn element_bytes(&self) -> usize {
        match self {
            Operand::F32(_) => 4,
            Operand::Bf16(_) => 2,
        }
    }
}
