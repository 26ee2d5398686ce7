//! How a data path names a token store: [`locate`] tells the formats apart, a path whose
//! `<path>.json` sidecar exists is a token file; a path `P` (or `P.bin`, `P.idx`) with
//! `P.idx` beside it is a Megatron prefix.

use std::path::{Path, PathBuf};

use crate::{DataError, DataFingerprint, MegatronFile, TokenFile, TokenStore};

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
