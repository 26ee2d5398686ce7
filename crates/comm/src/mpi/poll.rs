//! Waiting on MPI without ever blocking in it: the one lock every MPI call holds, polling
//! non-blocking requests until [`Transport::timeout`] passes, and how failures and
//! timeouts are recorded.
//!
//! Every operation of the backend starts its MPI calls non-blocking and waits here, so that
//! a late peer becomes [`CommError::Timeout`] instead of a hang, and a failure recorded by
//! any thread stops the others at their next poll ([`CommError::PeerFailed`]).

use std::os::raw::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::MutexGuard;
use std::thread;
use std::time::{Duration, Instant};

use ::mpi::ffi;

use super::raw::{null_request, status_ignore};
use super::{Mpi, MpiWorld, Shared};
use crate::comm::Transport;
use crate::error::CommError;

/// How a wait on MPI requests ended, short of an error.
pub(super) enum Waited {
    /// Every request completed.
    Done,
    /// The deadline passed; the indices of the requests still pending.
    Late(Vec<usize>),
}

/// Polls with increasing pauses: yields at first (low latency), then sleeps up to 1 ms (so
/// that waiting ranks leave the cores to computing ones).
pub(super) struct Backoff(pub(super) u32);

impl Backoff {
    pub(super) fn snooze(&mut self) {
        self.0 = self.0.saturating_add(1);
        if self.0 < 64 {
            thread::yield_now();
        } else {
            let shift = (self.0 - 64).min(7);
            thread::sleep(Duration::from_micros(8u64 << shift));
        }
    }
}

/// Counts an operation as active for as long as it lives.
pub(super) struct Active<'a>(&'a AtomicUsize);

impl<'a> Active<'a> {
    pub(super) fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Active(counter)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    pub(super) fn lock_mpi(&self) -> MutexGuard<'_, Mpi> {
        // Nothing panics while holding the lock; if something did, the handles are valid.
        self.mpi.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl MpiWorld {
    pub(super) fn lock_mpi(&self) -> MutexGuard<'_, Mpi> {
        self.shared.lock_mpi()
    }

    pub(super) fn record_failure(&self, rank: usize, reason: String) {
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some((rank, reason));
        }
    }

    pub(super) fn peer_failed(&self) -> Result<(), CommError> {
        match self.failure() {
            Some((rank, reason)) => Err(CommError::PeerFailed { rank, reason }),
            None => Ok(()),
        }
    }

    pub(super) fn finalized(&self, op: &'static str) -> CommError {
        CommError::Backend {
            op,
            rank: self.rank,
            message: "MPI has been finalized".to_string(),
        }
    }

    pub(super) fn check_code(
        &self,
        op: &'static str,
        call: &str,
        code: c_int,
    ) -> Result<(), CommError> {
        if code == ffi::MPI_SUCCESS as c_int {
            return Ok(());
        }
        Err(CommError::Backend {
            op,
            rank: self.rank,
            message: format!("{call} failed with MPI error code {code}"),
        })
    }

    /// Runs `f` with the MPI lock held, or fails when MPI is finalized.
    pub(super) fn with_mpi<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Mpi) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let mut mpi = self.lock_mpi();
        if mpi.universe.is_none() {
            return Err(self.finalized(op));
        }
        f(&mut mpi)
    }

    /// Polls `requests` until every one completes, a failure is recorded or the timeout
    /// passes. The MPI lock is released between polls.
    pub(super) fn wait_all(
        &self,
        op: &'static str,
        requests: &mut [ffi::MPI_Request],
    ) -> Result<Waited, CommError> {
        let deadline = Instant::now().checked_add(self.timeout);
        let null = null_request();
        let mut backoff = Backoff(0);
        loop {
            let pending = self.with_mpi(op, |_| {
                let mut pending = Vec::new();
                for (i, r) in requests.iter_mut().enumerate() {
                    if *r == null {
                        continue;
                    }
                    let mut flag: c_int = 0;
                    // SAFETY: `r` is a live request started by this process (or null, which
                    // MPI_Test accepts); MPI sets it to null once complete.
                    let code = unsafe { ffi::MPI_Test(r, &mut flag, status_ignore()) };
                    self.check_code(op, "MPI_Test", code)?;
                    if flag == 0 {
                        pending.push(i);
                    }
                }
                Ok(pending)
            })?;
            if pending.is_empty() {
                return Ok(Waited::Done);
            }
            self.peer_failed()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(Waited::Late(pending));
            }
            backoff.snooze();
        }
    }

    /// Turns a late wait into [`CommError::Timeout`] and marks the world failed.
    pub(super) fn timed_out(
        &self,
        op: &'static str,
        group: &[usize],
        missing: Vec<usize>,
    ) -> CommError {
        let err = CommError::Timeout {
            op,
            group: group.to_vec(),
            missing,
            after: self.timeout,
        };
        self.record_failure(self.rank, err.to_string());
        err
    }
}
