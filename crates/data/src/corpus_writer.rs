//! One writer for either output format of `prepare-data`.

use std::path::{Path, PathBuf};

use crate::{DataError, MegatronWriter, TokenFileWriter};

/// The on-disk format a corpus is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// ferrotron's token file: `.bin` + `.bin.json` sidecar.
    #[default]
    Tokens,
    /// Megatron's indexed dataset: `PREFIX.bin` + `PREFIX.idx`, one sequence per document.
    Megatron,
}

impl Format {
    /// Where a corpus named `output` lies in this format: the token file itself, or the
    /// Megatron prefix (`output` without a `.bin`/`.idx` extension).
    pub fn target(self, output: &Path) -> PathBuf {
        match self {
            Format::Tokens => output.to_owned(),
            Format::Megatron => match output.extension().and_then(|e| e.to_str()) {
                Some("bin" | "idx") => output.with_extension(""),
                _ => output.to_owned(),
            },
        }
    }

    /// The files a corpus named `output` consists of.
    pub fn files(self, output: &Path) -> Vec<PathBuf> {
        let target = self.target(output);
        match self {
            Format::Tokens => vec![crate::sidecar_path(&target), target],
            Format::Megatron => vec![
                crate::megatron::bin_path(&target),
                crate::megatron::idx_path(&target),
            ],
        }
    }
}

/// A streaming, atomic writer of one corpus, document by document, in either [`Format`].
#[derive(Debug)]
pub enum CorpusWriter {
    /// A token file.
    Tokens(TokenFileWriter),
    /// A Megatron dataset.
    Megatron(MegatronWriter),
}

impl CorpusWriter {
    /// Starts writing the corpus `output` (see [`Format::target`]) for ids below
    /// `vocab_size`.
    ///
    /// # Errors
    ///
    /// As [`TokenFileWriter::create`] and [`MegatronWriter::create`].
    pub fn create(
        format: Format,
        output: &Path,
        vocab_size: usize,
    ) -> Result<CorpusWriter, DataError> {
        let target = format.target(output);
        Ok(match format {
            Format::Tokens => CorpusWriter::Tokens(TokenFileWriter::create(&target, vocab_size)?),
            Format::Megatron => {
                CorpusWriter::Megatron(MegatronWriter::create(&target, vocab_size)?)
            }
        })
    }

    /// Records the `tokenizer.json` the ids come from, where the format has room for it
    /// (the token file's sidecar; a Megatron index has none).
    pub fn set_tokenizer(&mut self, path: PathBuf) {
        if let CorpusWriter::Tokens(w) = self {
            w.set_tokenizer(path);
        }
    }

    /// Appends one document.
    ///
    /// # Errors
    ///
    /// As the format's writer.
    pub fn push_document(&mut self, document: &[u32]) -> Result<(), DataError> {
        match self {
            CorpusWriter::Tokens(w) => w.push(document),
            CorpusWriter::Megatron(w) => w.push(document),
        }
    }

    /// Commits the files; returns the number of tokens written.
    ///
    /// # Errors
    ///
    /// As the format's writer (nothing is left under the final names on error).
    pub fn finish(self) -> Result<u64, DataError> {
        match self {
            CorpusWriter::Tokens(w) => w.finish(),
            CorpusWriter::Megatron(w) => w.finish(),
        }
    }
}
