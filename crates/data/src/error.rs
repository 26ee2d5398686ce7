//! The error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while writing, opening or sampling a token file.
///
/// Every message names the file involved and, where there is one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An operating-system call on `path` failed.
    #[error("could not {action} {path}: {source}")]
    Io {
        /// What was being done, e.g. "create", "read", "rename to".
        action: &'static str,
        /// The file the call was made on.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A file that must exist does not.
    #[error("{path} does not exist: {hint}")]
    MissingFile {
        /// The missing file.
        path: PathBuf,
        /// How to produce it.
        hint: &'static str,
    },

    /// The JSON sidecar could not be parsed or holds inconsistent values.
    #[error(
        "bad token-file sidecar {path}: {reason}; re-create the token file with `prepare-data`"
    )]
    BadSidecar {
        /// The sidecar file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// The `.bin` file's length disagrees with the sidecar's `num_tokens`.
    #[error(
        "{path} is {what}: sidecar says {num_tokens} tokens ({expected_bytes} bytes) but the file \
         has {actual_bytes} bytes; the file was damaged or only partly copied, re-create or \
         re-copy it"
    )]
    SizeMismatch {
        /// The `.bin` file.
        path: PathBuf,
        /// "truncated" or "longer than its sidecar says".
        what: &'static str,
        /// Token count from the sidecar.
        num_tokens: u64,
        /// Byte length the sidecar implies.
        expected_bytes: u64,
        /// Byte length on disk.
        actual_bytes: u64,
    },

    /// A token id is not below the vocabulary size.
    #[error(
        "{path}: token {position} is {id}, which is not below vocab_size {vocab_size}; the \
         tokenizer and the vocab_size do not match (or the file is corrupted)"
    )]
    TokenOutOfRange {
        /// The token file being written or read.
        path: PathBuf,
        /// Index of the offending token in the file.
        position: u64,
        /// The offending id.
        id: u32,
        /// The vocabulary size it was checked against.
        vocab_size: usize,
    },

    /// A vocabulary size that cannot be stored (0, or above 2^32).
    #[error("{path}: vocab_size {vocab_size} is invalid: it must be between 1 and 4294967296")]
    InvalidVocabSize {
        /// The token file.
        path: PathBuf,
        /// The rejected size.
        vocab_size: u64,
    },

    /// The token file has no tokens.
    #[error("{path} holds no tokens; give prepare-data at least one non-empty document")]
    Empty {
        /// The token file.
        path: PathBuf,
    },

    /// The file's vocabulary does not fit the model's.
    #[error(
        "data file {path} has vocab_size {file_vocab} but model.vocab is {model_vocab}: set \
         model.vocab to at least {file_vocab}, or tokenize the data with a tokenizer of at most \
         {model_vocab} ids"
    )]
    VocabTooLarge {
        /// The token file.
        path: PathBuf,
        /// vocab_size from the sidecar.
        file_vocab: usize,
        /// The model's vocabulary size.
        model_vocab: usize,
    },

    /// seq_len is 0.
    #[error("{path}: seq_len must be at least 1")]
    ZeroSeqLen {
        /// The token file.
        path: PathBuf,
    },

    /// Not even one window of `seq_len + 1` tokens fits in the file.
    #[error(
        "seq_len={seq_len} is longer than the data: file {path} has {tokens} tokens, need at \
         least {needed}; use a shorter seq_len or more data"
    )]
    SeqLenTooLong {
        /// The token file.
        path: PathBuf,
        /// The requested sequence length.
        seq_len: usize,
        /// Tokens in the file.
        tokens: usize,
        /// seq_len + 1.
        needed: usize,
    },

    /// A Megatron indexed dataset that cannot be read as one.
    #[error("{path}: {reason}")]
    Megatron {
        /// The `.idx` or `.bin` file at fault.
        path: PathBuf,
        /// What is wrong, and the fix.
        reason: String,
    },

    /// A blend of corpora that cannot be drawn as asked.
    #[error("data.blend: {reason}")]
    Blend {
        /// What is wrong, and the fix.
        reason: String,
    },

    /// A read past the end of the file, or a window index past the last window.
    #[error("{path}: {what} is out of range ({detail})")]
    OutOfRange {
        /// The token file.
        path: PathBuf,
        /// What was out of range, e.g. "read" or "window".
        what: &'static str,
        /// The numbers involved.
        detail: String,
    },
}

impl DataError {
    /// Shorthand for [`DataError::Io`].
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        DataError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
