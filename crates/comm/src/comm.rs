//! The per-rank communicator: one worker thread per rank runs that rank's operations in
//! issue order on a [`Transport`]; callers get a [`Handle`] back at once.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ferrotron_tensor::trace::{Tracer, Track};
use ferrotron_tensor::Ledger;

use crate::buf::{CommBuf, DType};
use crate::error::CommError;
use crate::op::{Op, OpOutput, ReduceOp};

mod worker;

pub(crate) use worker::panic_message;
use worker::{worker, Ledgers};

/// A way of moving data between ranks: shared memory between threads
/// ([`ThreadWorld`](crate::ThreadWorld)) today, MPI or NCCL behind cargo features later.
///
/// A [`Comm`] calls [`Transport::execute`] from its single worker thread, one operation at a
/// time, in the order the rank issued them; since every rank issues its collectives in the
/// same order on each group, an implementation can match the k-th operation of a group on
/// one rank with the k-th on every other member.
///
/// Every implementation must:
/// - validate with [`Op::check_group`] and [`Op::check_args`] and, when only the arguments
///   are wrong, still tell the peers (they report [`CommError::Mismatch`] naming this rank)
///   rather than leave them waiting;
/// - compare what the members called (operation, dtype, sizes) and return
///   [`CommError::Mismatch`] on every member when they differ, never a hang or garbage;
/// - sum reductions in group-index order so that every member gets identical bits;
/// - allocate outputs on the given ledger under `Category::Communication`;
/// - give up after [`Transport::timeout`] with [`CommError::Timeout`] naming the ranks that
///   never arrived, and then mark the world failed (the members' sequences no longer line
///   up, as when NCCL aborts a communicator);
/// - while waiting, watch for [`Transport::fail`] and return [`CommError::PeerFailed`]
///   promptly, and refuse every later operation the same way.
pub trait Transport: Send + Sync {
    /// Number of ranks in the world.
    fn world_size(&self) -> usize;

    /// How long an operation waits for its peers before giving up.
    fn timeout(&self) -> Duration;

    /// Performs `op` on behalf of `rank`, allocating any output on `ledger`. Returns
    /// [`OpOutput::Buf`] for operations that produce data and [`OpOutput::Done`] for send and
    /// barrier.
    fn execute(&self, rank: usize, op: Op, ledger: &Ledger) -> Result<OpOutput, CommError>;

    /// Marks the world failed because of `rank`, with `reason`; the first call wins. Every
    /// pending and later operation of every rank returns [`CommError::PeerFailed`].
    fn fail(&self, rank: usize, reason: &str);

    /// The first failure recorded, as (rank, reason).
    fn failure(&self) -> Option<(usize, String)>;
}

type Reply = (Result<OpOutput, CommError>, Option<OpTiming>);

/// When the worker thread ran an operation: from the moment it started executing (after the
/// operations queued before it) to the moment its output was ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpTiming {
    /// Execution start on the rank's worker thread.
    pub started: Instant,
    /// Execution end.
    pub finished: Instant,
}

/// An operation queued to a rank's worker thread, with where its result goes.
struct Job {
    op: Op,
    reply: mpsc::SyncSender<Reply>,
}

/// One rank's communicator. Cheap to share by reference between this rank's threads; every
/// operation is queued to the rank's worker thread and runs in issue order.
///
/// Ranks must issue the collectives of each group in the same order (as with NCCL). A
/// [`Comm::recv`] blocks the queue until its message arrives, so a rank that receives
/// before it joins a collective its sender is waiting in deadlocks until the timeout.
///
/// Dropping the `Comm` lets the worker finish what is queued, then stop.
pub struct Comm {
    rank: usize,
    ledger: Ledger,
    transport: Arc<dyn Transport>,
    jobs: mpsc::Sender<Job>,
    tracer: Arc<Mutex<Option<Arc<Tracer>>>>,
    /// A host ledger the transport works on when the rank's device memory is not
    /// host-accessible: inputs are copied to it at submission, outputs back on completion.
    staging: Option<Ledger>,
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Comm(rank {} of {})", self.rank, self.world_size())
    }
}

/// The result of an operation, available once the rank's worker has run it.
///
/// Dropping a handle without waiting does not cancel the operation: it still runs (peers
/// may depend on it) and its output is dropped.
pub struct Handle<T> {
    op: &'static str,
    rank: usize,
    state: State,
    _out: PhantomData<fn() -> T>,
}

enum State {
    Pending(mpsc::Receiver<Reply>),
    Ready(Reply),
    Taken,
}

/// Outputs a [`Handle`] can produce.
pub trait FromOutput: Sized {
    /// Converts the transport's output, or `None` if it has the wrong shape.
    fn from_output(out: OpOutput) -> Option<Self>;
}

impl FromOutput for CommBuf {
    fn from_output(out: OpOutput) -> Option<Self> {
        match out {
            OpOutput::Buf(b) => Some(b),
            OpOutput::Done => None,
        }
    }
}

impl FromOutput for () {
    fn from_output(_: OpOutput) -> Option<Self> {
        Some(())
    }
}

impl<T: FromOutput> Handle<T> {
    /// Blocks until the operation completes (each operation gives up after the world's
    /// timeout) and returns its output.
    pub fn wait(self) -> Result<T, CommError> {
        self.wait_timed().map(|(out, _)| out)
    }

    /// Like [`Handle::wait`], recording the time this thread blocked as a span on the wait
    /// track of `tracer` (when given), named after `what` (e.g. `tensor-parallel`) and the
    /// operation, in category `what`.
    pub fn wait_in(self, tracer: Option<&Tracer>, what: &'static str) -> Result<T, CommError> {
        match tracer {
            None => self.wait(),
            Some(t) => {
                let op = self.op;
                let start = Instant::now();
                let out = self.wait();
                t.record(
                    Track::Wait,
                    format!("{what} {op}"),
                    what,
                    start,
                    Instant::now(),
                    Vec::new(),
                );
                out
            }
        }
    }

    /// Like [`Handle::wait`], also returning when the worker executed the operation (absent
    /// when it never ran, e.g. the communicator was closed).
    pub fn wait_timed(mut self) -> Result<(T, Option<OpTiming>), CommError> {
        let closed = CommError::Closed {
            op: self.op,
            rank: self.rank,
        };
        let (reply, timing) = match std::mem::replace(&mut self.state, State::Taken) {
            State::Pending(rx) => rx.recv().unwrap_or((Err(closed), None)),
            State::Ready(reply) => reply,
            State::Taken => (Err(closed), None),
        };
        let out = reply?;
        let out = T::from_output(out).ok_or_else(|| CommError::Backend {
            op: self.op,
            rank: self.rank,
            message: "the transport returned the wrong kind of output".to_string(),
        })?;
        Ok((out, timing))
    }

    /// Whether the operation has completed (successfully or not); never blocks.
    pub fn is_complete(&mut self) -> bool {
        if let State::Pending(rx) = &self.state {
            match rx.try_recv() {
                Ok(reply) => self.state = State::Ready(reply),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => return true,
            }
        }
        true
    }

    /// The operation's name.
    pub fn op(&self) -> &'static str {
        self.op
    }
}

impl<T> fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Handle({} on rank {})", self.op, self.rank)
    }
}

impl Comm {
    /// A communicator for `rank` over `transport` with a ledger of its own for its outputs:
    /// for callers that measure collectives outside a trainer.
    ///
    /// # Errors
    ///
    /// As [`Comm::new`].
    pub fn with_own_ledger(transport: Arc<dyn Transport>, rank: usize) -> Result<Comm, CommError> {
        Comm::new(transport, rank, Ledger::new())
    }

    /// Starts the worker thread of `rank` on `transport`; outputs are allocated on `ledger`.
    /// Create one `Comm` per rank: two would race for the rank's place in each group.
    pub fn new(
        transport: Arc<dyn Transport>,
        rank: usize,
        ledger: Ledger,
    ) -> Result<Comm, CommError> {
        let world = transport.world_size();
        if rank >= world {
            return Err(CommError::InvalidArgument {
                op: "comm",
                message: format!("rank {rank} is out of range: the world has {world} ranks"),
            });
        }
        let (jobs, rx) = mpsc::channel::<Job>();
        let staging = ledger
            .memory()
            .filter(|m| !m.host_accessible())
            .map(|_| Ledger::new());
        let (t, l) = (
            Arc::clone(&transport),
            Ledgers {
                rank: ledger.clone(),
                staging: staging.clone(),
            },
        );
        let tracer: Arc<Mutex<Option<Arc<Tracer>>>> = Arc::default();
        let worker_tracer = Arc::clone(&tracer);
        thread::Builder::new()
            .name(format!("comm-rank-{rank}"))
            .spawn(move || worker(rank, t, l, rx, worker_tracer))
            .map_err(|e| CommError::Backend {
                op: "comm",
                rank,
                message: format!("cannot start the worker thread: {e}"),
            })?;
        Ok(Comm {
            rank,
            ledger,
            transport,
            jobs,
            tracer,
            staging,
        })
    }

    /// The tracer set with [`Comm::set_tracer`].
    pub fn tracer(&self) -> Option<Arc<Tracer>> {
        self.tracer.lock().expect("tracer lock").clone()
    }

    /// Waits for `handle`, recording the blocked time on this rank's tracer (if set) as a wait
    /// of kind `what` (`data-parallel`, `pipeline`, …).
    pub fn wait<T: FromOutput>(
        &self,
        handle: Handle<T>,
        what: &'static str,
    ) -> Result<T, CommError> {
        handle.wait_in(self.tracer().as_deref(), what)
    }

    /// Records every operation this rank's worker executes on `tracer`'s communication track
    /// (name, group, bytes), or stops recording with `None`.
    pub fn set_tracer(&self, tracer: Option<Arc<Tracer>>) {
        *self.tracer.lock().expect("tracer lock") = tracer;
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the world.
    pub fn world_size(&self) -> usize {
        self.transport.world_size()
    }

    /// How long an operation waits for its peers.
    pub fn timeout(&self) -> Duration {
        self.transport.timeout()
    }

    /// The ledger outputs are allocated on.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Marks the world failed because of this rank; every rank's operations then return
    /// [`CommError::PeerFailed`].
    pub fn fail(&self, reason: &str) {
        self.transport.fail(self.rank, reason);
    }

    /// The first failure in the world, as (rank, reason).
    pub fn failure(&self) -> Option<(usize, String)> {
        self.transport.failure()
    }

    /// Queues any operation (the typed methods below are shorthands).
    ///
    /// The kernels that wrote the op's buffers are waited for first (a no-op on the CPU
    /// backend), so a transport may read them from the host.
    pub fn submit<T: FromOutput>(&self, mut op: Op) -> Handle<T> {
        if let Some(memory) = self.ledger.memory() {
            memory.synchronize();
        }
        if let (Some(staging), Some(buf)) = (&self.staging, op.buf_mut()) {
            let host = buf.restaged(&self.ledger, staging);
            *buf = host;
        }
        let name = op.name();
        let (reply, rx) = mpsc::sync_channel(1);
        let state = match self.jobs.send(Job { op, reply }) {
            Ok(()) => State::Pending(rx),
            Err(_) => State::Ready((
                Err(CommError::Closed {
                    op: name,
                    rank: self.rank,
                }),
                None,
            )),
        };
        Handle {
            op: name,
            rank: self.rank,
            state,
            _out: PhantomData,
        }
    }

    /// Element-wise sum or mean of `buf` over `group` (see [`Op::AllReduce`]).
    pub fn all_reduce(
        &self,
        group: impl AsRef<[usize]>,
        buf: CommBuf,
        op: ReduceOp,
    ) -> Handle<CommBuf> {
        let group = group.as_ref().to_vec();
        self.submit(Op::AllReduce { group, buf, op })
    }

    /// Member `i` gets the sum of elements `[Σcounts[..i], Σcounts[..=i])` (see
    /// [`Op::ReduceScatter`]).
    pub fn reduce_scatter(
        &self,
        group: impl AsRef<[usize]>,
        input: CommBuf,
        counts: Vec<usize>,
    ) -> Handle<CommBuf> {
        let group = group.as_ref().to_vec();
        self.submit(Op::ReduceScatter {
            group,
            input,
            counts,
        })
    }

    /// Concatenation of every member's `counts[i]` elements (see [`Op::AllGather`]).
    pub fn all_gather(
        &self,
        group: impl AsRef<[usize]>,
        input: CommBuf,
        counts: Vec<usize>,
    ) -> Handle<CommBuf> {
        let group = group.as_ref().to_vec();
        self.submit(Op::AllGather {
            group,
            input,
            counts,
        })
    }

    /// The buffer of the member at group index `root` (see [`Op::Broadcast`]).
    pub fn broadcast(
        &self,
        group: impl AsRef<[usize]>,
        buf: CommBuf,
        root: usize,
    ) -> Handle<CommBuf> {
        let group = group.as_ref().to_vec();
        self.submit(Op::Broadcast { group, buf, root })
    }

    /// Personalised exchange with uneven counts (see [`Op::AllToAll`]).
    pub fn all_to_all(
        &self,
        group: impl AsRef<[usize]>,
        input: CommBuf,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Handle<CommBuf> {
        let group = group.as_ref().to_vec();
        self.submit(Op::AllToAll {
            group,
            input,
            send_counts,
            recv_counts,
        })
    }

    /// Buffered send of `buf` to world rank `dst` (see [`Op::Send`]).
    pub fn send(&self, dst: usize, tag: u64, buf: CommBuf) -> Handle<()> {
        self.submit(Op::Send { dst, tag, buf })
    }

    /// Receives the oldest message from world rank `src` with `tag` (see [`Op::Recv`]).
    pub fn recv(&self, src: usize, tag: u64, len: usize, dtype: DType) -> Handle<CommBuf> {
        self.submit(Op::Recv {
            src,
            tag,
            len,
            dtype,
        })
    }

    /// Completes once every member of `group` has reached it.
    pub fn barrier(&self, group: impl AsRef<[usize]>) -> Handle<()> {
        let group = group.as_ref().to_vec();
        self.submit(Op::Barrier { group })
    }
}
