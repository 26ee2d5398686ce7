//! Model FLOPs utilisation: one definition for `train`, `bench`, `plan` and the docs (`plan`
//! divides the same numerator by its hardware profile's peak instead of a measured one).
//!
//! ```text
//! MFU = model FLOPs per token × global tokens per second ÷ peak FLOP/s of the hardware the run occupies
//! ```
//!
//! The numerator and the formula are [`ferrotron_config::flops`]'s; this module owns the
//! denominator of a run on this machine.
//!
//! - **Numerator**: [`ferrotron_config::ModelConfig::model_flops_per_token`], 3 × the
//!   forward's matmul FLOPs with attention scores counted over the full `s × s` matrix:
//!   nanotron's `get_flops` and Megatron-LM's `num_floating_point_operations` (whose
//!   `causal` variant is off by default) count it so, and so do the playbook's tables.
//!   Recomputation is not model work and is never counted (that is HFU).
//! - **Denominator**: the measured f32 matmul peak of the cores the run occupies, whatever
//!   the layout: tensor, pipeline, context and expert ranks count as much as data-parallel
//!   ones. With ranks as threads every rank shares this machine, so the run occupies
//!   `min(ranks × threads per rank, cores)` threads (8 ranks on 2 cores occupy 2 cores, not
//!   8); with one process per rank (MPI) each process brings its own threads.
//!
//! So a tp2 or pp2 run at the single rank's tokens/s per core reports the single rank's MFU.

/// How a run's ranks share hardware, for the MFU denominator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    /// Ranks of the run (the world size).
    pub ranks: usize,
    /// Compute threads of each rank.
    pub threads_per_rank: usize,
    /// Whether every rank runs in this process (ranks as threads) and so shares its cores.
    pub shared_host: bool,
    /// Cores of this machine.
    pub cores: usize,
}

impl Occupancy {
    /// The matmul peak to measure, and how many copies of it the run occupies:
    /// `(threads of one measurement, copies)`.
    pub fn peak_shape(&self) -> (usize, usize) {
        let per_rank = self.threads_per_rank.max(1);
        if self.shared_host {
            let threads = (self.ranks.max(1) * per_rank).min(self.cores.max(1));
            (threads, 1)
        } else {
            (per_rank, self.ranks.max(1))
        }
    }

    /// The MFU denominator (FLOP/s), from the peak `peak_of(threads)` of one measurement.
    pub fn peak_flops(&self, peak_of: impl FnOnce(usize) -> f64) -> f64 {
        let (threads, copies) = self.peak_shape();
        peak_of(threads) * copies as f64
    }
}

/// MFU of `tokens_per_s` global tokens per second at `flops_per_token` model FLOPs each,
/// against `peak_flops` ([`ferrotron_config::flops::mfu`], the one definition).
pub use ferrotron_config::flops::mfu;

#[cfg(test)]
mod tests {
    use super::*;

    fn threads(ranks: usize, threads_per_rank: usize) -> Occupancy {
        Occupancy {
            ranks,
            threads_per_rank,
            shared_host: true,
            cores: 2,
        }
    }

    #[test]
    fn ranks_as_threads_occupy_at_most_the_cores() {
        // The single rank with 2 threads, tp2 or pp2 with 1 thread each: the same 2 cores.
        assert_eq!(threads(1, 2).peak_shape(), (2, 1));
        assert_eq!(threads(2, 1).peak_shape(), (2, 1));
        // 8 ranks on 2 cores are oversubscribed: still 2 cores.
        assert_eq!(threads(8, 1).peak_shape(), (2, 1));
        assert_eq!(threads(1, 1).peak_shape(), (1, 1));
        let peak = |t: usize| [0.0, 90e9, 168e9][t];
        assert_eq!(threads(2, 1).peak_flops(peak), 168e9);
        assert_eq!(threads(16, 1).peak_flops(peak), 168e9);
    }

    #[test]
    fn processes_bring_their_own_threads() {
        let o = Occupancy {
            ranks: 4,
            threads_per_rank: 2,
            shared_host: false,
            cores: 2,
        };
        assert_eq!(o.peak_shape(), (2, 4));
        assert_eq!(o.peak_flops(|_| 100e9), 400e9);
    }

    #[test]
    fn equal_tokens_per_core_is_equal_mfu() {
        // tp2 at the single rank's global tokens/s on the same two cores: the same MFU.
        let single = mfu(16_000.0, 6.0e6, threads(1, 2).peak_flops(|_| 168e9));
        let tp2 = mfu(16_000.0, 6.0e6, threads(2, 1).peak_flops(|_| 168e9));
        assert_eq!(single, tp2);
        assert!((single - 16_000.0 * 6.0e6 / 168e9).abs() < 1e-15);
    }
}
