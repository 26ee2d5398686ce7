//! Raw MPI plumbing for the rest of the backend: the handle constants that rsmpi exports
//! only as `unsafe` statics, the MPI datatypes that carry ferrotron's elements as raw bits
//! (MPI never does arithmetic here), pointers into [`CommBuf`]s, and element counts as
//! MPI's `int`s.
//!
//! It exists so that every read of a library constant sits in one place and the modules
//! that make MPI calls read as those calls.

use std::os::raw::{c_int, c_void};

use ::mpi::ffi;

use crate::buf::{CommBuf, DType};

pub(super) fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading an immutable handle constant exported by the MPI library.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

pub(super) fn status_ignore() -> *mut ffi::MPI_Status {
    // SAFETY: reading an immutable constant exported by the MPI library.
    unsafe { ffi::RSMPI_STATUS_IGNORE }
}

/// The MPI datatype that carries one element of `dtype` as raw bits.
pub(super) fn raw_type(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading immutable handle constants exported by the MPI library.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_UINT32_T,
            DType::Bf16 => ffi::RSMPI_UINT16_T,
        }
    }
}

pub(super) fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an immutable handle constant exported by the MPI library.
    unsafe { ffi::RSMPI_UINT8_T }
}

pub(super) fn f32_bits_type() -> ffi::MPI_Datatype {
    raw_type(DType::F32)
}

pub(super) fn buf_ptr(buf: &CommBuf) -> *const c_void {
    match buf {
        CommBuf::F32(b) => b.host().as_ptr().cast(),
        CommBuf::Bf16(b) => b.host().as_ptr().cast(),
    }
}

pub(super) fn buf_mut_ptr(buf: &mut CommBuf) -> *mut c_void {
    match buf {
        CommBuf::F32(b) => b.host_mut().as_mut_ptr().cast(),
        CommBuf::Bf16(b) => b.host_mut().as_mut_ptr().cast(),
    }
}

/// Element counts and displacements as MPI's `int`s (sizes are checked before).
pub(super) fn ints(values: impl IntoIterator<Item = usize>) -> Vec<c_int> {
    values
        .into_iter()
        .map(|v| c_int::try_from(v).unwrap_or(c_int::MAX))
        .collect()
}

/// `[0, c₀, c₀+c₁, …]`: displacements of consecutive blocks.
pub(super) fn prefix(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0usize, |acc, &c| {
            let at = *acc;
            *acc += c;
            Some(at)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert_eq!(prefix(&[2, 0, 3]), vec![0, 2, 2]);
        assert!(prefix(&[]).is_empty());
    }
}
