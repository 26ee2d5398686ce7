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
//! every member has greeted the others, and cached. Each collective first exchanges a small header with the other members
//! (operation, dtype, sizes, or the reason this member's arguments are invalid) by
//! point-to-point messages on that communicator, and every member checks the headers with
//! the same rules as the threads backend: members that disagree all return
//! [`CommError::Mismatch`], and the data collective is never called with inconsistent
//! sizes. The data then moves as raw bits (`uint32`/`uint16` elements; MPI never does
//! arithmetic) and reductions happen locally in group-index order:
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

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ::mpi::environment::Universe;
use ::mpi::ffi;
use ::mpi::raw::AsRaw;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::{Communicator, Group};
use ::mpi::Threading;
use ferrotron_tensor::{Category, Ledger};

use crate::buf::{Builder, CommBuf, DType};
use crate::collective::even_range;
use crate::comm::Transport;
use crate::error::CommError;
use crate::op::{check_agreement, Op, OpOutput, ReduceOp, Signature};

/// Bytes of the fixed-size header every member sends every other member of a collective.
const SLOT: usize = 256;
/// Header bytes available for the encoded signature (after its 8-byte length).
const INLINE: usize = SLOT - 8;
/// Tag of the fixed-size header on a group's communicator.
const TAG_HEADER: c_int = 1;
/// Tag of a signature too long for the fixed-size header.
const TAG_HEADER_LONG: c_int = 2;
/// Tag of the greeting members exchange before creating a group's communicator.
const TAG_HELLO: c_int = 3;
/// Largest encoded signature accepted from a peer.
const MAX_SIGNATURE: usize = 64 << 20;
/// How long [`Transport::fail`] waits for the lock before aborting without it.
const ABORT_LOCK_WAIT: Duration = Duration::from_secs(2);
/// Pause of the thread that progresses pending sends.
const PROGRESS_PAUSE: Duration = Duration::from_micros(500);

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

struct PendingSend {
    request: ffi::MPI_Request,
    /// Read by MPI until the request completes.
    _buf: CommBuf,
}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiWorld(rank {} of {}, timeout {:?})",
            self.rank, self.size, self.timeout
        )
    }
}

/// How a wait on MPI requests ended, short of an error.
enum Waited {
    /// Every request completed.
    Done,
    /// The deadline passed; the indices of the requests still pending.
    Late(Vec<usize>),
}

/// Polls with increasing pauses: yields at first (low latency), then sleeps up to 1 ms (so
/// that waiting ranks leave the cores to computing ones).
struct Backoff(u32);

impl Backoff {
    fn snooze(&mut self) {
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
struct Active<'a>(&'a AtomicUsize);

impl<'a> Active<'a> {
    fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Active(counter)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading an immutable handle constant exported by the MPI library.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn status_ignore() -> *mut ffi::MPI_Status {
    // SAFETY: reading an immutable constant exported by the MPI library.
    unsafe { ffi::RSMPI_STATUS_IGNORE }
}

/// The MPI datatype that carries one element of `dtype` as raw bits.
fn raw_type(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading immutable handle constants exported by the MPI library.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_UINT32_T,
            DType::Bf16 => ffi::RSMPI_UINT16_T,
        }
    }
}

fn bytes_type() -> ffi::MPI_Datatype {
    // SAFETY: reading an immutable handle constant exported by the MPI library.
    unsafe { ffi::RSMPI_UINT8_T }
}

fn f32_bits_type() -> ffi::MPI_Datatype {
    raw_type(DType::F32)
}

fn buf_ptr(buf: &CommBuf) -> *const c_void {
    match buf {
        CommBuf::F32(b) => b.as_ptr().cast(),
        CommBuf::Bf16(b) => b.as_ptr().cast(),
    }
}

fn buf_mut_ptr(buf: &mut CommBuf) -> *mut c_void {
    match buf {
        CommBuf::F32(b) => b.as_mut_ptr().cast(),
        CommBuf::Bf16(b) => b.as_mut_ptr().cast(),
    }
}

/// Element counts and displacements as MPI's `int`s (sizes are checked before).
fn ints(values: impl IntoIterator<Item = usize>) -> Vec<c_int> {
    values
        .into_iter()
        .map(|v| c_int::try_from(v).unwrap_or(c_int::MAX))
        .collect()
}

/// `[0, c₀, c₀+c₁, …]`: displacements of consecutive blocks.
fn prefix(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0usize, |acc, &c| {
            let at = *acc;
            *acc += c;
            Some(at)
        })
        .collect()
}

/// Σ over members, in group-index order and in f32, of `n` consecutive chunks of `m`
/// elements (as [`collective::sum_range`](crate::collective) does over separate buffers).
fn sum_chunks(chunks: &CommBuf, n: usize, m: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; m];
    if n > 0 {
        chunks.read_into(0, &mut acc);
        for j in 1..n {
            chunks.add_into(j * m, &mut acc);
        }
    }
    acc
}

/// A stable MPI tag for creating the communicator of `group` (distinct groups rarely
/// share one; the MPI standard guarantees tags up to 32767).
fn group_tag(group: &[usize]) -> c_int {
    let mut h = DefaultHasher::new();
    group.hash(&mut h);
    (h.finish() % 32_000) as c_int + 100
}

fn encode_signature(sig: &Signature) -> Vec<u8> {
    fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }
    fn put_counts(out: &mut Vec<u8>, v: &[usize]) {
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for &x in v {
            out.extend_from_slice(&(x as u64).to_le_bytes());
        }
    }
    let mut out = Vec::new();
    put_bytes(&mut out, sig.common.as_bytes());
    put_counts(&mut out, &sig.send);
    put_counts(&mut out, &sig.recv);
    match &sig.invalid {
        Some(m) => {
            out.push(1);
            put_bytes(&mut out, m.as_bytes());
        }
        None => out.push(0),
    }
    out
}

fn decode_signature(bytes: &[u8]) -> Option<Signature> {
    struct Reader<'a>(&'a [u8]);
    impl Reader<'_> {
        fn take(&mut self, n: usize) -> Option<&[u8]> {
            if n > self.0.len() {
                return None;
            }
            let (head, rest) = self.0.split_at(n);
            self.0 = rest;
            Some(head)
        }
        fn u64(&mut self) -> Option<u64> {
            Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
        }
        fn len(&mut self) -> Option<usize> {
            usize::try_from(self.u64()?).ok()
        }
        fn string(&mut self) -> Option<String> {
            let n = self.len()?;
            String::from_utf8(self.take(n)?.to_vec()).ok()
        }
        fn counts(&mut self) -> Option<Vec<usize>> {
            let n = self.len()?;
            if n > self.0.len() / 8 {
                return None;
            }
            (0..n).map(|_| self.len()).collect()
        }
    }
    let mut r = Reader(bytes);
    let common = r.string()?;
    let send = r.counts()?;
    let recv = r.counts()?;
    let invalid = match r.take(1)?.first()? {
        0 => None,
        1 => Some(r.string()?),
        _ => return None,
    };
    r.0.is_empty().then_some(Signature {
        common,
        send,
        recv,
        invalid,
    })
}

impl MpiWorld {
    /// Initialises MPI (`MPI_Init_thread`, asking for `MPI_THREAD_SERIALIZED`) and returns
    /// this process's view of the world; operations give up after `timeout` (see the
    /// [module documentation](self)). Call it once per process: MPI cannot be initialised
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

    /// Largest tag [`Op::Send`] and [`Op::Recv`] accept with this MPI library.
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

    fn lock_mpi(&self) -> MutexGuard<'_, Mpi> {
        self.shared.lock_mpi()
    }

    fn record_failure(&self, rank: usize, reason: String) {
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some((rank, reason));
        }
    }

    fn peer_failed(&self) -> Result<(), CommError> {
        match self.failure() {
            Some((rank, reason)) => Err(CommError::PeerFailed { rank, reason }),
            None => Ok(()),
        }
    }

    fn finalized(&self, op: &'static str) -> CommError {
        CommError::Backend {
            op,
            rank: self.rank,
            message: "MPI has been finalized".to_string(),
        }
    }

    fn check_code(&self, op: &'static str, call: &str, code: c_int) -> Result<(), CommError> {
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
    fn with_mpi<T>(
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
    fn wait_all(
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
    fn timed_out(&self, op: &'static str, group: &[usize], missing: Vec<usize>) -> CommError {
        let err = CommError::Timeout {
            op,
            group: group.to_vec(),
            missing,
            after: self.timeout,
        };
        self.record_failure(self.rank, err.to_string());
        err
    }

    /// The communicator of `group`, created on first use: the members first greet each
    /// other (polled, so a member that never comes is reported after the timeout), then
    /// create it with `MPI_Comm_create_group`, collective over the members only.
    fn group_comm(
        &self,
        op: &'static str,
        group: &[usize],
        index: usize,
    ) -> Result<ffi::MPI_Comm, CommError> {
        let cached = self.with_mpi(op, |mpi| Ok(mpi.groups.get(group).map(|c| c.as_raw())))?;
        if let Some(comm) = cached {
            return Ok(comm);
        }
        self.greet(op, group, index)?;
        self.with_mpi(op, |mpi| {
            let ranks: Vec<c_int> = ints(group.iter().copied());
            let universe = mpi.universe.as_ref().ok_or_else(|| self.finalized(op))?;
            let world = universe.world();
            let members = world.group().include(&ranks);
            let comm = world
                .split_by_subgroup_with_tag(&members, group_tag(group))
                .ok_or_else(|| CommError::Backend {
                    op,
                    rank: self.rank,
                    message: format!("MPI_Comm_create_group gave no communicator for {group:?}"),
                })?;
            let raw = comm.as_raw();
            mpi.groups.insert(group.to_vec(), comm);
            Ok(raw)
        })
    }

    /// Exchanges a greeting naming `group` with every other member, so that creating the
    /// group's communicator (a blocking MPI call) starts only once all members are there.
    /// Greetings between two ranks are matched in order, so two ranks that set up their
    /// shared groups in different orders (which would deadlock) are told so.
    fn greet(&self, op: &'static str, group: &[usize], index: usize) -> Result<(), CommError> {
        let peers: Vec<usize> = (0..group.len()).filter(|&j| j != index).collect();
        if peers.is_empty() {
            return Ok(());
        }
        let mut h = DefaultHasher::new();
        group.hash(&mut h);
        let mine = h.finish().to_le_bytes().to_vec();
        let mut inbox = vec![0u8; 8 * peers.len()];
        let mut requests = vec![null_request(); 2 * peers.len()];
        let started = self.with_mpi(op, |mpi| {
            let comm = mpi
                .control
                .as_ref()
                .map(|c| c.as_raw())
                .ok_or_else(|| self.finalized(op))?;
            let (recvs, sends) = requests.split_at_mut(peers.len());
            for (k, &j) in peers.iter().enumerate() {
                let peer = group[j] as c_int;
                // SAFETY: the buffers outlive the requests (they are leaked if the wait
                // gives up) and are not touched until the requests complete.
                unsafe {
                    let code = ffi::MPI_Irecv(
                        inbox[8 * k..].as_mut_ptr().cast(),
                        8,
                        bytes_type(),
                        peer,
                        TAG_HELLO,
                        comm,
                        &mut recvs[k],
                    );
                    self.check_code(op, "MPI_Irecv", code)?;
                    let code = ffi::MPI_Isend(
                        mine.as_ptr().cast(),
                        8,
                        bytes_type(),
                        peer,
                        TAG_HELLO,
                        comm,
                        &mut sends[k],
                    );
                    self.check_code(op, "MPI_Isend", code)?;
                }
            }
            Ok(())
        });
        match started.and_then(|()| self.wait_all(op, &mut requests)) {
            Ok(Waited::Done) => {}
            Ok(Waited::Late(pending)) => {
                let missing = pending
                    .iter()
                    .map(|&i| group[peers[i % peers.len()]])
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect();
                std::mem::forget((inbox, mine));
                return Err(self.timed_out(op, group, missing));
            }
            Err(e) => {
                std::mem::forget((inbox, mine));
                return Err(e);
            }
        }
        let others: Vec<usize> = peers
            .iter()
            .enumerate()
            .filter(|&(k, _)| inbox[8 * k..8 * k + 8] != mine[..])
            .map(|(_, &j)| group[j])
            .collect();
        if others.is_empty() {
            return Ok(());
        }
        let err = CommError::Backend {
            op,
            rank: self.rank,
            message: format!(
                "{} set up another group first while this rank sets up {group:?}: ranks must \
                 start using the groups they share in the same order",
                crate::error::rank_words(&others)
            ),
        };
        self.record_failure(self.rank, err.to_string());
        Err(err)
    }

    /// Sends this member's signature to every other member of `group` and returns every
    /// member's, in group order.
    fn exchange_signatures(
        &self,
        op: &'static str,
        group: &[usize],
        index: usize,
        comm: ffi::MPI_Comm,
        sig: &Signature,
    ) -> Result<Vec<Signature>, CommError> {
        let n = group.len();
        let peers: Vec<usize> = (0..n).filter(|&j| j != index).collect();
        if peers.is_empty() {
            return Ok(vec![sig.clone()]);
        }
        let encoded = encode_signature(sig);
        let mut slot = vec![0u8; SLOT];
        slot[..8].copy_from_slice(&(encoded.len() as u64).to_le_bytes());
        let long = encoded.len() > INLINE;
        if !long {
            slot[8..8 + encoded.len()].copy_from_slice(&encoded);
        }
        let mut inbox = vec![0u8; SLOT * n];
        let mut requests = vec![null_request(); 2 * peers.len()];
        let mut sends = vec![null_request(); if long { peers.len() } else { 0 }];
        let started = self.with_mpi(op, |_| {
            let (recvs, rest) = requests.split_at_mut(peers.len());
            for (k, &j) in peers.iter().enumerate() {
                let peer = j as c_int;
                // SAFETY: the buffers outlive the requests (they are leaked if a wait gives
                // up) and are not touched until the requests complete.
                unsafe {
                    let code = ffi::MPI_Irecv(
                        inbox[j * SLOT..].as_mut_ptr().cast(),
                        SLOT as c_int,
                        bytes_type(),
                        peer,
                        TAG_HEADER,
                        comm,
                        &mut recvs[k],
                    );
                    self.check_code(op, "MPI_Irecv", code)?;
                    let code = ffi::MPI_Isend(
                        slot.as_ptr().cast(),
                        SLOT as c_int,
                        bytes_type(),
                        peer,
                        TAG_HEADER,
                        comm,
                        &mut rest[k],
                    );
                    self.check_code(op, "MPI_Isend", code)?;
                    if long {
                        let code = ffi::MPI_Isend(
                            encoded.as_ptr().cast(),
                            c_int::try_from(encoded.len()).unwrap_or(c_int::MAX),
                            bytes_type(),
                            peer,
                            TAG_HEADER_LONG,
                            comm,
                            &mut sends[k],
                        );
                        self.check_code(op, "MPI_Isend", code)?;
                    }
                }
            }
            Ok(())
        });
        let waited = started.and_then(|()| self.wait_all(op, &mut requests));
        match waited {
            Ok(Waited::Done) => {}
            Ok(Waited::Late(pending)) => {
                let mut missing: Vec<usize> = pending
                    .iter()
                    .filter(|&&i| i < peers.len())
                    .map(|&i| group[peers[i]])
                    .collect();
                if missing.is_empty() {
                    missing = pending
                        .iter()
                        .map(|&i| group[peers[i - peers.len()]])
                        .collect();
                }
                std::mem::forget((slot, inbox, encoded, sends));
                return Err(self.timed_out(op, group, missing));
            }
            Err(e) => {
                std::mem::forget((slot, inbox, encoded, sends));
                return Err(e);
            }
        }
        // Headers of the members whose signature did not fit: fetch the long form.
        let mut bodies: Vec<Vec<u8>> = vec![Vec::new(); n];
        let mut long_requests = vec![null_request(); n];
        let mut bad = None;
        for &j in &peers {
            let header = &inbox[j * SLOT..(j + 1) * SLOT];
            let len = u64::from_le_bytes(header[..8].try_into().unwrap_or([0; 8]));
            let len = usize::try_from(len).unwrap_or(usize::MAX);
            if len <= INLINE {
                bodies[j] = header[8..8 + len].to_vec();
            } else if len <= MAX_SIGNATURE {
                bodies[j] = vec![0u8; len];
            } else {
                bad = Some(group[j]);
            }
        }
        let fetched = self.with_mpi(op, |_| {
            for &j in &peers {
                if bodies[j].len() > INLINE {
                    // SAFETY: as above; `bodies[j]` is not resized while the request lives.
                    let code = unsafe {
                        ffi::MPI_Irecv(
                            bodies[j].as_mut_ptr().cast(),
                            bodies[j].len() as c_int,
                            bytes_type(),
                            j as c_int,
                            TAG_HEADER_LONG,
                            comm,
                            &mut long_requests[j],
                        )
                    };
                    self.check_code(op, "MPI_Irecv", code)?;
                }
            }
            Ok(())
        });
        let mut all = long_requests;
        all.append(&mut sends);
        let waited = fetched.and_then(|()| self.wait_all(op, &mut all));
        match waited {
            Ok(Waited::Done) => {}
            Ok(Waited::Late(pending)) => {
                let missing = pending
                    .iter()
                    .map(|&i| if i < n { group[i] } else { group[peers[i - n]] })
                    .collect();
                std::mem::forget((bodies, encoded, all));
                return Err(self.timed_out(op, group, missing));
            }
            Err(e) => {
                std::mem::forget((bodies, encoded, all));
                return Err(e);
            }
        }
        if let Some(rank) = bad {
            return Err(CommError::Backend {
                op,
                rank: self.rank,
                message: format!("rank {rank} sent an oversized header"),
            });
        }
        (0..n)
            .map(|j| {
                if j == index {
                    return Ok(sig.clone());
                }
                decode_signature(&bodies[j]).ok_or_else(|| CommError::Backend {
                    op,
                    rank: self.rank,
                    message: format!("rank {} sent a header that cannot be read", group[j]),
                })
            })
            .collect()
    }

    /// Starts one non-blocking collective with `start` (under the lock) and waits for it.
    /// On an error the caller must leak the buffers the collective uses.
    fn run_collective(
        &self,
        op: &'static str,
        group: &[usize],
        call: &str,
        start: impl FnOnce(&mut ffi::MPI_Request) -> c_int,
    ) -> Result<(), CommError> {
        let mut request = [null_request()];
        self.with_mpi(op, |_| {
            let code = start(&mut request[0]);
            self.check_code(op, call, code)
        })?;
        match self.wait_all(op, &mut request)? {
            Waited::Done => Ok(()),
            Waited::Late(_) => {
                let others = group.iter().copied().filter(|&r| r != self.rank).collect();
                Err(self.timed_out(op, group, others))
            }
        }
    }

    /// `MPI_Ialltoallv` of raw elements of `dtype` from `input` into `output`.
    #[allow(clippy::too_many_arguments)]
    fn alltoallv(
        &self,
        op: &'static str,
        group: &[usize],
        comm: ffi::MPI_Comm,
        dtype: DType,
        input: *const c_void,
        send: (&[usize], &[usize]),
        output: *mut c_void,
        recv: (&[usize], &[usize]),
    ) -> Result<(), CommError> {
        let (sc, sd) = (ints(send.0.iter().copied()), ints(send.1.iter().copied()));
        let (rc, rd) = (ints(recv.0.iter().copied()), ints(recv.1.iter().copied()));
        let ty = raw_type(dtype);
        let result = self.run_collective(op, group, "MPI_Ialltoallv", |req| {
            // SAFETY: the counts and displacements describe ranges inside `input` and
            // `output` (sizes were checked and agreed on by every member); the buffers
            // outlive the request or are leaked by the caller.
            unsafe {
                ffi::MPI_Ialltoallv(
                    input,
                    sc.as_ptr(),
                    sd.as_ptr(),
                    ty,
                    output,
                    rc.as_ptr(),
                    rd.as_ptr(),
                    ty,
                    comm,
                    req,
                )
            }
        });
        if result.is_err() {
            std::mem::forget((sc, sd, rc, rd));
        }
        result
    }

    /// `MPI_Iallgatherv` of `count` elements of type `ty` into `output` at `displs`.
    #[allow(clippy::too_many_arguments)]
    fn allgatherv(
        &self,
        op: &'static str,
        group: &[usize],
        comm: ffi::MPI_Comm,
        ty: ffi::MPI_Datatype,
        input: *const c_void,
        count: usize,
        output: *mut c_void,
        recv: (&[usize], &[usize]),
    ) -> Result<(), CommError> {
        let (rc, rd) = (ints(recv.0.iter().copied()), ints(recv.1.iter().copied()));
        let count = ints([count])[0];
        let result = self.run_collective(op, group, "MPI_Iallgatherv", |req| {
            // SAFETY: as in `alltoallv`.
            unsafe {
                ffi::MPI_Iallgatherv(
                    input,
                    count,
                    ty,
                    output,
                    rc.as_ptr(),
                    rd.as_ptr(),
                    ty,
                    comm,
                    req,
                )
            }
        });
        if result.is_err() {
            std::mem::forget((rc, rd));
        }
        result
    }

    /// Sizes MPI cannot express (element counts beyond `int`) and tags beyond the limit.
    fn check_limits(&self, op: &Op) -> Result<(), CommError> {
        let too_big = |what: &str, n: usize| {
            (n > c_int::MAX as usize).then(|| CommError::InvalidArgument {
                op: op.name(),
                message: format!(
                    "{what} has {n} elements; MPI counts are limited to {} (use smaller buckets)",
                    c_int::MAX
                ),
            })
        };
        let n = op.group().map_or(1, <[usize]>::len);
        let problem = match op {
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } => {
                too_big("the buffer", buf.len())
            }
            Op::ReduceScatter { input, counts, .. } => {
                too_big("the input", input.len()).or_else(|| {
                    let most = counts.iter().copied().max().unwrap_or(0);
                    too_big("the received chunks", most.saturating_mul(n))
                })
            }
            Op::AllGather { counts, .. } => too_big(
                "the output",
                counts.iter().fold(0usize, |a, &c| a.saturating_add(c)),
            ),
            Op::AllToAll {
                input, recv_counts, ..
            } => too_big("the input", input.len()).or_else(|| {
                too_big(
                    "the output",
                    recv_counts.iter().fold(0usize, |a, &c| a.saturating_add(c)),
                )
            }),
            Op::Send { tag, buf, .. } => {
                too_big("the message", buf.len()).or_else(|| self.tag_problem(op.name(), *tag))
            }
            Op::Recv { tag, len, .. } => {
                too_big("the message", *len).or_else(|| self.tag_problem(op.name(), *tag))
            }
            Op::Barrier { .. } => None,
        };
        problem.map_or(Ok(()), Err)
    }

    fn tag_problem(&self, op: &'static str, tag: u64) -> Option<CommError> {
        (tag > self.max_tag).then(|| CommError::InvalidArgument {
            op,
            message: format!(
                "tag {tag} is beyond what this MPI library supports (at most {})",
                self.max_tag
            ),
        })
    }

    /// The MPI tag of a message with user tag `tag` and elements of `dtype`.
    fn mpi_tag(tag: u64, dtype: DType) -> c_int {
        let bit = u64::from(dtype == DType::Bf16);
        c_int::try_from(tag * 2 + bit).unwrap_or(c_int::MAX)
    }

    fn collective(
        &self,
        index: usize,
        op: Op,
        args: Result<(), CommError>,
        ledger: &Ledger,
    ) -> Result<OpOutput, CommError> {
        let name = op.name();
        let group = op.group().unwrap_or_default().to_vec();
        let n = group.len();
        let sig = op.signature(args.as_ref().err().map(ToString::to_string));
        let comm = self.group_comm(name, &group, index)?;
        let sigs = self.exchange_signatures(name, &group, index, comm, &sig)?;
        args?;
        let refs: Vec<&Signature> = sigs.iter().collect();
        check_agreement(name, &group, &refs)?;
        let out = match op {
            Op::AllReduce {
                buf, op: reduce, ..
            } => {
                let dtype = buf.dtype();
                let len = buf.len();
                let ranges: Vec<(usize, usize)> = (0..n).map(|j| even_range(len, n, j)).collect();
                let (start, end) = ranges[index];
                let m = end - start;
                let counts: Vec<usize> = ranges.iter().map(|&(s, e)| e - s).collect();
                let starts: Vec<usize> = ranges.iter().map(|&(s, _)| s).collect();
                let mut chunks = CommBuf::zeros(ledger, dtype, n * m);
                let same = vec![m; n];
                let at: Vec<usize> = (0..n).map(|j| j * m).collect();
                let moved = self.alltoallv(
                    name,
                    &group,
                    comm,
                    dtype,
                    buf_ptr(&buf),
                    (&counts, &starts),
                    buf_mut_ptr(&mut chunks),
                    (&same, &at),
                );
                if let Err(e) = moved {
                    std::mem::forget((buf, chunks));
                    return Err(e);
                }
                drop(buf);
                let mut share = sum_chunks(&chunks, n, m);
                drop(chunks);
                if reduce == ReduceOp::Mean {
                    let k = n as f32;
                    share.iter_mut().for_each(|x| *x /= k);
                }
                let share = ledger.from_vec(Category::Communication, share);
                let mut sums = vec![0.0f32; len];
                let gathered = self.allgatherv(
                    name,
                    &group,
                    comm,
                    f32_bits_type(),
                    share.as_ptr().cast(),
                    m,
                    sums.as_mut_ptr().cast(),
                    (&counts, &starts),
                );
                if let Err(e) = gathered {
                    std::mem::forget((share, sums));
                    return Err(e);
                }
                drop(share);
                Builder { ledger, dtype }.rounded(sums)
            }
            Op::ReduceScatter { input, counts, .. } => {
                let dtype = input.dtype();
                let m = counts[index];
                let starts = prefix(&counts);
                let mut chunks = CommBuf::zeros(ledger, dtype, n * m);
                let same = vec![m; n];
                let at: Vec<usize> = (0..n).map(|j| j * m).collect();
                let moved = self.alltoallv(
                    name,
                    &group,
                    comm,
                    dtype,
                    buf_ptr(&input),
                    (&counts, &starts),
                    buf_mut_ptr(&mut chunks),
                    (&same, &at),
                );
                if let Err(e) = moved {
                    std::mem::forget((input, chunks));
                    return Err(e);
                }
                drop(input);
                let sum = sum_chunks(&chunks, n, m);
                drop(chunks);
                Builder { ledger, dtype }.rounded(sum)
            }
            Op::AllGather { input, counts, .. } => {
                let dtype = input.dtype();
                let total = counts.iter().sum();
                let mut out = CommBuf::zeros(ledger, dtype, total);
                let gathered = self.allgatherv(
                    name,
                    &group,
                    comm,
                    raw_type(dtype),
                    buf_ptr(&input),
                    input.len(),
                    buf_mut_ptr(&mut out),
                    (&counts, &prefix(&counts)),
                );
                if let Err(e) = gathered {
                    std::mem::forget((input, out));
                    return Err(e);
                }
                out
            }
            Op::Broadcast { buf, root, .. } => {
                let dtype = buf.dtype();
                let len = buf.len();
                let mut out = if root == index {
                    Builder { ledger, dtype }.concat(&[(&buf, 0, len)])
                } else {
                    CommBuf::zeros(ledger, dtype, len)
                };
                drop(buf);
                let ptr = buf_mut_ptr(&mut out);
                let count = ints([len])[0];
                let moved = self.run_collective(name, &group, "MPI_Ibcast", |req| {
                    // SAFETY: `out` holds `len` elements on every member (agreed on) and
                    // outlives the request or is leaked.
                    unsafe {
                        ffi::MPI_Ibcast(ptr, count, raw_type(dtype), root as c_int, comm, req)
                    }
                });
                if let Err(e) = moved {
                    std::mem::forget(out);
                    return Err(e);
                }
                out
            }
            Op::AllToAll {
                input,
                send_counts,
                recv_counts,
                ..
            } => {
                let dtype = input.dtype();
                let total = recv_counts.iter().sum();
                let mut out = CommBuf::zeros(ledger, dtype, total);
                let moved = self.alltoallv(
                    name,
                    &group,
                    comm,
                    dtype,
                    buf_ptr(&input),
                    (&send_counts, &prefix(&send_counts)),
                    buf_mut_ptr(&mut out),
                    (&recv_counts, &prefix(&recv_counts)),
                );
                if let Err(e) = moved {
                    std::mem::forget((input, out));
                    return Err(e);
                }
                out
            }
            Op::Barrier { .. } => {
                self.run_collective(name, &group, "MPI_Ibarrier", |req| {
                    // SAFETY: a barrier reads and writes no buffer.
                    unsafe { ffi::MPI_Ibarrier(comm, req) }
                })?;
                return Ok(OpOutput::Done);
            }
            Op::Send { .. } | Op::Recv { .. } => return Ok(OpOutput::Done),
        };
        Ok(OpOutput::Buf(out))
    }

    fn send(&self, dst: usize, tag: u64, buf: CommBuf) -> Result<OpOutput, CommError> {
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

    fn recv(
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
        let other = match dtype {
            DType::F32 => DType::Bf16,
            DType::Bf16 => DType::F32,
        };
        let deadline = Instant::now().checked_add(self.timeout);
        let mut backoff = Backoff(0);
        // Match the oldest message from `src` with `tag`, of either dtype.
        let (sent_dtype, mut message, count) = loop {
            let found = self.with_mpi("recv", |mpi| {
                let comm = mpi
                    .p2p
                    .as_ref()
                    .map(|c| c.as_raw())
                    .ok_or_else(|| self.finalized("recv"))?;
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
            })?;
            if let Some(found) = found {
                break found;
            }
            self.peer_failed()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self.timed_out("recv", &pair, vec![src]));
            }
            backoff.snooze();
        };
        // Receive the matched message (also when it does not fit, to take it off the queue).
        let mut out = CommBuf::zeros(ledger, sent_dtype, count);
        let ptr = buf_mut_ptr(&mut out);
        let mut request = [null_request()];
        let started = self.with_mpi("recv", |_| {
            // SAFETY: `out` holds `count` elements of the message's type and outlives the
            // request or is leaked; `message` came from MPI_Improbe.
            let code = unsafe {
                ffi::MPI_Imrecv(
                    ptr,
                    ints([count])[0],
                    raw_type(sent_dtype),
                    &mut message,
                    &mut request[0],
                )
            };
            self.check_code("recv", "MPI_Imrecv", code)
        });
        match started.and_then(|()| self.wait_all("recv", &mut request)) {
            Ok(Waited::Done) => {}
            Ok(Waited::Late(_)) => {
                std::mem::forget(out);
                return Err(self.timed_out("recv", &pair, vec![src]));
            }
            Err(e) => {
                std::mem::forget(out);
                return Err(e);
            }
        }
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
}

impl Shared {
    fn lock_mpi(&self) -> MutexGuard<'_, Mpi> {
        // Nothing panics while holding the lock; if something did, the handles are valid.
        self.mpi.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Tests pending sends and drops the completed ones (with their buffers).
fn reap_sends(mpi: &mut Mpi) {
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
fn progress_sends(shared: &Shared) {
    while !shared.stop.load(Ordering::SeqCst) {
        thread::sleep(PROGRESS_PAUSE);
        let mut mpi = shared.lock_mpi();
        if !mpi.sends.is_empty() {
            reap_sends(&mut mpi);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_round_trip() {
        let sig = Signature {
            common: "all_to_all(bf16) ×".to_string(),
            send: vec![1, 2, 3],
            recv: vec![0, usize::MAX],
            invalid: Some("counts wrong".to_string()),
        };
        assert_eq!(decode_signature(&encode_signature(&sig)), Some(sig.clone()));
        let plain = Signature::plain("barrier");
        assert_eq!(decode_signature(&encode_signature(&plain)), Some(plain));
        let bytes = encode_signature(&sig);
        for cut in 0..bytes.len() {
            assert_eq!(decode_signature(&bytes[..cut]), None);
        }
        assert_eq!(decode_signature(&[0xff; 40]), None);
    }

    #[test]
    fn prefixes_and_tags() {
        assert_eq!(prefix(&[2, 0, 3]), vec![0, 2, 2]);
        assert!(prefix(&[]).is_empty());
        assert_eq!(MpiWorld::mpi_tag(5, DType::F32), 10);
        assert_eq!(MpiWorld::mpi_tag(5, DType::Bf16), 11);
        let t = group_tag(&[0, 1, 2]);
        assert!((100..32_100).contains(&t));
    }

    #[test]
    fn chunk_sums_match_group_order() {
        let ledger = Ledger::new();
        let chunks = CommBuf::from_f32_slice(&ledger, &[1e8, 2.0, 1.0, 3.0, -1e8, 4.0]);
        assert_eq!(sum_chunks(&chunks, 3, 2), vec![0.0, 9.0]);
    }
}
