//! `ferrotron bench-comm`: collective bandwidth from 1 KiB to 256 MiB, reported as nccl-tests
//! reports it (algorithm and bus bandwidth), on the threads backend (or MPI under mpirun).

use std::time::Duration;

use ferrotron_comm::bench::{bench_collective, CollectiveKind};
use ferrotron_comm::{run_ranks, Comm};
use ferrotron_tensor::Ledger;

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

const KINDS: [(CollectiveKind, &str); 4] = [
    (CollectiveKind::AllReduce, "all_reduce"),
    (CollectiveKind::AllGather, "all_gather"),
    (CollectiveKind::ReduceScatter, "reduce_scatter"),
    (CollectiveKind::Broadcast, "broadcast"),
];

fn sizes(a: &BenchCommArgs) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = a.min_bytes.max(4);
    while s <= a.max_bytes {
        out.push(s);
        s *= a.factor.max(2);
    }
    out
}

/// Iterations per size: many for small messages, few for large ones.
fn iters(bytes: usize) -> usize {
    ((64 << 20) / bytes.max(1)).clamp(3, 200)
}

/// Runs every point on `comm`; returns the table rows (identical on every rank).
fn measure(
    comm: &Comm,
    group: &[usize],
    a: &BenchCommArgs,
) -> Result<Vec<String>, ferrotron_comm::CommError> {
    let mut rows = Vec::new();
    for (kind, name) in KINDS {
        for bytes in sizes(a) {
            let p = bench_collective(comm, group, kind, bytes, iters(bytes))?;
            rows.push(format!(
                "| {name} | {} | {} | {:.1} | {:.3} | {:.3} |",
                p.ranks,
                human(p.bytes),
                p.time_s * 1e6,
                p.algbw_gbps,
                p.busbw_gbps
            ));
        }
    }
    Ok(rows)
}

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn print(rows: &[String], backend: &str) {
    println!("collectives on the {backend} backend (median per operation; GB/s = 10⁹ B/s; bus bandwidth as nccl-tests defines it)\n");
    println!("| collective | ranks | size | time (µs) | algbw (GB/s) | busbw (GB/s) |\n|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
}

pub fn run(a: BenchCommArgs) -> anyhow::Result<()> {
    if a.mpi {
        return crate::mpi::bench_comm(
            |comm, group| Ok(measure(comm, group, &a)?),
            |rows| print(rows, "MPI"),
        );
    }
    anyhow::ensure!(a.ranks >= 1, "--ranks must be at least 1");
    let group: Vec<usize> = (0..a.ranks).collect();
    let results = run_ranks(a.ranks, Duration::from_secs(600), |ctx| {
        let comm = ctx.comm(Ledger::new())?;
        measure(&comm, &group, &a)
    })?;
    print(&results[0], "threads");
    Ok(())
}
