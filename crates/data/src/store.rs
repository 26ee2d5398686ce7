//! Token stores: the flat token streams a sampler cuts into windows, whatever the format on
//! disk ([`TokenFile`](crate::TokenFile), [`MegatronFile`](crate::MegatronFile)).

use std::fmt::Debug;
use std::path::Path;

use crate::{DataError, DataFingerprint};

/// A validated, read-only stream of token ids (`Send + Sync`: many threads read at once).
pub trait TokenStore: Send + Sync + Debug {
    /// Number of tokens.
    fn len(&self) -> usize;
    /// Whether the store holds no token (never, once opened: empty files are refused).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Every id in the store is below this.
    fn vocab_size(&self) -> usize;
    /// The path the store was opened from (the `.bin` file, or the Megatron prefix).
    fn path(&self) -> &Path;
    /// What the store holds (recorded in checkpoints, checked on resume).
    fn fingerprint(&self) -> DataFingerprint;
    /// Copies tokens `start..start + out.len()`; the range must be in bounds
    /// (`start + out.len() <= len()`), else this panics like slice indexing.
    fn copy_into(&self, start: usize, out: &mut [u32]);

    /// Errors when the store's ids do not fit a model of `model_vocab` ids.
    ///
    /// # Errors
    ///
    /// [`DataError::VocabTooLarge`].
    fn check_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        if self.vocab_size() > model_vocab {
            return Err(DataError::VocabTooLarge {
                path: self.path().to_owned(),
                file_vocab: self.vocab_size(),
                model_vocab,
            });
        }
        Ok(())
    }

    /// Reads `out.len()` tokens starting at token `start` into `out`.
    ///
    /// # Errors
    ///
    /// [`DataError::OutOfRange`] if `start + out.len() > len()`.
    fn read(&self, start: usize, out: &mut [u32]) -> Result<(), DataError> {
        match start.checked_add(out.len()) {
            Some(end) if end <= self.len() => {
                self.copy_into(start, out);
                Ok(())
            }
            _ => Err(DataError::OutOfRange {
                path: self.path().to_owned(),
                what: "read",
                detail: format!(
                    "tokens {start}..{start}+{} requested, the file has {}",
                    out.len(),
                    self.len()
                ),
            }),
        }
    }
}

impl<T: TokenStore + ?Sized> TokenStore for Box<T> {
    fn len(&self) -> usize {
        (**self).len()
    }
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn path(&self) -> &Path {
        (**self).path()
    }
    fn fingerprint(&self) -> DataFingerprint {
        (**self).fingerprint()
    }
    fn copy_into(&self, start: usize, out: &mut [u32]) {
        (**self).copy_into(start, out)
    }
    fn check_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        (**self).check_vocab(model_vocab)
    }
}
