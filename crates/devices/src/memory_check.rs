//! Before any work: does the run fit in this machine's memory? The estimator (the same one
//! `ferrotron estimate` prints, which agrees with the ledger) against `MemAvailable`.

use ferrotron_config::{CommBackend, Config, Device};
use ferrotron_plan::{estimate_with, Assumptions, Job, GIB};

/// Bytes the kernel says can be allocated without swapping (`/proc/meminfo`), if readable.
fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses a run whose ranks in this process need more memory than is available, saying how
/// much and what to change. A layout the estimator does not model is not checked. On GPUs
/// the host holds no model state: [`check_device`] checks each GPU instead.
///
/// # Errors
///
/// [`crate::DevicesError::Memory`], saying how much and what to change.
pub fn check(config: &Config) -> crate::Result<()> {
    if config.train.device == Device::Cuda {
        return Ok(());
    }
    let Some(available) = available_bytes() else {
        return Ok(());
    };
    // Ranks as threads share this process; under MPI each process holds one rank.
    let ranks = match config.parallel.backend {
        CommBackend::Threads => config.parallel.world_size() as u64,
        CommBackend::Mpi => 1,
    };
    check_device(config, ranks, available, "this machine")
}

/// Refuses a run when `ranks` of its ranks, at the estimator's peak, need more than
/// `available` bytes of the memory named `place`.
///
/// # Errors
///
/// [`crate::DevicesError::Memory`], saying how much and what to change.
pub fn check_device(config: &Config, ranks: u64, available: u64, place: &str) -> crate::Result<()> {
    let Ok(job) = Job::from_config(config) else {
        return Ok(());
    };
    let Ok(est) = estimate_with(&job, &Assumptions::default()) else {
        return Ok(());
    };
    let need = est.total().saturating_mul(ranks);
    if need <= available {
        return Ok(());
    }
    Err(crate::DevicesError::Memory(format!(
        "this run needs about {:.1} GiB ({} rank(s) of {:.1} GiB at their peak, as \
         `ferrotron estimate` with the same settings reports) and {place} has {:.1} GiB \
         available: lower train.micro_batch or model.seq_len, set parallel.recompute, shard \
         with parallel.zero, or pass --no-memory-check to try anyway",
        need as f64 / GIB,
        ranks,
        est.total() as f64 / GIB,
        available as f64 / GIB
    )))
}
