//! Generation as a library call: a model continues a prompt token by token through the
//! model's decoder ([`ferrotron_model::decode`], every kernel on the backend), greedy (as
//! transformers' `generate(do_sample=False)`) or sampled at a temperature within a top-p
//! nucleus, reproducibly for a seed. [`Generation`] is an iterator over the new tokens.

use ferrotron_model::decode::{Decoder, KvCache};

use crate::TrainError;

/// The most tokens one generation may ask for.
pub const MAX_NEW_TOKENS: usize = 1 << 20;

/// Checks a generation's settings before any work: a temperature of 0 or more, a top-p in
/// (0, 1] and 1 to [`MAX_NEW_TOKENS`] new tokens (named by `generate`'s flags).
///
/// # Errors
///
/// [`TrainError::Arguments`] naming the setting and its range.
pub fn check_settings(sampling: &Sampling, max_new_tokens: usize) -> Result<(), TrainError> {
    let bad = |m: String| Err(TrainError::Arguments(m));
    if !(sampling.temperature >= 0.0 && sampling.temperature.is_finite()) {
        return bad(format!(
            "--temperature {}: use 0 (greedy) or a positive number",
            sampling.temperature
        ));
    }
    if !(sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
        return bad(format!(
            "--top-p {}: use a number in (0, 1]",
            sampling.top_p
        ));
    }
    if !(1..=MAX_NEW_TOKENS).contains(&max_new_tokens) {
        return bad(format!(
            "--max-new-tokens {max_new_tokens}: use 1 to {MAX_NEW_TOKENS}"
        ));
    }
    Ok(())
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the most probable token, the first on ties); else the softmax's temperature.
    pub temperature: f64,
    /// Sample only among the most probable tokens whose probabilities reach this (0, 1].
    pub top_p: f64,
    /// Seed of the sampling's random numbers.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };
}

/// What a generation is asked for besides its decoder and prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// How each is chosen.
    pub sampling: Sampling,
    /// Stop before this token (the model's end of sequence); `None`: never.
    pub eos: Option<u32>,
    /// Recompute the whole sequence for every token instead of using the key/value cache
    /// (the same tokens, slower: a check of the cache).
    pub recompute: bool,
}

/// The new tokens of a prompt's continuation, one per call to `next`.
pub struct Generation<'a> {
    decoder: Decoder<'a>,
    cache: KvCache,
    logits: Vec<f32>,
    ids: Vec<u32>,
    options: GenerateOptions,
    rng: SplitMix,
    made: usize,
}

impl<'a> Generation<'a> {
    /// The continuation of `prompt` (non-empty, ids below the vocabulary) by `decoder`,
    /// whose positions must hold the prompt and the new tokens.
    pub fn new(decoder: Decoder<'a>, prompt: &[u32], options: GenerateOptions) -> Self {
        let mut cache = decoder.cache();
        let logits = decoder.forward(prompt, &mut cache);
        Generation {
            decoder,
            cache,
            logits,
            ids: prompt.to_vec(),
            rng: SplitMix(options.sampling.seed),
            options,
            made: 0,
        }
    }

    /// The prompt and every token generated so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

impl Iterator for Generation<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.made == self.options.max_new_tokens {
            return None;
        }
        let s = self.options.sampling;
        let next = pick(&self.logits, s.temperature, s.top_p, &mut self.rng);
        if Some(next) == self.options.eos {
            self.made = self.options.max_new_tokens;
            return None;
        }
        self.ids.push(next);
        self.made += 1;
        if self.made < self.options.max_new_tokens {
            self.logits = if self.options.recompute {
                self.decoder.forward(&self.ids, &mut self.decoder.cache())
            } else {
                self.decoder.forward(&[next], &mut self.cache)
            };
        }
        Some(next)
    }
}

/// The next token: the most probable (the first on ties) at temperature 0, else a sample
/// from the softmax at `temperature` restricted to the smallest set of most probable tokens
/// whose probability reaches `top_p`.
pub fn pick(logits: &[f32], temperature: f64, top_p: f64, rng: &mut SplitMix) -> u32 {
    if temperature == 0.0 {
        let mut best = 0;
        for (i, &z) in logits.iter().enumerate() {
            if z > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &z)| (i, ((z as f64 - max) / temperature).exp()))
        .collect();
    let sum: f64 = p.iter().map(|x| x.1).sum();
    p.iter_mut().for_each(|x| x.1 /= sum);
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0.0;
    let mut n = 0;
    while n < p.len() && (n == 0 || kept < top_p) {
        kept += p[n].1;
        n += 1;
    }
    let mut u = rng.next_f64() * kept;
    for &(i, q) in &p[..n] {
        if u < q {
            return i as u32;
        }
        u -= q;
    }
    p[n - 1].0 as u32
}

/// SplitMix64: the sampling's random numbers, from the seed alone.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next number, uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum_and_top_p_keeps_the_nucleus() {
        let mut rng = SplitMix(1);
        assert_eq!(pick(&[0.0, 3.0, 3.0, 1.0], 0.0, 1.0, &mut rng), 1);
        // One token holds 99.9% of the mass: a nucleus of 0.5 is that token alone.
        let logits = [0.0, 10.0, 0.0, 0.0];
        for _ in 0..100 {
            assert_eq!(pick(&logits, 1.0, 0.5, &mut rng), 1);
        }
        // Uniform logits at top_p 1: every token comes up.
        let mut seen = [0; 4];
        for _ in 0..400 {
            seen[pick(&[1.0; 4], 1.0, 1.0, &mut rng) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    }
}
