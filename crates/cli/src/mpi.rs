//! `train` under MPI: one process per rank (`mpirun -np N ferrotron train --set
//! parallel.backend=mpi ...`).

use ferrotron_config::Config;
use ferrotron_train::{TrainError, Trainer};

/// Without the `mpi` feature there is no MPI transport: say how to get one.
#[cfg(not(feature = "mpi"))]
pub fn run(
    _config: &Config,
    _init: Option<&[f32]>,
    _fault: Option<(usize, usize)>,
    _drive: impl Fn(Trainer) -> Result<(), TrainError>,
) -> anyhow::Result<()> {
    anyhow::bail!(
        "parallel.backend = \"mpi\" needs a build with MPI: install OpenMPI (apt install libopenmpi-dev openmpi-bin libclang-dev) and build with `cargo build --release --features mpi`"
    )
}

/// Without the `mpi` feature there is no MPI collective benchmark.
#[cfg(not(feature = "mpi"))]
pub fn bench_comm(
    _measure: impl Fn(&ferrotron_comm::Comm, &[usize]) -> anyhow::Result<Vec<String>>,
    _print: impl Fn(&[String]),
) -> anyhow::Result<()> {
    anyhow::bail!("bench-comm --mpi needs a build with `--features mpi` (and OpenMPI installed)")
}
