//! Token sources.
//!
//! Every source maps a **global sample index** to `seq_len + 1` tokens (inputs and their
//! next-token targets). The index depends only on (step, micro-batch, sample), never on the
//! parallel layout, so every layout sees the same data in the same order.
//!
//! * [`synthetic`]: the embedded synthetic corpus.
//! * [`token_file`]: the on-disk token format ([`TokenFile`], [`write_token_file`],
//!   [`TokenFileWriter`]).
//! * [`megatron`]: Megatron/NeMo indexed datasets ([`MegatronFile`], [`MegatronWriter`]).
//! * [`store`]: what both are to a sampler ([`TokenStore`]); [`open`]: how a path names one
//!   ([`open_tokens`]).
//! * [`blend`]: several corpora mixed by weight ([`Blend`]).
//! * [`sampler`]: how a token store is cut into sequences and shuffled ([`FileSampler`],
//!   [`eval_windows`], [`eval_window`]).

#![warn(missing_docs)]

pub mod blend;
pub mod corpus_writer;
pub mod documents;
pub mod error;
pub mod fingerprint;
pub mod megatron;
pub mod open;
pub mod sampler;
pub mod store;
pub mod synthetic;
pub mod token_file;

pub use blend::Blend;
pub use corpus_writer::{CorpusWriter, Format};
pub use documents::document_starts;
pub use error::DataError;
pub use fingerprint::{BlendedData, DataFingerprint};
pub use megatron::{MegatronFile, MegatronWriter};
pub use open::{check_vocab_of, fingerprint_of, locate, open_tokens, Located};
pub use sampler::{eval_window, eval_windows, FileSampler};
pub use store::TokenStore;
pub use token_file::{
    read_sidecar_of, sidecar_path, write_atomic, write_token_file, Dtype, Sidecar, TokenFile,
    TokenFileWriter,
};

/// A deterministic map from global sample index to tokens.
pub trait DataSource: Send + Sync {
    /// Writes the `out.len()` (= seq_len + 1) tokens of sample `index` into `out`.
    fn sample(&self, index: u64, out: &mut [u32]);
    /// Size of the vocabulary the tokens are drawn from (every id is below it).
    fn vocab_size(&self) -> usize;
    /// The most heap memory the source keeps between samples (caches), in bytes.
    fn cache_bytes(&self) -> usize {
        0
    }
    /// What the tokens are (recorded in checkpoints, checked on resume).
    fn fingerprint(&self) -> DataFingerprint;
}
