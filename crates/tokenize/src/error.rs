//! The error type of this crate.

use std::path::PathBuf;

use ferrotron_data::DataError;

/// Everything that can go wrong while reading inputs, tokenizing or training a tokenizer.
///
/// Every message names the file involved (and the line, for line-based inputs) and the fix.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// An operating-system call on `path` failed.
    #[error("could not {action} {path}: {source}")]
    Io {
        /// What was being done, e.g. "read".
        action: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// No input files were given.
    #[error("no input files given; pass at least one text or .jsonl file")]
    NoInputs,

    /// A Parquet input cannot be read as documents.
    #[error("input {path}: {reason}")]
    BadParquet {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },

    /// An option's value is out of range.
    #[error("{option}: {reason}")]
    BadOption {
        /// The option.
        option: &'static str,
        /// Why.
        reason: String,
    },

    /// A glob pattern is malformed.
    #[error("input pattern {pattern:?} is malformed: {reason}")]
    BadPattern {
        /// The pattern.
        pattern: String,
        /// Why.
        reason: String,
    },

    /// A glob pattern matches no file.
    #[error("input pattern {pattern:?} matches no file; check the path")]
    NoMatch {
        /// The pattern.
        pattern: String,
    },

    /// A directory input holds no file of a readable kind.
    #[error(
        "input directory {path} holds no .txt, .md, .jsonl, .json or .parquet file (compressed \
         .gz/.zst ones count too)"
    )]
    EmptyDirectory {
        /// The directory.
        path: PathBuf,
    },

    /// An input file does not exist.
    #[error("input {path} does not exist; check the path")]
    MissingInput {
        /// The missing input.
        path: PathBuf,
    },

    /// An input is a directory.
    #[error("input {path} is a directory; pass the files inside it instead")]
    InputIsDirectory {
        /// The directory.
        path: PathBuf,
    },

    /// An input is not valid UTF-8.
    #[error("{path}:{line}: not valid UTF-8; convert the file to UTF-8 (e.g. with iconv)")]
    NotUtf8 {
        /// The input file.
        path: PathBuf,
        /// 1-based line of the first invalid byte.
        line: u64,
    },

    /// A line of a JSON-lines file is not valid JSON.
    #[error("{path}:{line}: not a valid JSON line ({reason}); every line must be one JSON object")]
    BadJsonLine {
        /// The input file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The parser's message.
        reason: String,
    },

    /// A JSON line lacks the text field, or it is not a string.
    #[error(
        "{path}:{line}: {problem} field {field:?}; every line needs a string field {field:?} \
         (choose another field name with the JSON-field option)"
    )]
    BadField {
        /// The input file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// The configured field name.
        field: String,
        /// "no", or "a non-string" (e.g. a number).
        problem: &'static str,
    },

    /// A `tokenizer.json` could not be loaded or configured.
    #[error("could not load tokenizer {path}: {reason}; pass a Hugging Face tokenizer.json")]
    LoadTokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },

    /// The tokenizer failed to encode a document.
    #[error("tokenizer {path} failed to encode a document: {reason}")]
    Encode {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizer's message.
        reason: String,
    },

    /// The tokenizer failed to decode ids.
    #[error("tokenizer {path} failed to decode ids: {reason}")]
    Decode {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokenizer's message.
        reason: String,
    },

    /// BPE training failed.
    #[error("BPE training for {path} failed: {reason}")]
    Train {
        /// Where the tokenizer was to be saved.
        path: PathBuf,
        /// The trainer's message.
        reason: String,
    },

    /// The requested BPE vocabulary cannot even hold the byte alphabet.
    #[error(
        "BPE vocab_size {vocab_size} for {path} is too small: it must be at least {min} \
         (256 byte tokens + <|endoftext|>)"
    )]
    BpeVocabTooSmall {
        /// Where the tokenizer was to be saved.
        path: PathBuf,
        /// The requested size.
        vocab_size: usize,
        /// The smallest accepted size.
        min: usize,
    },

    /// Writing the token file (or another data-layer operation) failed.
    #[error(transparent)]
    Data(#[from] DataError),
}

impl TokenizeError {
    /// Shorthand for [`TokenizeError::Io`].
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        TokenizeError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
