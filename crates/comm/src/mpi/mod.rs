//! The MPI backend: one process per rank, launched by `mpirun` (or `srun`), exchanging data
//! with MPI and reducing it locally so that results are bit-identical to
//! [`ThreadWorld`](crate::ThreadWorld)'s.
//!
//! # Launching
//!
//! Rank and world size come from MPI itself: `mpirun -np 4 ferrotron train --set
//! parallel.backend=mpi --set parallel.dp=4`, or under Slurm `srun --mpi=pmix -n 4 ferrotron
//! ...` when the MPI library was built with PMI/PMIx support (Debian's and most distributions'
//! OpenMPI are). A process started without a launcher is a world of one rank (MPI singleton).
//!
//! # How operations map to MPI
//!
//! Every group gets its own communicator, created the first time the group is used with
//! `MPI_Comm_create_group` (collective over the group's members only, not the world) once
//! every member has greeted the others, and cached. Each collective first exchanges a
//! small header with the other members (operation, dtype, sizes, or the reason this
//! member's arguments are invalid) by point-to-point messages on that communicator, and
//! every member checks the headers with the same rules as the threads backend: members
//! that disagree all return [`CommError::Mismatch`], and the data collective is never
//! called with inconsistent sizes. The data then moves as raw bits (`uint32`/`uint16`
//! elements; MPI never does arithmetic) and reductions happen locally in group-index order:
//!
//! | operation | MPI calls | local work |
//! | --- | --- | --- |
//! | all-reduce | `MPI_Ialltoallv` of even shares, `MPI_Iallgatherv` of the f32 share sums | sum own share in group order in f32 (mean: divide), round once |
//! | reduce-scatter | `MPI_Ialltoallv` of the chunks | sum own chunk in group order in f32, round once |
//! | all-gather | `MPI_Iallgatherv` | — |
//! | broadcast | `MPI_Ibcast` | — |
//! | all-to-all | `MPI_Ialltoallv` | — |
//! | barrier | `MPI_Ibarrier` | — |
//! | send / recv | `MPI_Isend` / `MPI_Improbe` + `MPI_Imrecv` | — |
//!
//! This is exactly what [`ThreadWorld`](crate::ThreadWorld) computes (the same even shares,
//! the same order of additions, the same single rounding), so both backends produce the
//! same bits.
//!
//! Sends are buffered in the sense of [`Op::Send`]: the message is handed to `MPI_Isend`
//! and the operation completes at once; the buffer is kept alive until MPI reports the
//! send complete, and a background thread keeps pending sends progressing while the rank
//! issues nothing else. The tag and the dtype travel in the MPI tag (`2·tag + dtype`), so
//! tags are limited to half of the library's `MPI_TAG_UB` (at least 16383; about 10⁹ with
//! OpenMPI).
//!
//! # Threads
//!
//! The rank's [`Comm`](crate::Comm) worker thread makes the MPI calls of its operations, the
//! background thread makes those that progress pending sends, and [`Transport::fail`] may
//! call `MPI_Abort` from any thread; every call holds one lock, so the library needs
//! `MPI_THREAD_SERIALIZED` and [`MpiWorld::init`] refuses a library that cannot provide it.
//!
//! # Timeouts and failures
//!
//! Operations are started non-blocking and polled, so every wait ends after
//! [`Transport::timeout`] with [`CommError::Timeout`]: for the header exchange it names the
//! members whose header never came; once the data moves, MPI cannot tell who is late and
//! every other member is named; before a group's first use, the members that never greeted
//! are named. After a timeout the world is marked failed (every
//! later operation returns [`CommError::PeerFailed`]); MPI cannot cancel a started
//! collective, so the process should then [`fail`](Transport::fail).
//!
//! [`Transport::fail`] prints `rank R failed: REASON` to stderr and calls `MPI_Abort` on the
//! world with error code 1: MPI has no way to interrupt peers blocked in a collective, and
//! an abort makes the launcher (`mpirun`, `srun`) stop every process of the job and exit
//! non-zero. It does not return.
//!
//! # Layout
//!
//! This file holds [`MpiWorld`], its shared state and its [`Transport`] implementation;
//! the rest is split by concern: `world` (init and finalize), `poll` (the MPI lock and
//! polled waits), `group` (group communicators), `header` (the header exchange),
//! `collectives`, `p2p` (send and receive), `limits` (what MPI cannot express) and `raw`
//! (FFI constants and conversions).

mod collectives;
mod group;
mod header;
mod limits;
mod p2p;
mod poll;
mod raw;
mod world;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ::mpi::environment::Universe;
use ::mpi::ffi;
use ::mpi::topology::SimpleCommunicator;
use ferrotron_tensor::Ledger;

use self::p2p::PendingSend;
use self::poll::Active;
use crate::comm::Transport;
use crate::error::CommError;
use crate::op::{Op, OpOutput};

/// How long [`Transport::fail`] waits for the lock before aborting without it.
const ABORT_LOCK_WAIT: Duration = Duration::from_secs(2);

/// A world of ranks that are MPI processes (see the [module documentation](self)).
///
/// Create it once per process with [`MpiWorld::init`], hand it to a
/// [`Comm`](crate::Comm) for this process's [`rank`](MpiWorld::rank), and
/// [`finalize`](MpiWorld::finalize) it at the end (dropping the last reference does the
/// same, quietly).
pub struct MpiWorld {
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Largest user tag of a send or receive.
    max_tag: u64,
    shared: Arc<Shared>,
    progress: Mutex<Option<JoinHandle<()>>>,
}

/// What the rank's threads share: the MPI state behind its lock, and flags.
struct Shared {
    mpi: Mutex<Mpi>,
    failure: Mutex<Option<(usize, String)>>,
    /// Set to stop the progress thread.
    stop: AtomicBool,
    /// Operations currently executing (finalize waits for none).
    active: AtomicUsize,
}

/// MPI handles; every MPI call is made while holding the lock around this.
struct Mpi {
    /// `None` once finalized.
    universe: Option<Universe>,
    /// Duplicate of the world for point-to-point messages.
    p2p: Option<SimpleCommunicator>,
    /// Duplicate of the world for greetings before a group's communicator is created.
    control: Option<SimpleCommunicator>,
    /// Communicator of each group used so far, by member list.
    groups: HashMap<Vec<usize>, SimpleCommunicator>,
    /// Sends not yet complete, with the buffers they read.
    sends: Vec<PendingSend>,
}

// SAFETY: MPI handles are plain identifiers that any thread may use under
// MPI_THREAD_SERIALIZED (checked at init) as long as calls never overlap; every use of these
// handles happens while holding the mutex around `Mpi`.
unsafe impl Send for Mpi {}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiWorld(rank {} of {}, timeout {:?})",
            self.rank, self.size, self.timeout
        )
    }
}

impl Transport for MpiWorld {
    fn world_size(&self) -> usize {
        self.size
    }

    /// The configured timeout; every wait on peers ends after it (see the
    /// [module documentation](self) for the limits).
    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn execute(&self, rank: usize, op: Op, ledger: &Ledger) -> Result<OpOutput, CommError> {
        let _active = Active::new(&self.shared.active);
        self.peer_failed()?;
        if rank != self.rank {
            return Err(CommError::InvalidArgument {
                op: op.name(),
                message: format!(
                    "this process is MPI rank {}; it cannot act for rank {rank}",
                    self.rank
                ),
            });
        }
        let index = op.check_group(rank, self.size)?;
        let args = op.check_args(index).and_then(|()| self.check_limits(&op));
        match op {
            Op::Send { dst, tag, buf } => {
                args?;
                self.send(dst, tag, buf)
            }
            Op::Recv {
                src,
                tag,
                len,
                dtype,
            } => {
                args?;
                self.recv(src, tag, len, dtype, ledger)
            }
            op => self.collective(index, op, args, ledger),
        }
    }

    /// Records the failure, prints `rank R failed: REASON` to stderr and aborts the whole
    /// job with `MPI_Abort(MPI_COMM_WORLD, 1)`; does not return.
    fn fail(&self, rank: usize, reason: &str) {
        self.record_failure(rank, reason.to_string());
        eprintln!("rank {rank} failed: {reason}");
        // Wait for the lock so that the abort does not overlap another MPI call; a call
        // blocked inside MPI (creating a communicator) must not stop the abort, though.
        let deadline = Instant::now() + ABORT_LOCK_WAIT;
        let guard = loop {
            match self.shared.mpi.try_lock() {
                Ok(g) => break Some(g),
                Err(std::sync::TryLockError::Poisoned(e)) => break Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => break None,
            }
        };
        let live = guard.as_ref().is_none_or(|m| m.universe.is_some());
        if live {
            // SAFETY: MPI is initialised and not finalized; MPI_Abort does not return.
            unsafe {
                ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
            }
        }
        std::process::exit(1);
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
