//! The threads backend: ranks are OS threads of one process and collectives meet in shared
//! memory.
//!
//! Every collective is built on one rendezvous, [`ThreadWorld::exchange`]: each member
//! deposits an `Arc` of its contribution in the round of its group (rounds are keyed by the
//! group's member list and a per-member sequence number, the generation, so a fast member
//! can already deposit the next round while a slow one still reads this one); once all have
//! arrived each member takes every contribution and computes its own output; the round is
//! removed when the last member has taken it. All-reduce uses two rounds (reduce an even
//! share, then gather the shares) so that each element is summed once, by one member, and
//! every member ends with the same bits.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferrotron_tensor::Ledger;

use crate::buf::{Builder, CommBuf};
use crate::collective;
use crate::comm::{Comm, Transport};
use crate::error::CommError;
use crate::op::{check_agreement, Op, OpOutput, ReduceOp, Signature};

/// Longest wait between two looks at the failure flag (a failure also wakes waiters at once).
const POLL: Duration = Duration::from_millis(20);

/// How long a waiting rank yields its core in a loop, watching for news, before it sleeps,
/// when the ranks do not outnumber the cores: peers usually arrive within it, and a thread
/// asleep on an idle core is slow to wake (on a virtual machine, hundreds of microseconds).
/// On 2 vCPUs, tiny tp2+SP with 1 thread per rank, two A/B sessions of 3 alternating runs:
/// medians 76.6 → 64.1 and 73.7 → 72.6 ms per step (pooled 75.1 → 70.4); dp2, small tp2+SP
/// and pp2 unchanged within the noise.
const SPIN: Duration = Duration::from_micros(200);

/// A world of ranks living as threads in this process.
pub struct ThreadWorld {
    size: usize,
    timeout: Duration,
    state: Mutex<World>,
    wake: Condvar,
    /// [`SPIN`], or zero when the ranks outnumber the cores (a spinning rank would take
    /// turns from the one it waits for).
    spin: Duration,
    /// Counts the wake-ups sent (each under the lock, before `wake.notify_all`): spinning
    /// waiters watch it without the lock.
    posted: AtomicU64,
}

#[derive(Default)]
struct World {
    failure: Option<(usize, String)>,
    has_comm: Vec<bool>,
    groups: HashMap<Vec<usize>, Rounds>,
    /// Messages in flight, by (source, destination, tag), oldest first.
    mail: HashMap<(usize, usize, u64), VecDeque<CommBuf>>,
}

struct Rounds {
    /// Sequence number of each member's next round.
    next: Vec<u64>,
    open: HashMap<u64, Round>,
}

struct Round {
    pieces: Vec<Option<Arc<Piece>>>,
    taken: usize,
}

/// One member's contribution to a round.
struct Piece {
    sig: Signature,
    data: Option<CommBuf>,
}

impl std::fmt::Debug for ThreadWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ThreadWorld({} ranks, timeout {:?})",
            self.size, self.timeout
        )
    }
}

impl ThreadWorld {
    /// A world of `world_size` ranks whose operations give up after `timeout`.
    pub fn new(world_size: usize, timeout: Duration) -> Result<Arc<ThreadWorld>, CommError> {
        if world_size == 0 {
            return Err(CommError::InvalidArgument {
                op: "world",
                message: "the world needs at least one rank".to_string(),
            });
        }
        let state = World {
            has_comm: vec![false; world_size],
            ..World::default()
        };
        Ok(Arc::new(ThreadWorld {
            size: world_size,
            timeout,
            state: Mutex::new(state),
            wake: Condvar::new(),
            spin: match std::thread::available_parallelism() {
                Ok(cores) if world_size <= cores.get() => SPIN,
                _ => Duration::ZERO,
            },
            posted: AtomicU64::new(0),
        }))
    }

    /// The communicator of `rank`, allocating its outputs on `ledger`. Each rank gets one.
    pub fn comm(self: &Arc<Self>, rank: usize, ledger: Ledger) -> Result<Comm, CommError> {
        {
            let mut st = self.lock();
            match st.has_comm.get_mut(rank) {
                None => {
                    return Err(CommError::InvalidArgument {
                        op: "comm",
                        message: format!(
                            "rank {rank} is out of range: the world has {} ranks",
                            self.size
                        ),
                    })
                }
                Some(true) => {
                    return Err(CommError::InvalidArgument {
                        op: "comm",
                        message: format!("rank {rank} already has a communicator"),
                    })
                }
                Some(taken) => *taken = true,
            }
        }
        Comm::new(Arc::clone(self) as Arc<dyn Transport>, rank, ledger)
    }

    fn lock(&self) -> MutexGuard<'_, World> {
        // Nothing panics while holding the lock; if something did, the data is still valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every waiter (called with the lock held).
    fn notify(&self) {
        self.posted.fetch_add(1, Ordering::Release);
        self.wake.notify_all();
    }

    /// Waits until woken, the next poll or `deadline` (`None`: a timeout too long to
    /// represent, i.e. never): first yielding the core for up to `spin` while watching for
    /// a wake-up, then asleep.
    fn wait<'a>(
        &'a self,
        st: MutexGuard<'a, World>,
        deadline: Option<Instant>,
    ) -> MutexGuard<'a, World> {
        let seen = self.posted.load(Ordering::Acquire);
        drop(st);
        let start = Instant::now();
        while start.elapsed() < self.spin {
            std::thread::yield_now();
            if self.posted.load(Ordering::Acquire) != seen {
                return self.lock();
            }
        }
        let st = self.lock();
        // Wake-ups are sent under the lock, so none can fall between this look and the sleep.
        if self.posted.load(Ordering::Acquire) != seen {
            return st;
        }
        let left = deadline.map_or(POLL, |d| d.saturating_duration_since(Instant::now()));
        match self.wake.wait_timeout(st, left.min(POLL)) {
            Ok((st, _)) => st,
            Err(e) => e.into_inner().0,
        }
    }

    fn set_failed(&self, st: &mut World, rank: usize, reason: String) {
        if st.failure.is_none() {
            st.failure = Some((rank, reason));
        }
        self.notify();
    }

    fn peer_failed(st: &World) -> Result<(), CommError> {
        match &st.failure {
            Some((rank, reason)) => Err(CommError::PeerFailed {
                rank: *rank,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Deposits `piece` as member `index` of `group` and returns every member's piece, in
    /// group order, once all have arrived.
    fn exchange(
        &self,
        rank: usize,
        group: &[usize],
        index: usize,
        op: &'static str,
        piece: Piece,
    ) -> Result<Vec<Arc<Piece>>, CommError> {
        let n = group.len();
        let mut st = self.lock();
        Self::peer_failed(&st)?;
        let rounds = st.groups.entry(group.to_vec()).or_insert_with(|| Rounds {
            next: vec![0; n],
            open: HashMap::new(),
        });
        let seq = rounds.next[index];
        rounds.next[index] += 1;
        let round = rounds.open.entry(seq).or_insert_with(|| Round {
            pieces: vec![None; n],
            taken: 0,
        });
        round.pieces[index] = Some(Arc::new(piece));
        self.notify();
        let deadline = Instant::now().checked_add(self.timeout);
        loop {
            Self::peer_failed(&st)?;
            let mut missing = Vec::new();
            if let Some(rounds) = st.groups.get_mut(group) {
                if let Some(round) = rounds.open.get_mut(&seq) {
                    missing = (0..n)
                        .filter(|&i| round.pieces[i].is_none())
                        .map(|i| group[i])
                        .collect();
                    if missing.is_empty() {
                        let pieces: Vec<Arc<Piece>> =
                            round.pieces.iter().flatten().cloned().collect();
                        round.taken += 1;
                        if round.taken == n {
                            rounds.open.remove(&seq);
                        }
                        return Ok(pieces);
                    }
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let err = CommError::Timeout {
                    op,
                    group: group.to_vec(),
                    missing,
                    after: self.timeout,
                };
                self.set_failed(&mut st, rank, err.to_string());
                return Err(err);
            }
            st = self.wait(st, deadline);
        }
    }

    fn send(&self, rank: usize, dst: usize, tag: u64, buf: CommBuf) -> Result<OpOutput, CommError> {
        let mut st = self.lock();
        Self::peer_failed(&st)?;
        st.mail.entry((rank, dst, tag)).or_default().push_back(buf);
        self.notify();
        Ok(OpOutput::Done)
    }

    fn recv(&self, rank: usize, ledger: &Ledger, op: &Op) -> Result<OpOutput, CommError> {
        let &Op::Recv {
            src,
            tag,
            len,
            dtype,
        } = op
        else {
            return Ok(OpOutput::Done);
        };
        let mut pair = vec![src, rank];
        pair.sort_unstable();
        pair.dedup();
        let deadline = Instant::now().checked_add(self.timeout);
        let mut st = self.lock();
        loop {
            Self::peer_failed(&st)?;
            if let Some(msg) = st
                .mail
                .get_mut(&(src, rank, tag))
                .and_then(VecDeque::pop_front)
            {
                drop(st);
                if msg.len() != len || msg.dtype() != dtype {
                    return Err(CommError::Mismatch {
                        op: "recv",
                        group: pair,
                        ranks: vec![src],
                        detail: format!(
                            "rank {src} sent {} × {} with tag {tag}; rank {rank} expects {len} × {dtype}",
                            msg.len(),
                            msg.dtype()
                        ),
                    });
                }
                let out = Builder { ledger, dtype }.concat(&[(&msg, 0, len)]);
                return Ok(OpOutput::Buf(out));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let err = CommError::Timeout {
                    op: "recv",
                    group: pair,
                    missing: vec![src],
                    after: self.timeout,
                };
                self.set_failed(&mut st, rank, err.to_string());
                return Err(err);
            }
            st = self.wait(st, deadline);
        }
    }

    fn collective(
        &self,
        rank: usize,
        index: usize,
        op: Op,
        args: Result<(), CommError>,
        ledger: &Ledger,
    ) -> Result<OpOutput, CommError> {
        let name = op.name();
        let group = op.group().unwrap_or_default().to_vec();
        let sig = op.signature(args.as_ref().err().map(ToString::to_string));
        let (data, then) = match op {
            Op::AllReduce { buf, op, .. } => (Some(buf), Then::AllReduce(op)),
            Op::ReduceScatter { input, counts, .. } => (Some(input), Then::ReduceScatter(counts)),
            Op::AllGather { input, .. } => (Some(input), Then::AllGather),
            Op::Broadcast { buf, root, .. } => (Some(buf), Then::Broadcast(root)),
            Op::AllToAll { input, .. } => (Some(input), Then::AllToAll),
            _ => (None, Then::Nothing),
        };
        let dtype = data.as_ref().map(CommBuf::dtype);
        let pieces = self.exchange(rank, &group, index, name, Piece { sig, data })?;
        args?;
        let sigs: Vec<&Signature> = pieces.iter().map(|p| &p.sig).collect();
        check_agreement(name, &group, &sigs)?;
        let inputs: Vec<&CommBuf> = pieces.iter().filter_map(|p| p.data.as_ref()).collect();
        let Some(dtype) = dtype else {
            return Ok(OpOutput::Done);
        };
        if inputs.len() != group.len() {
            return Err(CommError::Backend {
                op: name,
                rank,
                message: "a member's contribution carries no data".to_string(),
            });
        }
        let out = match then {
            Then::AllReduce(reduce) => {
                let share = collective::all_reduce_share(ledger, &inputs, index, reduce);
                // Release the inputs before the second round.
                drop(inputs);
                drop(sigs);
                drop(pieces);
                let piece = Piece {
                    sig: Signature::plain("all_reduce shares"),
                    data: Some(share),
                };
                let shares = self.exchange(rank, &group, index, name, piece)?;
                let shares: Vec<&CommBuf> = shares.iter().filter_map(|p| p.data.as_ref()).collect();
                collective::all_reduce_assemble(ledger, dtype, &shares)
            }
            Then::ReduceScatter(counts) => {
                collective::reduce_scatter(ledger, dtype, &inputs, &counts, index)
            }
            Then::AllGather => collective::all_gather(ledger, dtype, &inputs),
            Then::Broadcast(root) => collective::broadcast(ledger, dtype, &inputs, root),
            Then::AllToAll => {
                let sends: Vec<&[usize]> = sigs.iter().map(|s| s.send.as_slice()).collect();
                collective::all_to_all(ledger, dtype, &inputs, &sends, index)
            }
            Then::Nothing => return Ok(OpOutput::Done),
        };
        Ok(OpOutput::Buf(out))
    }
}

/// What a collective does once it holds every member's contribution.
enum Then {
    AllReduce(ReduceOp),
    ReduceScatter(Vec<usize>),
    AllGather,
    Broadcast(usize),
    AllToAll,
    Nothing,
}

impl Transport for ThreadWorld {
    fn world_size(&self) -> usize {
        self.size
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn execute(&self, rank: usize, op: Op, ledger: &Ledger) -> Result<OpOutput, CommError> {
        Self::peer_failed(&self.lock())?;
        let index = op.check_group(rank, self.size)?;
        let args = op.check_args(index);
        match op {
            Op::Send { dst, tag, buf } => {
                args?;
                self.send(rank, dst, tag, buf)
            }
            Op::Recv { .. } => {
                args?;
                self.recv(rank, ledger, &op)
            }
            op => self.collective(rank, index, op, args, ledger),
        }
    }

    fn fail(&self, rank: usize, reason: &str) {
        let mut st = self.lock();
        self.set_failed(&mut st, rank, reason.to_string());
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.lock().failure.clone()
    }
}
