//! The embedded synthetic corpus: a second-order-lag Markov source whose entropy rate is
//! known exactly and which cannot be learned without attention.
//!
//! Token `x[t]` is drawn from `P(· | x[t−2])`: every symbol has `BRANCHING` successors with
//! the fixed probabilities [`SUCCESSOR_PROBS`]. The token right before it carries no
//! information about it, so a model that sees only the current token predicts no better than
//! the unigram distribution; a model that attends one position back reaches the floor.
//!
//! Each sample starts with `x[0], x[1]` drawn independently from the stationary distribution
//! π of the chain, so every position is stationary. The optimal mean loss over the `s`
//! targets `x[1..=s]` of a sample is therefore exactly
//! `(H(π) + (s − 1)·H(SUCCESSOR_PROBS)) / s` nats: the first target is independent of its
//! only context token, every later one has conditional entropy `H(SUCCESSOR_PROBS)`.

use crate::DataSource;

/// Successors per symbol.
pub const BRANCHING: usize = 4;
/// Probabilities of a symbol's successors, in order.
pub const SUCCESSOR_PROBS: [f64; BRANCHING] = [0.4, 0.3, 0.2, 0.1];
/// Seed of the transition table: the "language" is fixed; only sample order follows the run seed.
const TABLE_SEED: u64 = 0x5EED_F00D;

/// splitmix64: a tiny, well-mixed, platform-independent generator.
#[derive(Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// Generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_f64() * n as f64) as usize % n.max(1)
    }
}

/// The lag-2 Markov corpus over `vocab` symbols.
pub struct SyntheticCorpus {
    vocab: usize,
    seed: u64,
    /// `successors[i]` are the symbols that may follow `i` two positions later.
    successors: Vec<[u32; BRANCHING]>,
    /// Stationary distribution π.
    stationary: Vec<f64>,
    stationary_cdf: Vec<f64>,
}

impl SyntheticCorpus {
    /// The corpus over `vocab` symbols; `seed` picks the sample order (not the language).
    pub fn new(vocab: usize, seed: u64) -> Self {
        let vocab = vocab.max(1);
        let mut rng = SplitMix64::new(TABLE_SEED);
        let successors: Vec<[u32; BRANCHING]> = (0..vocab)
            .map(|_| std::array::from_fn(|_| rng.below(vocab) as u32))
            .collect();
        // π by power iteration on the chain i → successors[i] (lazy by ½ to kill periodicity
        // in the iteration; the fixed point is the same).
        let mut pi = vec![1.0 / vocab as f64; vocab];
        for _ in 0..10_000 {
            let mut next = vec![0.0; vocab];
            for (i, succ) in successors.iter().enumerate() {
                for (j, &s) in succ.iter().enumerate() {
                    next[s as usize] += pi[i] * SUCCESSOR_PROBS[j];
                }
            }
            let mut delta = 0.0f64;
            for i in 0..vocab {
                let v = 0.5 * pi[i] + 0.5 * next[i];
                delta = delta.max((v - pi[i]).abs());
                pi[i] = v;
            }
            if delta < 1e-15 {
                break;
            }
        }
        let total: f64 = pi.iter().sum();
        pi.iter_mut().for_each(|p| *p /= total);
        let mut acc = 0.0;
        let stationary_cdf = pi
            .iter()
            .map(|p| {
                acc += p;
                acc
            })
            .collect();
        SyntheticCorpus {
            vocab,
            seed,
            successors,
            stationary: pi,
            stationary_cdf,
        }
    }

    /// The successor table: `x[t]` is `successors()[x[t−2]][j]` with probability
    /// `SUCCESSOR_PROBS[j]` (entries may repeat; their probabilities then add).
    pub fn successors(&self) -> &[[u32; BRANCHING]] {
        &self.successors
    }

    /// The stationary distribution π of the chain.
    pub fn stationary(&self) -> &[f64] {
        &self.stationary
    }

    /// Exact entropy rate in nats: Σ_i π_i · H(P(· | i)), merging repeated successors.
    pub fn entropy_rate(&self) -> f64 {
        self.successors
            .iter()
            .zip(&self.stationary)
            .map(|(succ, pi)| pi * row_entropy(succ))
            .sum()
    }

    /// Entropy of π in nats.
    pub fn stationary_entropy(&self) -> f64 {
        self.stationary
            .iter()
            .filter(|p| **p > 0.0)
            .map(|p| -p * p.ln())
            .sum()
    }

    /// The lowest achievable mean loss over the `seq_len` targets of one sample.
    pub fn optimal_loss(&self, seq_len: usize) -> f64 {
        let s = seq_len as f64;
        (self.stationary_entropy() + (s - 1.0) * self.entropy_rate()) / s
    }

    fn draw_stationary(&self, rng: &mut SplitMix64) -> u32 {
        let u = rng.next_f64();
        self.stationary_cdf
            .partition_point(|&c| c <= u)
            .min(self.vocab - 1) as u32
    }

    fn draw_successor(&self, prev2: u32, rng: &mut SplitMix64) -> u32 {
        let u = rng.next_f64();
        let mut acc = 0.0;
        for (j, p) in SUCCESSOR_PROBS.iter().enumerate() {
            acc += p;
            if u < acc {
                return self.successors[prev2 as usize][j];
            }
        }
        self.successors[prev2 as usize][BRANCHING - 1]
    }
}

/// Entropy of one row, merging successors that repeat.
fn row_entropy(succ: &[u32; BRANCHING]) -> f64 {
    let mut merged: Vec<(u32, f64)> = Vec::new();
    for (j, &s) in succ.iter().enumerate() {
        match merged.iter_mut().find(|(t, _)| *t == s) {
            Some((_, p)) => *p += SUCCESSOR_PROBS[j],
            None => merged.push((s, SUCCESSOR_PROBS[j])),
        }
    }
    merged.iter().map(|(_, p)| -p * p.ln()).sum()
}

impl DataSource for SyntheticCorpus {
    fn sample(&self, index: u64, out: &mut [u32]) {
        let mut rng = SplitMix64::new(self.seed ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        for t in 0..out.len() {
            out[t] = if t < 2 {
                self.draw_stationary(&mut rng)
            } else {
                self.draw_successor(out[t - 2], &mut rng)
            };
        }
    }

    fn fingerprint(&self) -> crate::DataFingerprint {
        crate::DataFingerprint::Synthetic {
            vocab: self.vocab_size(),
        }
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empirical_conditional_entropy_matches_entropy_rate() {
        let corpus = SyntheticCorpus::new(64, 7);
        let mut counts = vec![[0u64; 64]; 64];
        let mut buf = vec![0u32; 257];
        for i in 0..400 {
            corpus.sample(i, &mut buf);
            for t in 2..buf.len() {
                counts[buf[t - 2] as usize][buf[t] as usize] += 1;
            }
        }
        let total: u64 = counts.iter().flatten().sum();
        let mut h = 0.0;
        for row in &counts {
            let n: u64 = row.iter().sum();
            for &c in row.iter().filter(|c| **c > 0) {
                h -= (c as f64 / total as f64) * (c as f64 / n as f64).ln();
            }
        }
        assert!(
            (h - corpus.entropy_rate()).abs() < 0.02,
            "{h} vs {}",
            corpus.entropy_rate()
        );
    }

    #[test]
    fn samples_are_deterministic_and_in_vocab() {
        let c = SyntheticCorpus::new(256, 1);
        let (mut a, mut b) = (vec![0; 129], vec![0; 129]);
        c.sample(42, &mut a);
        c.sample(42, &mut b);
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| t < 256));
        c.sample(43, &mut b);
        assert_ne!(a, b);
    }
}
