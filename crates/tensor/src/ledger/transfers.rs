//! A ledger's explicit host↔device transfers: uploads and downloads through it, and the
//! host values and tables kernels exchange, each counted under a label.

use std::collections::BTreeMap;

use super::{Buf, Category, Ledger};
use crate::DeviceSlice;

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
