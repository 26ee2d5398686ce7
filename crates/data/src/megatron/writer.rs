//! Writing a Megatron indexed dataset, one document at a time, atomically.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use super::{bin_path, idx_path, MegatronDtype, MAGIC, VERSION};
use crate::token_file::{
    append, remove_if_present, rename, seal, sync_parent, temp_path, write_synced,
};
use crate::DataError;

/// A streaming writer of `PREFIX.bin` + `PREFIX.idx`: each [`MegatronWriter::push`] is one
/// document of one sequence, as Megatron's `preprocess_data.py` writes them (ids as
/// [`MegatronDtype::for_vocab`] picks).
///
/// Both files are written under temporary names and renamed into place by
/// [`MegatronWriter::finish`], the index last (a crash between the renames leaves a `.bin`
/// without its index, a clear error, never a stale pair). Dropping the writer without
/// `finish` removes the temporary files.
#[derive(Debug)]
pub struct MegatronWriter {
    prefix: PathBuf,
    tmp: PathBuf,
    idx_tmp: PathBuf,
    out: Option<BufWriter<File>>,
    dtype: MegatronDtype,
    vocab_size: usize,
    sizes: Vec<i32>,
    tokens: u64,
    buf: Vec<u8>,
}

impl MegatronWriter {
    /// Starts writing the dataset `prefix` for ids below `vocab_size`.
    ///
    /// # Errors
    ///
    /// [`DataError::InvalidVocabSize`], or [`DataError::Io`] when the temporary file cannot
    /// be created.
    pub fn create(prefix: &Path, vocab_size: usize) -> Result<MegatronWriter, DataError> {
        crate::token_file::check_vocab_size(prefix, vocab_size as u64)?;
        if vocab_size > i32::MAX as usize {
            return Err(DataError::InvalidVocabSize {
                path: prefix.to_owned(),
                vocab_size: vocab_size as u64,
            });
        }
        let bin = bin_path(prefix);
        let tmp = temp_path(&bin)?;
        let idx_tmp = temp_path(&idx_path(prefix))?;
        let file = File::create(&tmp).map_err(|e| DataError::io("create", &tmp, e))?;
        Ok(MegatronWriter {
            prefix: prefix.to_owned(),
            tmp,
            idx_tmp,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            dtype: MegatronDtype::for_vocab(vocab_size),
            vocab_size,
            sizes: Vec::new(),
            tokens: 0,
            buf: Vec::new(),
        })
    }

    /// Appends one document.
    ///
    /// # Errors
    ///
    /// [`DataError::TokenOutOfRange`] (nothing of the document is written), a document of
    /// more than `i32::MAX` tokens ([`DataError::Megatron`]), or [`DataError::Io`].
    pub fn push(&mut self, document: &[u32]) -> Result<(), DataError> {
        let bin = bin_path(&self.prefix);
        crate::token_file::check_tokens(&bin, document, self.vocab_size, self.tokens)?;
        let size = i32::try_from(document.len()).map_err(|_| DataError::Megatron {
            path: bin.clone(),
            reason: format!(
                "a document of {} tokens: Megatron's index stores sizes as i32",
                document.len()
            ),
        })?;
        self.buf.clear();
        for &t in document {
            match self.dtype {
                // Checked above: t < vocab_size < 65,500.
                MegatronDtype::U16 => self.buf.extend_from_slice(&(t as u16).to_le_bytes()),
                // Ids up to 2^31 - 1 as i32 (vocabularies of 2^31 ids do not exist).
                _ => self.buf.extend_from_slice(&(t as i32).to_le_bytes()),
            }
        }
        append(&mut self.out, &self.tmp, &self.buf)?;
        self.sizes.push(size);
        self.tokens += document.len() as u64;
        Ok(())
    }

    /// Tokens pushed so far.
    pub fn num_tokens(&self) -> u64 {
        self.tokens
    }

    /// Flushes and fsyncs `.bin`, writes the index, renames both into place; returns the
    /// number of tokens written.
    ///
    /// # Errors
    ///
    /// [`DataError::Empty`] when no token was pushed, [`DataError::Io`] when a write, fsync
    /// or rename fails (the temporary files are removed).
    pub fn finish(mut self) -> Result<u64, DataError> {
        if self.tokens == 0 {
            return Err(DataError::Empty {
                path: bin_path(&self.prefix),
            });
        }
        seal(&mut self.out, &self.tmp)?;
        write_synced(&self.idx_tmp, &self.index_bytes())?;
        let idx = idx_path(&self.prefix);
        remove_if_present(&idx, "remove the old index")?;
        rename(&self.tmp, &bin_path(&self.prefix))?;
        rename(&self.idx_tmp, &idx)?;
        sync_parent(&idx);
        Ok(self.tokens)
    }

    /// The index of the documents pushed (one sequence each), per the module docs.
    fn index_bytes(&self) -> Vec<u8> {
        let n = self.sizes.len();
        let mut b = Vec::with_capacity(34 + 12 * n + 8 * (n + 1));
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(self.dtype.code());
        b.extend_from_slice(&(n as u64).to_le_bytes());
        b.extend_from_slice(&(n as u64 + 1).to_le_bytes());
        for s in &self.sizes {
            b.extend_from_slice(&s.to_le_bytes());
        }
        let mut pointer = 0i64;
        for &s in &self.sizes {
            b.extend_from_slice(&pointer.to_le_bytes());
            pointer += i64::from(s) * self.dtype.width() as i64;
        }
        for d in 0..=n as i64 {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b
    }
}

impl Drop for MegatronWriter {
    fn drop(&mut self) {
        // After `finish` both were renamed away; otherwise this cleans up a partial write.
        drop(self.out.take());
        let _ = std::fs::remove_file(&self.tmp);
        let _ = std::fs::remove_file(&self.idx_tmp);
    }
}
