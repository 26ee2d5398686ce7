//! The parallel layout section: degrees of each dimension, ZeRO, the pipeline schedule,
//! recomputation and the collective backend.

use serde::{Deserialize, Serialize};

/// How ranks talk to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CommBackend {
    /// Ranks as threads of one process, collectives over shared memory.
    Threads,
    /// One process per rank under `mpirun`/`srun` (cargo feature `mpi`).
    Mpi,
}

/// Pipeline schedule (playbook §4): all-forward-all-backward, one-forward-one-backward,
/// interleaved 1F1B over `virtual_stages` chunks per rank, zero bubble (ZB-H1), or DualPipeV
/// (two chunks per rank in a V). The
/// schedule crate's kind itself, so the configuration, the engine and the estimator name
/// the same type.
pub use ferrotron_schedule::ScheduleKind as PpSchedule;

/// Activation recomputation (playbook §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation backward needs.
    #[default]
    None,
    /// Drop the normed inputs of attention and MLP and the attention output; recompute them
    /// in backward (two norms and one flash-attention forward per block).
    Selective,
    /// Keep only each block's input; recompute the whole block's forward in backward.
    Full,
}

/// How context parallelism runs attention (`parallel.cp_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpKind {
    /// Ring attention: each rank keeps its queries while the key/value blocks of every rank
    /// pass by (playbook §4).
    #[default]
    Ring,
    /// DeepSpeed-Ulysses: an all-to-all swaps sequence shards for head shards around
    /// attention, which then runs over whole sequences on `heads / cp` heads per rank (heads
    /// per tensor-parallel rank divisible by `cp`; key/value heads divisible by `cp`, or
    /// dividing it and shared).
    Ulysses,
}

/// The parallel layout: a grid of `dp · pp · cp · tp` ranks (expert parallelism folded into
/// dp). Dimensions not implemented yet are refused up front by [`crate::Config::validate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Context-parallel degree: each sequence is split over `cp` ranks in zig-zag order
    /// (`model.seq_len` must be divisible by `2·cp`); attention runs as `cp_kind` says.
    pub cp: usize,
    /// How context parallelism runs attention: a ring (default) or Ulysses' all-to-all.
    #[serde(skip_serializing_if = "is_ring")]
    pub cp_kind: CpKind,
    /// Expert-parallel degree: `ep` data-parallel ranks split every mixture-of-experts
    /// block's experts (divides `dp` and `model.experts`).
    pub ep: usize,
    /// ZeRO stage (0–3).
    pub zero: u8,
    /// Sequence parallelism: outside tensor-parallel regions, activations are split along
    /// tokens over the tensor-parallel group.
    pub sequence_parallel: bool,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Pipeline schedule.
    pub pp_schedule: PpSchedule,
    /// Model chunks per pipeline rank (interleaved schedule only).
    pub virtual_stages: usize,
    /// Blocks per virtual stage, in pipeline order (absent: an even split).
    pub pp_layers: Option<Vec<usize>>,
    /// Gradient bucket size for data-parallel reduction, in MB (10⁶ bytes of gradients).
    pub bucket_mb: f64,
    /// Collective backend.
    pub backend: CommBackend,
    /// Seconds a collective waits for its peers before failing with the missing ranks named.
    pub comm_timeout_s: f64,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            cp_kind: CpKind::Ring,
            ep: 1,
            zero: 0,
            sequence_parallel: false,
            recompute: Recompute::None,
            pp_schedule: PpSchedule::OneFOneB,
            virtual_stages: 1,
            pp_layers: None,
            bucket_mb: 25.0,
            backend: CommBackend::Threads,
            comm_timeout_s: 120.0,
        }
    }
}

/// Whether `kind` is the default (left out of a written configuration).
fn is_ring(kind: &CpKind) -> bool {
    *kind == CpKind::Ring
}

impl ParallelConfig {
    /// Model chunks each pipeline rank holds: `virtual_stages` for the interleaved schedule,
    /// 2 for DualPipeV (stages `r` and `2p−1−r`), else 1.
    pub fn chunks_per_rank(&self) -> usize {
        self.pp_schedule.chunks(self.virtual_stages)
    }

    /// Ranks in the grid: `dp · pp · cp · tp`.
    pub fn world_size(&self) -> usize {
        self.dp * self.pp * self.cp * self.tp
    }

    /// Compute threads per rank when `train.threads` is 0: `cores` shared among the ranks of
    /// one pipeline stage (`world_size / pp`), so the stages of a pipeline share them.
    ///
    /// A stage waits for its neighbours in the schedule's bubble, and the stage with the LM
    /// head has more work than the others; with every stage's pool as wide as the cores its
    /// ranks would get alone, the operating system gives whichever stage has work the cores
    /// the waiting ones leave. On a 2-core EPYC, small's pp2 1F1B (m = 8) went from
    /// 0.83–0.89 of one rank of 2 threads with one thread per rank to 1.04–1.05 with two.
    /// Ranks that meet at every layer (tensor, context, data parallel) keep cores of their
    /// own: tp2 + SP lost 7% when its ranks shared.
    pub fn default_threads_per_rank(&self, cores: usize) -> usize {
        let at_once = (self.world_size() / self.pp.max(1)).max(1);
        (cores / at_once).max(1)
    }

    /// A short description of the layout with its batch shape, the one every command prints:
    /// `DP4 TP2 PP4(1f1b 9×2/8/6) CP2 EP2 ZeRO-1 SP b=1 m=64 recompute=full` (degrees of 1,
    /// ZeRO-0 and the defaults left out).
    pub fn describe(&self, micro_batch: usize, grad_accum: usize) -> String {
        let mut parts = vec![format!("DP{}", self.dp)];
        if self.tp > 1 {
            parts.push(format!("TP{}", self.tp));
        }
        if self.pp > 1 {
            let mut sched = match self.pp_schedule {
                PpSchedule::Interleaved => format!("interleaved v={}", self.virtual_stages),
                s => s.name().to_string(),
            };
            if let Some(list) = &self.pp_layers {
                // Runs of equal counts as `n×k`: 9/9/8/6 → 9×2/8/6.
                let mut runs: Vec<(usize, usize)> = Vec::new();
                for &n in list {
                    match runs.last_mut() {
                        Some((m, k)) if *m == n => *k += 1,
                        _ => runs.push((n, 1)),
                    }
                }
                let text: Vec<String> = runs
                    .iter()
                    .map(|&(n, k)| {
                        if k == 1 {
                            n.to_string()
                        } else {
                            format!("{n}×{k}")
                        }
                    })
                    .collect();
                sched = format!("{sched} {}", text.join("/"));
            }
            parts.push(format!("PP{}({sched})", self.pp));
        }
        if self.cp > 1 {
            parts.push(match self.cp_kind {
                CpKind::Ring => format!("CP{}", self.cp),
                CpKind::Ulysses => format!("CP{}(ulysses)", self.cp),
            });
        }
        if self.ep > 1 {
            parts.push(format!("EP{}", self.ep));
        }
        if self.zero > 0 {
            parts.push(format!("ZeRO-{}", self.zero));
        }
        if self.sequence_parallel && self.tp > 1 {
            parts.push("SP".into());
        }
        parts.push(format!("b={micro_batch} m={grad_accum}"));
        if self.recompute != Recompute::None {
            parts.push(format!("recompute={:?}", self.recompute).to_lowercase());
        }
        parts.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dp: usize, pp: usize, tp: usize, cp: usize) -> ParallelConfig {
        ParallelConfig {
            dp,
            pp,
            tp,
            cp,
            ..ParallelConfig::default()
        }
    }

    /// Ranks that meet at every layer split the cores; pipeline stages share them.
    #[test]
    fn default_threads_share_cores_between_stages_only() {
        assert_eq!(layout(1, 1, 1, 1).default_threads_per_rank(2), 2);
        assert_eq!(layout(2, 1, 1, 1).default_threads_per_rank(2), 1);
        assert_eq!(layout(1, 1, 2, 1).default_threads_per_rank(2), 1);
        assert_eq!(layout(1, 1, 1, 2).default_threads_per_rank(2), 1);
        assert_eq!(layout(1, 2, 1, 1).default_threads_per_rank(2), 2);
        assert_eq!(layout(1, 4, 1, 1).default_threads_per_rank(16), 16);
        assert_eq!(layout(2, 2, 2, 1).default_threads_per_rank(16), 4);
        assert_eq!(layout(1, 2, 2, 1).default_threads_per_rank(5), 2);
        // More ranks per stage than cores: one thread each, never none.
        assert_eq!(layout(8, 1, 1, 1).default_threads_per_rank(2), 1);
        assert_eq!(layout(4, 2, 1, 1).default_threads_per_rank(0), 1);
    }
}
