//! Tokenizers and `prepare-data` for ferrotron.
//!
//! * [`ByteTokenizer`]: UTF-8 bytes (ids 0..=255) plus an end-of-document id 256.
//! * [`HfTokenizer`]: a Hugging Face `tokenizer.json`.
//! * [`TextCodec`]: a model directory's text in and out (its tokenizer, or bytes).
//! * [`train_bpe`]: train a byte-level BPE tokenizer and save its `tokenizer.json`.
//! * [`prepare_data`]: tokenize text / JSON-lines files into a ferrotron token file
//!   (see [`ferrotron_data::token_file`]).
//!
//! How input files become documents is described in [`input`].

#![warn(missing_docs)]

pub mod byte;
pub mod codec;
pub mod error;
pub mod hf;
pub mod input;
pub mod prepare;

pub mod parquet_input;
pub mod sources;

pub use byte::{ByteTokenizer, Tokenizer};
pub use codec::TextCodec;
pub use error::TokenizeError;
pub use hf::{train_bpe, HfTokenizer, BPE_EOS, EOS_NAMES};
pub use input::{documents, Document, Documents, ReadOptions};
pub use prepare::{
    prepare_data, val_path, PrepareOptions, PrepareReport, TokenizerChoice, ValidationReport,
};
