//! `train` under MPI: one process per rank (`mpirun -np N ferrotron train --set
//! parallel.backend=mpi ...`).

use ferrotron_config::Config;
use ferrotron_train::{TrainError, Trainer};

/// Without the `mpi` feature there is no MPI transport: say how to get one.
#[cfg(not(feature = "mpi"))]
pub fn run<T>(
    _config: &Config,
    _init: ferrotron_train::Init<'_>,
    _fault: Option<(usize, usize)>,
    _drive: impl Fn(Trainer) -> Result<T, TrainError>,
) -> crate::Result<T> {
    Err(crate::EngineError::Refused(
        "parallel.backend = \"mpi\" needs a build with MPI: install OpenMPI (apt install libopenmpi-dev openmpi-bin libclang-dev) and build with `cargo build --release --features mpi`".into()
    ))
}

/// Runs this process's rank of an MPI job: initialises MPI (rank and world size come from
/// the launcher, `mpirun` or `srun`), checks that the job has as many processes as the
/// layout has ranks, builds this rank's trainer and hands it to `drive` (rank 0 reports);
/// `fault = Some((r, s))` makes rank `r` fail in the middle of step `s`.
///
/// A world of the wrong size is reported by rank 0 and every process exits with status 1. Any
/// other error aborts the whole job: the failing rank prints `rank R failed: ...` and calls
/// `MPI_Abort`, so the launcher stops every process and exits non-zero.
#[cfg(feature = "mpi")]
pub fn run<T>(
    config: &Config,
    init: ferrotron_train::Init<'_>,
    fault: Option<(usize, usize)>,
    drive: impl Fn(Trainer) -> Result<T, TrainError>,
) -> crate::Result<T> {
    use std::time::Duration;

    use crate::EngineError;
    use ferrotron_comm::{MpiWorld, Transport};
    use ferrotron_train::launch::{rank_trainer_on, topology};

    let timeout = Duration::try_from_secs_f64(config.parallel.comm_timeout_s).map_err(|e| {
        EngineError::Refused(format!(
            "parallel.comm_timeout_s must be a positive number of seconds ({e})"
        ))
    })?;
    let world = MpiWorld::init(timeout).map_err(|e| failed("cannot start MPI", e))?;
    let rank = world.rank();
    let world_size = world.world_size();
    let layout = topology(config).and_then(|t| {
        t.check_world(world_size)
            .map_err(|e| TrainError::Layout(e.to_string()))
    });
    if let Err(e) = layout {
        // Every process sees the same sizes. Rank 0 explains before anyone leaves (the
        // launcher stops the job as soon as one process exits non-zero), then all leave MPI
        // cleanly and exit non-zero.
        if rank == 0 {
            let launch = config.parallel.world_size();
            let processes = if world_size == 1 {
                "process"
            } else {
                "processes"
            };
            eprintln!(
                "Error: the MPI job has {world_size} {processes} but the layout needs {launch}: \
                 {e} (mpirun -np {launch} ...)"
            );
        }
        world
            .finalize()
            .map_err(|e| failed("cannot finalize MPI after a layout error", e))?;
        std::process::exit(1);
    }
    let backend = match ferrotron_devices::rank_backend(config, rank) {
        Ok(b) => b,
        Err(e) => {
            world.fail(rank, &e.to_string());
            return Err(e.into());
        }
    };
    let outcome =
        rank_trainer_on(config, init, world.clone(), rank, backend).and_then(|mut trainer| {
            trainer.faults.fail_at_step = fault.and_then(|(r, s)| (r == rank).then_some(s));
            drive(trainer)
        });
    match outcome {
        Ok(value) => {
            if let Err(e) = world.finalize() {
                world.fail(rank, &format!("cannot finalize MPI: {e}"));
            }
            Ok(value)
        }
        Err(e) => {
            // Aborts the whole job (MPI cannot interrupt peers blocked in a collective).
            world.fail(rank, &e.to_string());
            Err(e.into())
        }
    }
}

/// A launch that failed, with what was being done.
#[cfg(feature = "mpi")]
fn failed(what: &str, e: impl std::fmt::Display) -> crate::EngineError {
    crate::EngineError::Failed(format!("{what}: {e}"))
}

/// Without the `mpi` feature: the error naming the build that has it.
#[cfg(not(feature = "mpi"))]
pub fn bench_comm(
    _measure: impl Fn(&ferrotron_comm::Comm, &[usize]) -> Result<Vec<String>, String>,
    _print: impl Fn(&[String]),
) -> crate::Result<()> {
    Err(crate::EngineError::Refused(
        "bench-comm --mpi needs a build with `--features mpi` (and OpenMPI installed)".into(),
    ))
}

/// `bench-comm --mpi`: this process's rank of the world measures with `measure` (rows of
/// the table), and rank 0 prints them with `print`; a failing rank aborts the job.
#[cfg(feature = "mpi")]
pub fn bench_comm(
    measure: impl Fn(&ferrotron_comm::Comm, &[usize]) -> Result<Vec<String>, String>,
    print: impl Fn(&[String]),
) -> crate::Result<()> {
    use std::sync::Arc;
    use std::time::Duration;

    use ferrotron_comm::{Comm, MpiWorld, Transport};

    let world =
        MpiWorld::init(Duration::from_secs(600)).map_err(|e| failed("cannot start MPI", e))?;
    let rank = world.rank();
    let group: Vec<usize> = (0..world.world_size()).collect();
    let transport: Arc<dyn Transport> = world.clone();
    let rows = Comm::with_own_ledger(transport, rank)
        .map_err(|e| e.to_string())
        .and_then(|comm| measure(&comm, &group));
    match rows {
        Ok(rows) => {
            if let Err(e) = world.finalize() {
                world.fail(rank, &format!("cannot finalize MPI: {e}"));
            }
            if rank == 0 {
                print(&rows);
            }
            Ok(())
        }
        Err(e) => {
            world.fail(rank, &e);
            Err(crate::EngineError::Failed(e))
        }
    }
}
