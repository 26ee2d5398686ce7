//! Blends: several corpora mixed by weight into one sample stream.
//!
//! Sample `i` is drawn from one corpus, chosen by a fixed **schedule** of `PERIOD` =
//! 65,536 slots repeated forever. The schedule is Megatron's greedy blend: slot `n` goes to
//! the corpus furthest behind its share, `argmax_c (w_c · (n + 1) − drawn_c)` (the first on
//! a tie), so after any number of slots every corpus is within about one sample of its share.
//! Sample `i` is then sample `j` of corpus `c`, where `c` is the corpus of slot `i % PERIOD`
//! and `j` counts the samples that corpus had before it; each corpus shuffles its own
//! windows, epoch by epoch ([`crate::FileSampler`]).
//!
//! Everything depends on the sample index alone: the mix is the same under every layout and
//! a resumed run continues it exactly.

use crate::{BlendedData, DataError, DataFingerprint, DataSource};

/// Slots in the repeating schedule.
pub const PERIOD: usize = 1 << 16;

/// The seed corpus `c` of a blend shuffles with: the run's seed for the first, so a blend of
/// one corpus reads exactly what `data.path` would.
pub fn corpus_seed(seed: u64, c: usize) -> u64 {
    seed.wrapping_add((c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The weights normalised to sum to 1 (each corpus's share of the samples), as the blend
/// draws them and as checkpoints record them.
pub fn shares(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Several [`DataSource`]s mixed by weight (see the [module docs](self)).
pub struct Blend {
    parts: Vec<Box<dyn DataSource>>,
    weights: Vec<f64>,
    /// The corpus of each slot.
    slot_corpus: Vec<u16>,
    /// How many slots of the same corpus come before each slot.
    slot_rank: Vec<u32>,
    /// Slots per period of each corpus.
    per_period: Vec<u64>,
}

impl std::fmt::Debug for Blend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blend")
            .field("weights", &self.weights)
            .field("per_period", &self.per_period)
            .finish_non_exhaustive()
    }
}

impl Blend {
    /// A blend of `parts`, each `(weight, source)`; the weights are normalised to sum to 1.
    ///
    /// # Errors
    ///
    /// [`DataError::Blend`] for no parts, more than 65,535, a weight that is not a finite
    /// positive number, or one too small to get a slot in the schedule.
    pub fn new(parts: Vec<(f64, Box<dyn DataSource>)>) -> Result<Blend, DataError> {
        let bad = |reason: String| Err(DataError::Blend { reason });
        if parts.is_empty() || parts.len() > usize::from(u16::MAX) {
            return bad(format!(
                "{} corpora: a blend takes 1 to {}",
                parts.len(),
                u16::MAX
            ));
        }
        if let Some((i, (w, _))) = parts
            .iter()
            .enumerate()
            .find(|(_, (w, _))| !(w.is_finite() && *w > 0.0))
        {
            return bad(format!(
                "entry {i} has weight {w}: every weight must be a finite number above 0"
            ));
        }
        let weights = shares(&parts.iter().map(|(w, _)| *w).collect::<Vec<_>>());
        let (slot_corpus, slot_rank, per_period) = schedule(&weights);
        if let Some(c) = per_period.iter().position(|&k| k == 0) {
            return bad(format!(
                "entry {c} has a share of {:e}, too small to be drawn once in {PERIOD} \
                 samples: raise its weight or leave it out",
                weights[c]
            ));
        }
        Ok(Blend {
            parts: parts.into_iter().map(|(_, s)| s).collect(),
            weights,
            slot_corpus,
            slot_rank,
            per_period,
        })
    }

    /// The normalised weights.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Which corpus sample `index` comes from, and which of that corpus's samples it is.
    pub fn locate(&self, index: u64) -> (usize, u64) {
        let period = index / PERIOD as u64;
        let slot = (index % PERIOD as u64) as usize;
        let c = usize::from(self.slot_corpus[slot]);
        (
            c,
            period * self.per_period[c] + u64::from(self.slot_rank[slot]),
        )
    }
}

/// Megatron's greedy schedule over one period: each slot's corpus, its rank among that
/// corpus's slots, and the slots of each corpus.
fn schedule(weights: &[f64]) -> (Vec<u16>, Vec<u32>, Vec<u64>) {
    let mut drawn = vec![0u64; weights.len()];
    let mut corpus = Vec::with_capacity(PERIOD);
    let mut rank = Vec::with_capacity(PERIOD);
    for n in 0..PERIOD {
        let mut best = 0;
        let mut best_error = f64::NEG_INFINITY;
        for (c, w) in weights.iter().enumerate() {
            let error = w * (n + 1) as f64 - drawn[c] as f64;
            if error > best_error {
                best = c;
                best_error = error;
            }
        }
        corpus.push(best as u16);
        rank.push(drawn[best] as u32);
        drawn[best] += 1;
    }
    (corpus, rank, drawn)
}

impl DataSource for Blend {
    fn sample(&self, index: u64, out: &mut [u32]) {
        let (c, j) = self.locate(index);
        self.parts[c].sample(j, out);
    }

    /// The largest of the corpora's.
    fn vocab_size(&self) -> usize {
        self.parts.iter().map(|p| p.vocab_size()).max().unwrap_or(0)
    }

    /// The corpora's caches and the schedule.
    fn cache_bytes(&self) -> usize {
        let schedule = PERIOD * (std::mem::size_of::<u16>() + std::mem::size_of::<u32>());
        schedule + self.parts.iter().map(|p| p.cache_bytes()).sum::<usize>()
    }

    fn fingerprint(&self) -> DataFingerprint {
        DataFingerprint::Blend {
            parts: self
                .parts
                .iter()
                .zip(&self.weights)
                .map(|(p, &weight)| BlendedData {
                    weight,
                    data: p.fingerprint(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prefix_of_the_schedule_keeps_each_share_within_one_sample() {
        let weights = [0.5, 0.3, 0.15, 0.05];
        let (corpus, rank, per_period) = schedule(&weights);
        let mut drawn = [0u64; 4];
        for (n, (&c, &r)) in corpus.iter().zip(&rank).enumerate() {
            assert_eq!(u64::from(r), drawn[usize::from(c)], "rank of slot {n}");
            drawn[usize::from(c)] += 1;
            for (d, w) in drawn.iter().zip(weights) {
                let due = w * (n + 1) as f64;
                assert!(
                    (*d as f64 - due).abs() <= 1.0,
                    "slot {n}: {d} drawn, {due} due"
                );
            }
        }
        assert_eq!(per_period.to_vec(), drawn.to_vec());
        assert_eq!(per_period.iter().sum::<u64>(), PERIOD as u64);
    }
}
