//! Point-to-point messages on a duplicate of the world: [`Op::Send`] with `MPI_Isend`
//! (buffered: the operation completes at once and the buffer is kept until MPI reports the
//! send complete, with a background thread progressing pending sends), and [`Op::Recv`] with
//! `MPI_Improbe` + `MPI_Imrecv`, polled until the timeout.
//!
//! The user tag and the dtype travel together in the MPI tag (`2·tag + dtype`), so a
//! receive matches the oldest message with its tag of either dtype and reports a wrong
//! dtype or length as [`CommError::Mismatch`], as the threads backend does.
//!
//! [`Op::Send`]: crate::Op::Send
//! [`Op::Recv`]: crate::Op::Recv

use std::os::raw::c_int;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use ::mpi::ffi;
use ::mpi::raw::AsRaw;
use ferrotron_tensor::Ledger;

use super::poll::{Backoff, Waited};
use super::raw::{buf_mut_ptr, buf_ptr, ints, null_request, raw_type, status_ignore};
use super::{Mpi, MpiWorld, Shared};
use crate::buf::{CommBuf, DType};
use crate::error::CommError;
use crate::op::OpOutput;

/// Pause of the thread that progresses pending sends.
const PROGRESS_PAUSE: Duration = Duration::from_micros(500);

/// A send MPI has not yet reported complete.
pub(super) struct PendingSend {
    pub(super) request: ffi::MPI_Request,
    /// Read by MPI until the request completes.
    pub(super) _buf: CommBuf,
}

impl MpiWorld {
    /// The MPI tag of a message with user tag `tag` and elements of `dtype`.
    pub(super) fn mpi_tag(tag: u64, dtype: DType) -> c_int {
        let bit = u64::from(dtype == DType::Bf16);
        c_int::try_from(tag * 2 + bit).unwrap_or(c_int::MAX)
    }

    pub(super) fn send(&self, dst: usize, tag: u64, buf: CommBuf) -> Result<OpOutput, CommError> {
        let mpi_tag = Self::mpi_tag(tag, buf.dtype());
        let count = ints([buf.len()])[0];
        self.with_mpi("send", |mpi| {
            reap_sends(mpi);
            let comm = mpi
                .p2p
                .as_ref()
                .map(|c| c.as_raw())
                .ok_or_else(|| self.finalized("send"))?;
            let mut request = null_request();
            // SAFETY: the buffer is moved into `mpi.sends` with the request and stays there
            // (its heap storage unmoved) until MPI reports the send complete.
            let code = unsafe {
                ffi::MPI_Isend(
                    buf_ptr(&buf),
                    count,
                    raw_type(buf.dtype()),
                    dst as c_int,
                    mpi_tag,
                    comm,
                    &mut request,
                )
            };
            self.check_code("send", "MPI_Isend", code)?;
            mpi.sends.push(PendingSend { request, _buf: buf });
            Ok(OpOutput::Done)
        })
    }

    /// Receives `len` elements of `dtype` sent by `src` with `tag`, onto `ledger`; a message
    /// of another size or dtype is taken off the queue and reported as a mismatch.
    pub(super) fn recv(
        &self,
        src: usize,
        tag: u64,
        len: usize,
        dtype: DType,
        ledger: &Ledger,
    ) -> Result<OpOutput, CommError> {
        let mut pair = vec![src, self.rank];
        pair.sort_unstable();
        pair.dedup();
        let (sent_dtype, message, count) = self.matched(src, tag, dtype, &pair)?;
        // Receive the matched message (also when it does not fit, to take it off the queue).
        let out = self.receive_matched(message, (sent_dtype, count), ledger, &pair, src)?;
        if sent_dtype != dtype || count != len {
            return Err(CommError::Mismatch {
                op: "recv",
                group: pair,
                ranks: vec![src],
                detail: format!(
                    "rank {src} sent {count} × {sent_dtype} with tag {tag}; rank {} expects {len} × {dtype}",
                    self.rank
                ),
            });
        }
        Ok(OpOutput::Buf(out))
    }

    /// Waits (polling, up to the timeout) for the oldest message from `src` with `tag`, of
    /// `dtype` or the other dtype: its dtype, the matched message and its element count.
    fn matched(
        &self,
        src: usize,
        tag: u64,
        dtype: DType,
        pair: &[usize],
    ) -> Result<(DType, ffi::MPI_Message, usize), CommError> {
        let deadline = Instant::now().checked_add(self.timeout);
        let mut backoff = Backoff(0);
        loop {
            if let Some(found) = self.with_mpi("recv", |mpi| self.probe(mpi, src, tag, dtype))? {
                return Ok(found);
            }
            self.peer_failed()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self.timed_out("recv", pair, vec![src]));
            }
            backoff.snooze();
        }
    }

    /// One probe (`MPI_Improbe`) for a message from `src` with `tag`, of `dtype` first and
    /// then of the other dtype.
    fn probe(
        &self,
        mpi: &mut Mpi,
        src: usize,
        tag: u64,
        dtype: DType,
    ) -> Result<Option<(DType, ffi::MPI_Message, usize)>, CommError> {
        let comm = mpi
            .p2p
            .as_ref()
            .map(|c| c.as_raw())
            .ok_or_else(|| self.finalized("recv"))?;
        let other = match dtype {
            DType::F32 => DType::Bf16,
            DType::Bf16 => DType::F32,
        };
        for dt in [dtype, other] {
            let mut flag: c_int = 0;
            // SAFETY: reading a handle constant; the status is plain data that
            // MPI_Improbe fills in.
            let mut message = unsafe { ffi::RSMPI_MESSAGE_NULL };
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            // SAFETY: all pointers are to live locals.
            let code = unsafe {
                ffi::MPI_Improbe(
                    src as c_int,
                    Self::mpi_tag(tag, dt),
                    comm,
                    &mut flag,
                    &mut message,
                    &mut status,
                )
            };
            self.check_code("recv", "MPI_Improbe", code)?;
            if flag != 0 {
                let mut count: c_int = 0;
                // SAFETY: `status` was filled in by the successful probe.
                let code = unsafe { ffi::MPI_Get_count(&status, raw_type(dt), &mut count) };
                self.check_code("recv", "MPI_Get_count", code)?;
                return Ok(Some((dt, message, usize::try_from(count).unwrap_or(0))));
            }
        }
        Ok(None)
    }

    /// Receives the matched `message` (`count` elements of `dtype`) into a new buffer on
    /// `ledger`; the buffer is leaked if the wait gives up.
    fn receive_matched(
        &self,
        mut message: ffi::MPI_Message,
        (dtype, count): (DType, usize),
        ledger: &Ledger,
        pair: &[usize],
        src: usize,
    ) -> Result<CommBuf, CommError> {
        let mut out = CommBuf::zeros(ledger, dtype, count);
        let ptr = buf_mut_ptr(&mut out);
        let mut request = [null_request()];
        let started = self.with_mpi("recv", |_| {
            // SAFETY: `out` holds `count` elements of the message's type and outlives the
            // request or is leaked; `message` came from MPI_Improbe.
            let code = unsafe {
                ffi::MPI_Imrecv(
                    ptr,
                    ints([count])[0],
                    raw_type(dtype),
                    &mut message,
                    &mut request[0],
                )
            };
            self.check_code("recv", "MPI_Imrecv", code)
        });
        match started.and_then(|()| self.wait_all("recv", &mut request)) {
            Ok(Waited::Done) => Ok(out),
            Ok(Waited::Late(_)) => {
                std::mem::forget(out);
                Err(self.timed_out("recv", pair, vec![src]))
            }
            Err(e) => {
                std::mem::forget(out);
                Err(e)
            }
        }
    }
}

/// Tests pending sends and drops the completed ones (with their buffers).
pub(super) fn reap_sends(mpi: &mut Mpi) {
    if mpi.universe.is_none() {
        return;
    }
    mpi.sends.retain_mut(|s| {
        let mut flag: c_int = 0;
        // SAFETY: `s.request` is a live send request of this process.
        let code = unsafe { ffi::MPI_Test(&mut s.request, &mut flag, status_ignore()) };
        code != ffi::MPI_SUCCESS as c_int || flag == 0
    });
}

/// Body of the progress thread: keeps pending sends moving while the rank issues nothing.
pub(super) fn progress_sends(shared: &Shared) {
    while !shared.stop.load(Ordering::SeqCst) {
        thread::sleep(PROGRESS_PAUSE);
        let mut mpi = shared.lock_mpi();
        if !mpi.sends.is_empty() {
            reap_sends(&mut mpi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_carry_the_dtype() {
        assert_eq!(MpiWorld::mpi_tag(5, DType::F32), 10);
        assert_eq!(MpiWorld::mpi_tag(5, DType::Bf16), 11);
    }
}
