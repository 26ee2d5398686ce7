//! Storage in f32, bf16 or IEEE half (fp16), read back as f32 for compute.
//!
//! Mixed precision here means: tensors that persist (weights, saved activations, gradients)
//! are *stored* in bf16 or fp16; kernels compute in f32 on a workspace copy and round once
//! when they store. In f32 mode a read borrows the buffer itself, so no copy is made.

use std::ops::{Deref, Range};
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::{Backend, Buf, Category, Device, DeviceSlice, Ledger, PAR_CHUNK};

/// Element type of a [`Store`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreDType {
    /// 4 bytes per element.
    F32,
    /// 2 bytes per element, rounded to nearest even.
    Bf16,
    /// IEEE half: 2 bytes per element, rounded to nearest even, finite up to ±65504.
    F16,
}

/// A counted buffer of f32, bf16 or IEEE-half elements.
#[derive(Debug)]
pub enum Store {
    /// Full precision.
    F32(Buf<f32>),
    /// bf16 storage.
    Bf16(Buf<bf16>),
    /// IEEE-half storage.
    F16(Buf<f16>),
}

/// An f32 view of a [`Store`]: borrowed in f32 mode, a workspace copy in bf16 and fp16 modes.
pub enum View<'a> {
    /// The stored f32 data itself.
    Borrowed(&'a DeviceSlice<f32>),
    /// A converted copy, counted as workspace until dropped.
    Owned(Buf<f32>),
    /// A range of a shared buffer (e.g. weights gathered by ZeRO-3, freed with the last view).
    Shared(Arc<Buf<f32>>, Range<usize>),
}

impl Deref for View<'_> {
    type Target = DeviceSlice<f32>;
    fn deref(&self) -> &DeviceSlice<f32> {
        match self {
            View::Borrowed(s) => s,
            View::Owned(b) => b,
            View::Shared(b, r) => &b[r.clone()],
        }
    }
}

/// Rounds `src` into `dst` (bf16), in parallel.
pub fn round_into(dst: &mut [bf16], src: &[f32]) {
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| {
            d.iter_mut()
                .zip(s)
                .for_each(|(d, s)| *d = bf16::from_f32(*s))
        });
}

/// Rounds `src` into `dst` (IEEE half, to nearest even), in parallel, on the F16C
/// conversions where the CPU has them.
pub fn round_f16_into(dst: &mut [f16], src: &[f32]) {
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| d.convert_from_f32_slice(s));
}

/// Widens `src` (IEEE half) into `dst` (f32), in parallel, on the F16C conversions where
/// the CPU has them.
pub fn widen_f16_into(dst: &mut [f32], src: &[f16]) {
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| s.convert_to_f32_slice(d));
}

/// Widens `src` (bf16) into `dst` (f32), in parallel.
pub fn widen_into(dst: &mut [f32], src: &[bf16]) {
    dst.par_chunks_mut(PAR_CHUNK)
        .zip(src.par_chunks(PAR_CHUNK))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d = s.to_f32()));
}

impl Store {
    /// A zeroed store of `len` elements.
    pub fn zeros(ledger: &Ledger, cat: Category, dtype: StoreDType, len: usize) -> Store {
        match dtype {
            StoreDType::F32 => Store::F32(ledger.zeros(cat, len)),
            StoreDType::Bf16 => Store::Bf16(ledger.zeros(cat, len)),
            StoreDType::F16 => Store::F16(ledger.zeros(cat, len)),
        }
    }

    /// Keeps an f32 buffer: as it is in f32 mode (re-counted under `cat`), rounded to bf16 in
    /// bf16 or fp16 mode (the f32 buffer is freed).
    pub fn keep(dev: Device<'_>, cat: Category, dtype: StoreDType, data: Buf<f32>) -> Store {
        match dtype {
            StoreDType::F32 if data.category() == cat => Store::F32(data),
            StoreDType::F32 => {
                let mut b = dev.ledger.overwritten(cat, data.len());
                dev.backend.copy(&mut b, &data);
                Store::F32(b)
            }
            StoreDType::Bf16 => {
                let mut b = dev.ledger.zeros(cat, data.len());
                dev.backend.round_bf16(&mut b, &data);
                Store::Bf16(b)
            }
            StoreDType::F16 => {
                let mut b = dev.ledger.zeros(cat, data.len());
                dev.backend.round_f16(&mut b, &data);
                Store::F16(b)
            }
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Store::F32(b) => b.len(),
            Store::Bf16(b) => b.len(),
            Store::F16(b) => b.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> StoreDType {
        match self {
            Store::F32(_) => StoreDType::F32,
            Store::Bf16(_) => StoreDType::Bf16,
            Store::F16(_) => StoreDType::F16,
        }
    }

    /// The elements of `range` as f32: the stored data itself in f32 mode, a widened
    /// workspace copy in bf16 and fp16 modes.
    pub fn view(&self, dev: Device<'_>, range: Range<usize>) -> View<'_> {
        match self {
            Store::F32(b) => View::Borrowed(&b[range]),
            Store::Bf16(b) => {
                // Widening writes every element: no pass of zeros first.
                let mut out = dev.ledger.overwritten(Category::Workspace, range.len());
                dev.backend.widen_bf16(&mut out, &b[range]);
                View::Owned(out)
            }
            Store::F16(b) => {
                let mut out = dev.ledger.overwritten(Category::Workspace, range.len());
                dev.backend.widen_f16(&mut out, &b[range]);
                View::Owned(out)
            }
        }
    }

    /// Every element as stored, for a kernel that reads f32 or bf16; `None` for IEEE half,
    /// which products read through an f32 [`view`](Store::view).
    pub fn operand(&self) -> Option<crate::Operand<'_>> {
        match self {
            Store::F32(b) => Some(crate::Operand::F32(b)),
            Store::Bf16(b) => Some(crate::Operand::Bf16(b)),
            Store::F16(_) => None,
        }
    }

    /// All elements as f32.
    pub fn view_all(&self, dev: Device<'_>) -> View<'_> {
        self.view(dev, 0..self.len())
    }

    /// Overwrites `range` with `src` (rounded in bf16 and fp16 modes).
    pub fn write(&mut self, be: &dyn Backend, range: Range<usize>, src: &DeviceSlice<f32>) {
        debug_assert_eq!(range.len(), src.len(), "Store::write: source length");
        match self {
            Store::F32(b) => be.copy(&mut b[range], src),
            Store::Bf16(b) => be.round_bf16(&mut b[range], src),
            Store::F16(b) => be.round_f16(&mut b[range], src),
        }
    }

    /// Adds `src` into `range` (in bf16 and fp16 modes: widen, add, round).
    pub fn add(&mut self, be: &dyn Backend, range: Range<usize>, src: &DeviceSlice<f32>) {
        match self {
            Store::F32(b) => be.add_assign(&mut b[range], src),
            Store::Bf16(b) => be.add_assign_bf16(&mut b[range], src),
            Store::F16(b) => be.add_assign_f16(&mut b[range], src),
        }
    }

    /// Sets every element to zero.
    pub fn fill_zero(&mut self, be: &dyn Backend) {
        match self {
            Store::F32(b) => be.fill(b, 0.0),
            Store::Bf16(b) => be.fill_bf16(b, bf16::ZERO),
            Store::F16(b) => be.fill_f16(b, f16::ZERO),
        }
    }

    /// Raw little-endian bytes of the elements of `range` (for safetensors): a device-to-host
    /// transfer counted on `ledger` under `what`.
    pub fn to_le_bytes(&self, ledger: &Ledger, what: &'static str, range: Range<usize>) -> Vec<u8> {
        match self {
            Store::F32(b) => ledger
                .download(what, &b[range])
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            Store::Bf16(b) => ledger
                .download(what, &b[range])
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
            Store::F16(b) => ledger
                .download(what, &b[range])
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        }
    }
}
