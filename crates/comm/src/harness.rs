//! Running one closure per rank on threads: the default launcher and the test harness.

use std::error::Error;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use ferrotron_tensor::Ledger;

use crate::comm::{panic_message, Comm, Transport};
use crate::error::{CommError, RankFailure};
use crate::threads::ThreadWorld;

/// What a rank's closure receives: its rank and the world, from which it creates its
/// communicator with its own ledger ([`RankContext::comm`]).
#[derive(Debug, Clone)]
pub struct RankContext {
    rank: usize,
    world: Arc<ThreadWorld>,
}

impl RankContext {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world.world_size()
    }

    /// The shared world.
    pub fn world(&self) -> &Arc<ThreadWorld> {
        &self.world
    }

    /// This rank's communicator, allocating outputs on `ledger` (call once per rank).
    pub fn comm(&self, ledger: Ledger) -> Result<Comm, CommError> {
        self.world.comm(self.rank, ledger)
    }

    /// This rank's communicator with a ledger of its own for its outputs: for callers
    /// that measure or test collectives outside a trainer (call once per rank).
    pub fn own_comm(&self) -> Result<Comm, CommError> {
        self.comm(Ledger::new())
    }
}

/// Runs `f` on `world_size` threads, one per rank, in a fresh [`ThreadWorld`] whose
/// operations time out after `timeout`. See [`run_ranks_in`].
///
/// A world of zero ranks runs nothing and returns an empty vector.
pub fn run_ranks<T, E, F>(world_size: usize, timeout: Duration, f: F) -> Result<Vec<T>, RankFailure>
where
    T: Send,
    E: Into<Box<dyn Error + Send + Sync>>,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    if world_size == 0 {
        return Ok(Vec::new());
    }
    let world = ThreadWorld::new(world_size, timeout).map_err(|e| RankFailure {
        rank: 0,
        message: e.to_string(),
    })?;
    run_ranks_in(&world, f)
}

/// Runs `f` once per rank of `world`, each on its own thread, and returns the results in
/// rank order when every rank succeeds.
///
/// A rank fails when `f` returns an error or panics (the panic is caught; its message is
/// reported as `panicked: …`). The first failure marks the world failed, so every other
/// rank's pending and later operations return [`CommError::PeerFailed`] promptly instead of
/// waiting for the timeout; this returns that first failure once every thread has ended.
/// A timeout inside an operation also marks the world failed, by the rank that timed out.
pub fn run_ranks_in<T, E, F>(world: &Arc<ThreadWorld>, f: F) -> Result<Vec<T>, RankFailure>
where
    T: Send,
    E: Into<Box<dyn Error + Send + Sync>>,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    let n = world.world_size();
    let f = &f;
    let results: Vec<Option<T>> = thread::scope(|s| {
        let mut handles = Vec::with_capacity(n);
        for rank in 0..n {
            let ctx = RankContext {
                rank,
                world: Arc::clone(world),
            };
            let spawned = thread::Builder::new()
                .name(format!("rank-{rank}"))
                .spawn_scoped(s, move || run_one(ctx, f));
            match spawned {
                Ok(h) => handles.push(Some(h)),
                Err(e) => {
                    world.fail(rank, &format!("cannot start the rank's thread: {e}"));
                    handles.push(None);
                }
            }
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h.map(|h| h.join()) {
                Some(Ok(out)) => out,
                Some(Err(payload)) => {
                    let reason = format!("panicked: {}", panic_message(payload.as_ref()));
                    world.fail(rank, &reason);
                    None
                }
                None => None,
            })
            .collect()
    });
    if let Some((rank, message)) = world.failure() {
        return Err(RankFailure { rank, message });
    }
    // Without a recorded failure every rank returned a value.
    let mut out = Vec::with_capacity(n);
    for (rank, r) in results.into_iter().enumerate() {
        out.push(r.ok_or_else(|| RankFailure {
            rank,
            message: "returned no result".to_string(),
        })?);
    }
    Ok(out)
}

/// Runs one rank's closure, recording its failure in the world.
fn run_one<T, E, F>(ctx: RankContext, f: &F) -> Option<T>
where
    E: Into<Box<dyn Error + Send + Sync>>,
    F: Fn(RankContext) -> Result<T, E>,
{
    let rank = ctx.rank;
    let world = Arc::clone(&ctx.world);
    let reason = match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
        Ok(Ok(value)) => return Some(value),
        Ok(Err(e)) => e.into().to_string(),
        Err(payload) => format!("panicked: {}", panic_message(payload.as_ref())),
    };
    world.fail(rank, &reason);
    None
}
