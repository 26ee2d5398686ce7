//! Where each virtual stage of the model lives: which pipeline rank, as which of its chunks.

/// How the `p·v` virtual stages are laid on `p` ranks.
///
/// - [`Placement::Looped`] (Megatron's, every schedule but DualPipeV): virtual stage
///   `chunk·p + rank`. With `v = 1` rank `r` holds stage `r`; interleaved, the model loops
///   over the ranks `v` times.
/// - [`Placement::V`] (DualPipeV, two chunks per rank): rank `r` holds stage `r` as chunk 0
///   and stage `2p−1−r` as chunk 1, so the model runs down the ranks and back up: rank 0
///   holds the embedding and the head, and rank `p−1` hands stage `p−1` to stage `p` in
///   place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Virtual stage `chunk·p + rank`.
    Looped,
    /// Chunk 0 is stage `rank`, chunk 1 stage `2p−1−rank`.
    V,
}

impl Placement {
    /// The global virtual stage of `chunk` on `rank` of a `p`-rank pipeline.
    pub fn stage(self, p: usize, rank: usize, chunk: usize) -> usize {
        match (self, chunk) {
            (Placement::Looped, _) | (Placement::V, 0) => {
                chunk.saturating_mul(p).saturating_add(rank)
            }
            (Placement::V, _) => (2 * p).saturating_sub(1).saturating_sub(rank),
        }
    }

    /// The `(rank, chunk)` that holds virtual stage `stage` of a `p`-rank pipeline.
    pub fn owner(self, p: usize, stage: usize) -> (usize, usize) {
        let p = p.max(1);
        match self {
            Placement::Looped => (stage % p, stage / p),
            Placement::V if stage < p => (stage, 0),
            Placement::V => ((2 * p).saturating_sub(1).saturating_sub(stage), 1),
        }
    }

    /// The virtual stages of `rank`'s chunks, in chunk order, for `v` chunks per rank.
    pub fn stages_of(self, p: usize, v: usize, rank: usize) -> Vec<usize> {
        (0..v).map(|chunk| self.stage(p, rank, chunk)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_inverts_stage() {
        for placement in [Placement::Looped, Placement::V] {
            for p in 1..6 {
                let v = if placement == Placement::V { 2 } else { 3 };
                let mut seen = vec![false; p * v];
                for rank in 0..p {
                    for chunk in 0..v {
                        let s = placement.stage(p, rank, chunk);
                        assert!(!seen[s], "{placement:?} p={p}: stage {s} twice");
                        seen[s] = true;
                        assert_eq!(placement.owner(p, s), (rank, chunk));
                    }
                }
            }
        }
    }

    #[test]
    fn v_runs_down_and_back_up() {
        assert_eq!(Placement::V.stages_of(4, 2, 0), vec![0, 7]);
        assert_eq!(Placement::V.stages_of(4, 2, 3), vec![3, 4]);
        assert_eq!(Placement::Looped.stages_of(4, 2, 3), vec![3, 7]);
    }
}
