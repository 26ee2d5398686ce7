//! `ferrotron bench-comm`: collective bandwidth from 1 KiB to 256 MiB, reported as nccl-tests
//! reports it (algorithm and bus bandwidth), on the threads backend (or MPI under mpirun).

use ferrotron_bench::comm_cache::{self, MIN_BANDWIDTH_BYTES};
use ferrotron_bench::comm_sweep::{self, rows, summarise, Sizes};

/// Arguments of `bench-comm`.
#[derive(clap::Args)]
pub struct BenchCommArgs {
    /// Ranks (threads backend; under MPI the launcher's process count is used).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Smallest message in bytes.
    #[arg(long, default_value_t = 1024)]
    min_bytes: usize,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Size multiplier between points.
    #[arg(long, default_value_t = 4)]
    factor: usize,
    /// Use MPI (run under mpirun; needs the `mpi` build feature).
    #[arg(long)]
    mpi: bool,
}

/// The table of `rows`, measured on `backend`.
fn print(rows: &[String], backend: &str) {
    println!("collectives on the {backend} backend (median per operation; GB/s = 10⁹ B/s; bus bandwidth as nccl-tests defines it)\n");
    println!("| collective | ranks | size | time (µs) | algbw (GB/s) | busbw (GB/s) |\n|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
}

impl BenchCommArgs {
    fn sizes(&self) -> Sizes {
        Sizes {
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
        }
    }
}

/// `ferrotron bench-comm`: the table, and the planner's cache of its summary.
pub fn run(a: BenchCommArgs) -> anyhow::Result<()> {
    if a.mpi {
        return Ok(ferrotron_engine::mpi::bench_comm(
            |comm, group| {
                let points = comm_sweep::measure(comm, group, a.sizes());
                Ok(rows(&points.map_err(|e| e.to_string())?))
            },
            |rows| print(rows, "MPI"),
        )?);
    }
    let points = comm_sweep::on_threads(a.ranks, a.sizes())?;
    print(&rows(&points), "threads");
    // Only the threads backend is what `cpu-local` models (ranks as threads of one process).
    match summarise(&points) {
        // The cache only saves a measurement for later: failing to write it is a warning.
        Some(m) => match comm_cache::store(&m) {
            Ok(Some(path)) => println!(
                "\ncached in {} ({} ranks{}; `ferrotron plan --hardware cpu-local` uses the {}-rank entry)",
                path.display(),
                m.ranks,
                if m.latency_us > 0.0 {
                    ""
                } else {
                    ", no latency: the smallest message is over 4 KiB"
                },
                // `plan` reads the entry of the profile's node size.
                ferrotron_plan::Hardware::builtin("cpu-local")?.gpus_per_node
            ),
            Ok(None) => println!("\nnot cached: neither XDG_CACHE_HOME nor HOME is set"),
            Err(e) => eprintln!("warning: the measurement was not cached: {e}"),
        },
        None => println!(
            "\nnot cached: the planner needs 2 or more ranks and a sweep reaching at least {} MiB",
            MIN_BANDWIDTH_BYTES >> 20
        ),
    }
    Ok(())
}
