//! Launching the ranks of a run: as threads of this process (the default and the test
//! harness), each with its own ledger, thread pool and communicator.

/// Attention work per context-parallel rank, zig-zag against contiguous (`train --dry-run`).
pub use ferrotron_parallel::context_parallel::balance_report as cp_balance_report;
use std::sync::Arc;
use std::time::Duration;

pub use crate::trainer::host_backend;
use ferrotron_comm::{Comm, ThreadWorld, Topology, Transport};
use ferrotron_config::Config;
use ferrotron_parallel::RankMesh;
use ferrotron_tensor::{Backend, Ledger, LedgerSnapshot};

use crate::{Init, StepStats, TrainError, Trainer};

/// What one rank of a finished run reports.
#[derive(Debug, Clone)]
pub struct RankOutcome {
    /// World rank.
    pub rank: usize,
    /// Per-step statistics (identical losses on every rank).
    pub steps: Vec<StepStats>,
    /// Every parameter's full fp32 value after the run (gathered from the shards).
    pub params: Vec<f32>,
    /// This rank's memory ledger after the last step (peaks per category), taken before
    /// `params` was gathered.
    pub memory: LedgerSnapshot,
}

/// The topology a config describes.
pub fn topology(config: &Config) -> Result<Topology, TrainError> {
    let p = &config.parallel;
    Topology::new(p.dp, p.pp, p.cp, p.tp, p.ep).map_err(|e| TrainError::Layout(e.to_string()))
}

/// Compute threads per rank: `train.threads`, or the machine's cores shared among the ranks
/// of one pipeline stage ([`ferrotron_config::ParallelConfig::default_threads_per_rank`]).
pub fn threads_per_rank(config: &Config) -> usize {
    if config.train.threads > 0 {
        return config.train.threads;
    }
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    config.parallel.default_threads_per_rank(cores)
}

/// Builds the trainer of `rank` on `transport` (threads or MPI), with every group of the
/// rank in its mesh.
pub fn rank_trainer(
    config: &Config,
    init: Init<'_>,
    transport: Arc<dyn Transport>,
    rank: usize,
) -> Result<Trainer, TrainError> {
    rank_trainer_on(config, init, transport, rank, host_backend(config)?)
}

/// [`rank_trainer`] on `backend`: the rank's ledger (shared with its communicator)
/// allocates from the backend's device memory.
pub fn rank_trainer_on(
    config: &Config,
    init: Init<'_>,
    transport: Arc<dyn Transport>,
    rank: usize,
    backend: Arc<dyn Backend>,
) -> Result<Trainer, TrainError> {
    let topo = topology(config)?;
    let ledger = backend.memory().map(Ledger::on).unwrap_or_default();
    let comm = Arc::new(Comm::new(transport, rank, ledger)?);
    let mesh = RankMesh::new(comm, &topo).map_err(|e| TrainError::Layout(e.to_string()))?;
    let mut config = config.clone();
    config.train.threads = threads_per_rank(&config);
    Trainer::for_rank_on(config, init, mesh, backend)
}

/// The backend of each rank of a run of ranks as threads.
pub type Backends<'a> = &'a (dyn Fn(usize) -> Arc<dyn Backend> + Sync);

/// Runs `per_rank(trainer)` on every rank of `config`'s layout as threads of this process.
/// When any rank fails (error or panic), the world is marked failed so the others stop
/// promptly with an error naming it, and that first failure is returned.
pub fn on_thread_ranks<T, F>(
    config: &Config,
    init: Init<'_>,
    per_rank: F,
) -> Result<Vec<T>, TrainError>
where
    T: Send,
    F: Fn(Trainer) -> Result<T, TrainError> + Sync,
{
    let backend = host_backend(config)?;
    on_thread_ranks_on(config, init, &|_| backend.clone(), per_rank)
}

/// [`on_thread_ranks`] with rank `r` computing on `backends(r)`.
pub fn on_thread_ranks_on<T, F>(
    config: &Config,
    init: Init<'_>,
    backends: Backends<'_>,
    per_rank: F,
) -> Result<Vec<T>, TrainError>
where
    T: Send,
    F: Fn(Trainer) -> Result<T, TrainError> + Sync,
{
    config.validate()?;
    let topo = topology(config)?;
    let world_size = topo.world_size();
    let timeout = Duration::from_secs_f64(config.parallel.comm_timeout_s);
    let world: Arc<ThreadWorld> = ThreadWorld::new(world_size, timeout)?;
    let results: Vec<Result<T, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let world = world.clone();
                let per_rank = &per_rank;
                scope.spawn(move || {
                    let transport: Arc<dyn Transport> = world.clone();
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let backend = backends(rank);
                        per_rank(rank_trainer_on(config, init, transport, rank, backend)?)
                    }));
                    let outcome = outcome.unwrap_or_else(|panic| {
                        let what = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "panic".into());
                        Err(TrainError::Hook(format!("panicked: {what}")))
                    });
                    if let Err(e) = &outcome {
                        world.fail(rank, &e.to_string());
                    }
                    outcome
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank threads catch their panics"))
            .collect()
    });
    if let Some((rank, reason)) = world.failure() {
        return Err(TrainError::RankFailed { rank, reason });
    }
    results.into_iter().collect()
}

/// Runs every step on every rank as threads (see [`on_thread_ranks`]), with `setup` applied
/// to each rank's trainer first and `observe(rank, stats)` after each step.
pub fn run_threads<F, O>(
    config: &Config,
    init: Init<'_>,
    setup: F,
    observe: O,
) -> Result<Vec<RankOutcome>, TrainError>
where
    F: Fn(&mut Trainer) + Sync,
    O: Fn(usize, &StepStats) + Sync,
{
    on_thread_ranks(config, init, |mut trainer| {
        setup(&mut trainer);
        let rank = trainer.rank();
        let steps = trainer.run(|s| observe(rank, s))?;
        // The run's memory, before gathering the full parameters for the caller adds its own.
        let memory = trainer.memory();
        let params = trainer.full_params()?;
        Ok(RankOutcome {
            rank,
            steps,
            params,
            memory,
        })
    })
}
