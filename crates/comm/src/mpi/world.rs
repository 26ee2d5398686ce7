//! Starting and stopping MPI for this process: [`MpiWorld::init`] (`MPI_Init_thread` with
//! `MPI_THREAD_SERIALIZED`, the world's size and tag limit, the duplicated communicators,
//! the thread that progresses pending sends), the public accessors, and
//! [`MpiWorld::finalize`] with its quiet counterpart on drop.
//!
//! Finalising is the delicate part: `MPI_Finalize` must be reached by every process and can
//! block forever if something is pending, so it is only called once nothing is, and never
//! after a failure.

use std::collections::HashMap;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ::mpi::ffi;
use ::mpi::raw::AsRaw;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::Communicator;
use ::mpi::Threading;

use super::p2p::{progress_sends, reap_sends};
use super::poll::Backoff;
use super::{Mpi, MpiWorld, Shared};
use crate::comm::Transport;
use crate::error::CommError;

impl MpiWorld {
    /// Initialises MPI (`MPI_Init_thread`, asking for `MPI_THREAD_SERIALIZED`) and returns
    /// this process's view of the world; operations give up after `timeout` (see the
    /// [module documentation](crate::mpi)). Call it once per process: MPI cannot be initialised
    /// twice. Fails when MPI is already initialised or the library cannot provide
    /// `MPI_THREAD_SERIALIZED`.
    pub fn init(timeout: Duration) -> Result<Arc<MpiWorld>, CommError> {
        let backend = |message: String| CommError::Backend {
            op: "init",
            rank: 0,
            message,
        };
        let (universe, provided) = ::mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| {
                backend(
                    "MPI is already initialised in this process (MpiWorld::init can be called once)"
                        .to_string(),
                )
            })?;
        if provided < Threading::Serialized {
            drop(universe);
            return Err(backend(format!(
                "the MPI library provides only {provided:?} thread support; ferrotron makes its \
                 MPI calls from a communication thread and needs MPI_THREAD_SERIALIZED \
                 (use an MPI library built with thread support)"
            )));
        }
        let world = universe.world();
        let rank = usize::try_from(world.rank()).unwrap_or(0);
        let size = usize::try_from(world.size()).unwrap_or(1).max(1);
        let tag_ub = Self::tag_upper_bound(&world);
        let max_tag = u64::try_from((tag_ub - 1) / 2).unwrap_or(0);
        let p2p = world.duplicate();
        let control = world.duplicate();
        let shared = Arc::new(Shared {
            mpi: Mutex::new(Mpi {
                universe: Some(universe),
                p2p: Some(p2p),
                control: Some(control),
                groups: HashMap::new(),
                sends: Vec::new(),
            }),
            failure: Mutex::new(None),
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
        });
        let progress = {
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name(format!("mpi-progress-{rank}"))
                .spawn(move || progress_sends(&shared))
                .map_err(|e| backend(format!("cannot start the progress thread: {e}")))?
        };
        Ok(Arc::new(MpiWorld {
            rank,
            size,
            timeout,
            max_tag,
            shared,
            progress: Mutex::new(Some(progress)),
        }))
    }

    /// `MPI_TAG_UB` of the library (at least 32767 by the standard).
    fn tag_upper_bound(world: &SimpleCommunicator) -> c_int {
        let mut value: *mut c_int = std::ptr::null_mut();
        let mut flag: c_int = 0;
        // SAFETY: MPI_TAG_UB is a predefined attribute of the world communicator whose value
        // is a pointer to an int owned by the library; we only read it when MPI says it is
        // set.
        let ub = unsafe {
            ffi::MPI_Comm_get_attr(
                world.as_raw(),
                ffi::MPI_TAG_UB as c_int,
                (&mut value as *mut *mut c_int).cast(),
                &mut flag,
            );
            if flag != 0 && !value.is_null() {
                *value
            } else {
                32767
            }
        };
        ub.max(32767)
    }

    /// This process's rank in the world.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in the world.
    pub fn world_size(&self) -> usize {
        self.size
    }

    /// Largest tag [`Op::Send`](crate::Op::Send) and [`Op::Recv`](crate::Op::Recv) accept
    /// with this MPI library.
    pub fn max_tag(&self) -> u64 {
        self.max_tag
    }

    /// Waits (up to the timeout) for running operations and pending sends to complete,
    /// frees the communicators and finalises MPI (`MPI_Finalize`, which every process of
    /// the world must reach). Later operations fail with [`CommError::Backend`]. Calling it
    /// again does nothing. Fails without finalising when something is still pending, or
    /// after a failure.
    pub fn finalize(&self) -> Result<(), CommError> {
        let err = |message: String| CommError::Backend {
            op: "finalize",
            rank: self.rank,
            message,
        };
        if let Some((rank, reason)) = self.failure() {
            return Err(CommError::PeerFailed { rank, reason });
        }
        let deadline = Instant::now().checked_add(self.timeout);
        let mut backoff = Backoff(0);
        while self.shared.active.load(Ordering::SeqCst) > 0 {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(err(format!(
                    "an operation is still running after {:?}",
                    self.timeout
                )));
            }
            backoff.snooze();
        }
        self.stop_progress();
        let mut mpi = self.lock_mpi();
        if mpi.universe.is_none() {
            return Ok(());
        }
        let mut backoff = Backoff(0);
        loop {
            reap_sends(&mut mpi);
            if mpi.sends.is_empty() {
                break;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(err(format!(
                    "{} sends were never received (waited {:?})",
                    mpi.sends.len(),
                    self.timeout
                )));
            }
            drop(mpi);
            backoff.snooze();
            mpi = self.lock_mpi();
        }
        mpi.groups.clear();
        mpi.p2p = None;
        mpi.control = None;
        // Dropping the universe calls MPI_Finalize.
        drop(mpi.universe.take());
        Ok(())
    }

    fn stop_progress(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let handle = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        if self.finalize().is_err() {
            // MPI cannot be finalized cleanly (an operation is stuck or the world failed):
            // never call MPI_Finalize, which could block forever.
            self.stop_progress();
            let mut mpi = self.lock_mpi();
            std::mem::forget(std::mem::take(&mut mpi.groups));
            std::mem::forget(mpi.p2p.take());
            std::mem::forget(mpi.control.take());
            std::mem::forget(std::mem::take(&mut mpi.sends));
            std::mem::forget(mpi.universe.take());
        }
    }
}
