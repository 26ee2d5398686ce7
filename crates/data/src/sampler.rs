//! Cutting a token store (a token file or a Megatron dataset) into training sequences, shuffled per epoch.
//!
//! # How a file is cut into sequences
//!
//! For a sequence length `seq_len`, a file of `len` tokens is cut into **windows** of
//! `seq_len + 1` tokens (the inputs plus their next-token targets) with stride `seq_len`:
//! window `w` covers tokens `[w * seq_len, w * seq_len + seq_len + 1)`. Consecutive windows
//! share one token (the last target of one is the first input of the next), so every token
//! but the first is a target exactly once. There are `(len - 1) / seq_len` windows; the
//! trailing tokens that do not fill a whole window are dropped.
//!
//! [`FileSampler`] visits the windows in a fresh shuffled order every epoch (sample index
//! `i` is in epoch `i / windows`); [`eval_window`] reads them in file order.

use std::sync::{Arc, Mutex};

use crate::{DataError, DataSource, TokenStore};

/// Number of windows of `seq_len + 1` tokens (stride `seq_len`) in `file`; see the
/// [module docs](self).
///
/// # Errors
///
/// [`DataError::ZeroSeqLen`], or [`DataError::SeqLenTooLong`] when not even one window fits.
pub fn eval_windows(file: &dyn TokenStore, seq_len: usize) -> Result<usize, DataError> {
    if seq_len == 0 {
        return Err(DataError::ZeroSeqLen {
            path: file.path().to_owned(),
        });
    }
    let windows = file.len().saturating_sub(1) / seq_len;
    if windows == 0 {
        return Err(DataError::SeqLenTooLong {
            path: file.path().to_owned(),
            seq_len,
            tokens: file.len(),
            needed: seq_len.saturating_add(1),
        });
    }
    Ok(windows)
}

/// Reads window `w` (tokens `[w * seq_len, w * seq_len + seq_len + 1)`) in file order, no
/// shuffling, into `out`, which must hold exactly `seq_len + 1` tokens.
///
/// # Errors
///
/// The errors of [`eval_windows`], and [`DataError::OutOfRange`] if `w` is not below the
/// window count or `out.len() != seq_len + 1`.
pub fn eval_window(
    file: &dyn TokenStore,
    seq_len: usize,
    w: usize,
    out: &mut [u32],
) -> Result<(), DataError> {
    let windows = eval_windows(file, seq_len)?;
    if w >= windows {
        return Err(DataError::OutOfRange {
            path: file.path().to_owned(),
            what: "window",
            detail: format!("window {w} requested, seq_len={seq_len} gives {windows} windows"),
        });
    }
    if out.len() != seq_len + 1 {
        return Err(DataError::OutOfRange {
            path: file.path().to_owned(),
            what: "output buffer",
            detail: format!(
                "it holds {} tokens, a window has seq_len+1 = {}",
                out.len(),
                seq_len + 1
            ),
        });
    }
    file.read(w * seq_len, out)
}

/// The splitmix64 generator: tiny, fast, and identical on every platform.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

/// The splitmix64 output function, also used to derive seeds.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SplitMix64 {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// The stream for `(seed, epoch)`.
    fn for_epoch(seed: u64, epoch: u64) -> Self {
        SplitMix64(mix64(
            seed.wrapping_add(mix64(epoch.wrapping_add(Self::GAMMA))),
        ))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        mix64(self.0)
    }

    /// Uniform in `0..n` (`n > 0`), unbiased (Lemire's multiply-and-reject).
    fn below(&mut self, n: u64) -> u64 {
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

/// The Fisher–Yates permutation of `0..n` for `(seed, epoch)`.
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..n).collect();
    let mut rng = SplitMix64::for_epoch(seed, epoch);
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        perm.swap(i, j);
    }
    perm
}

/// Cached permutations: the two most recently used epochs, so samples of a batch that
/// straddles an epoch boundary do not recompute them back and forth.
type EpochCache = [Option<(u64, Arc<Vec<usize>>)>; 2];

/// A [`DataSource`] over a [`TokenStore`] (a [`TokenFile`](crate::TokenFile) or a
/// [`MegatronFile`](crate::MegatronFile)): sample `index` is window `perm_e[index % W]`,
/// where `W` is the window count, `e = index / W` is the epoch and `perm_e` a Fisher–Yates
/// permutation of `0..W` drawn from splitmix64 seeded with `(seed, e)`.
///
/// Each epoch visits every window exactly once. The order depends only on `(seed, index)`,
/// so it is the same across runs, thread counts and platforms. See the
/// [module docs](self) for how the file is cut into windows.
#[derive(Debug)]
pub struct FileSampler {
    file: Box<dyn TokenStore>,
    seq_len: usize,
    windows: usize,
    seed: u64,
    cache: Mutex<EpochCache>,
}

impl FileSampler {
    /// A sampler of `seq_len + 1`-token windows of `file`, shuffled with `seed`.
    ///
    /// # Errors
    ///
    /// [`DataError::ZeroSeqLen`], or [`DataError::SeqLenTooLong`] when the file holds fewer
    /// than `seq_len + 1` tokens.
    pub fn new(
        file: impl TokenStore + 'static,
        seq_len: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        let file: Box<dyn TokenStore> = Box::new(file);
        let windows = eval_windows(&file, seq_len)?;
        Ok(FileSampler {
            file,
            seq_len,
            windows,
            seed,
            cache: Mutex::new([None, None]),
        })
    }

    /// Number of windows, i.e. samples per epoch.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// The sequence length (each sample has `seq_len + 1` tokens).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The underlying token store.
    pub fn file(&self) -> &dyn TokenStore {
        self.file.as_ref()
    }

    /// The window that sample `index` reads (in file order, `0..windows()`).
    pub fn window_of(&self, index: u64) -> usize {
        let w = self.windows as u64;
        let perm = self.epoch_permutation(index / w);
        perm[(index % w) as usize]
    }

    /// The permutation of `epoch`, from the cache or freshly computed.
    fn epoch_permutation(&self, epoch: u64) -> Arc<Vec<usize>> {
        // A poisoned lock only means another thread panicked mid-update of a cache whose
        // entries are always complete; the data is still valid.
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(hit) = cache.iter().flatten().find(|(e, _)| *e == epoch) {
            return Arc::clone(&hit.1);
        }
        let perm = Arc::new(permutation(self.windows, self.seed, epoch));
        cache[1] = cache[0].take();
        cache[0] = Some((epoch, Arc::clone(&perm)));
        perm
    }
}

impl DataSource for FileSampler {
    /// Writes window `perm_e[index % W]` into `out` (`out.len()` must be `seq_len + 1`;
    /// a shorter buffer gets the window's first `out.len()` tokens, a longer one is only
    /// filled up to `seq_len + 1`).
    fn sample(&self, index: u64, out: &mut [u32]) {
        debug_assert_eq!(
            out.len(),
            self.seq_len + 1,
            "sample buffer must hold seq_len + 1 tokens"
        );
        let n = out.len().min(self.seq_len + 1);
        let start = self.window_of(index) * self.seq_len;
        self.file.copy_into(start, &mut out[..n]);
    }

    fn vocab_size(&self) -> usize {
        self.file.vocab_size()
    }
    fn fingerprint(&self) -> crate::DataFingerprint {
        self.file.fingerprint()
    }

    /// Two cached epochs' permutations and, while a third is built, that one: one `usize`
    /// per window each.
    fn cache_bytes(&self) -> usize {
        3 * self.windows * std::mem::size_of::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // First outputs of splitmix64 seeded with 0 (reference values of the published
        // algorithm).
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn permutation_is_a_permutation_and_fixed() {
        let p = permutation(10, 42, 0);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(p, permutation(10, 42, 0));
        assert_ne!(p, permutation(10, 42, 1));
        assert_ne!(p, permutation(10, 43, 0));
        assert_eq!(permutation(1, 7, 3), vec![0]);
    }

    #[test]
    fn below_stays_in_range() {
        let mut r = SplitMix64::for_epoch(1, 2);
        let mut seen = [0u32; 3];
        for _ in 0..3000 {
            seen[r.below(3) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| (900..1100).contains(&c)), "{seen:?}");
    }
}
