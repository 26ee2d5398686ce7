//! Token stores: the flat token streams a sampler cuts into windows, whatever the format on
//! disk, and how a path names one.
//!
//! * [`TokenFile`]: ferrotron's `.bin` + `.bin.json` sidecar.
//! * [`MegatronFile`]: Megatron/NeMo's indexed dataset, `PREFIX.bin` + `PREFIX.idx`.
//!
//! [`locate`] tells them apart: a path whose `<path>.json` sidecar exists is a token file;
//! a path `P` (or `P.bin`, `P.idx`) with `P.idx` beside it is a Megatron prefix.

use std::fmt::Debug;
use std::path::{Path, PathBuf};

use crate::{DataError, DataFingerprint, MegatronFile, TokenFile};

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

/// The format a data path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Located {
    /// A ferrotron token file (the `.bin` path; its sidecar is `<path>.json`).
    Tokens(PathBuf),
    /// A Megatron indexed dataset, by its prefix (`PREFIX.bin` + `PREFIX.idx`).
    Megatron(PathBuf),
}

/// What `path` names: a token file when its sidecar `<path>.json` exists; a Megatron prefix
/// when `path.idx` exists, or `path` ends in `.bin`/`.idx` and the `.idx` beside it does;
/// otherwise a token file (opening it then names what is missing).
pub fn locate(path: &Path) -> Located {
    if crate::sidecar_path(path).exists() {
        return Located::Tokens(path.to_owned());
    }
    if crate::megatron::idx_path(path).exists() {
        return Located::Megatron(path.to_owned());
    }
    if matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("bin" | "idx")
    ) {
        let prefix = path.with_extension("");
        if crate::megatron::idx_path(&prefix).exists() {
            return Located::Megatron(prefix);
        }
    }
    Located::Tokens(path.to_owned())
}

/// Opens the token store `path` names (see [`locate`]) and checks it.
///
/// # Errors
///
/// As [`TokenFile::open`] or [`MegatronFile::open`].
pub fn open_tokens(path: &Path) -> Result<Box<dyn TokenStore>, DataError> {
    Ok(match locate(path) {
        Located::Tokens(p) => Box::new(TokenFile::open(&p)?),
        Located::Megatron(prefix) => Box::new(MegatronFile::open(&prefix)?),
    })
}

/// Checks, before any work, that the data `path` names fits a model of `model_vocab` ids:
/// from the sidecar alone for a token file; a Megatron dataset is opened and scanned (its
/// index records no vocabulary).
///
/// # Errors
///
/// As [`open_tokens`], and [`DataError::VocabTooLarge`].
pub fn check_vocab_of(path: &Path, model_vocab: usize) -> Result<(), DataError> {
    match locate(path) {
        Located::Tokens(p) => crate::token_file::check_sidecar_vocab(&p, model_vocab),
        Located::Megatron(prefix) => MegatronFile::open(&prefix)?.check_vocab(model_vocab),
    }
}

/// What the data `path` names holds: a token file from its sidecar where it records the
/// SHA-256 (no pass over the tokens), a Megatron dataset by hashing its two files.
///
/// # Errors
///
/// As [`open_tokens`].
pub fn fingerprint_of(path: &Path) -> Result<DataFingerprint, DataError> {
    match locate(path) {
        Located::Tokens(p) => crate::token_file::sidecar_fingerprint(&p),
        Located::Megatron(prefix) => Ok(MegatronFile::open(&prefix)?.fingerprint()),
    }
}
