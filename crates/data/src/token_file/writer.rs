//! Atomic writing of token files.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{check_vocab_size, sidecar_path, Dtype, Sidecar, FORMAT_NAME, FORMAT_VERSION};
use crate::DataError;

/// Writes `tokens` as a token file at `path` (plus the sidecar `<path>.json`).
///
/// Every token is checked against `vocab_size` before anything is written. Both files are
/// written atomically (temporary name in the same directory, fsync, rename).
///
/// # Errors
///
/// [`DataError::TokenOutOfRange`] for an id `>= vocab_size`, [`DataError::InvalidVocabSize`],
/// [`DataError::Empty`] for no tokens, and [`DataError::Io`] when writing fails.
pub fn write_token_file(path: &Path, tokens: &[u32], vocab_size: usize) -> Result<(), DataError> {
    check_vocab_size(path, vocab_size as u64)?;
    check_tokens(path, tokens, vocab_size, 0)?;
    if tokens.is_empty() {
        return Err(DataError::Empty {
            path: path.to_owned(),
        });
    }
    let mut w = TokenFileWriter::create(path, vocab_size)?;
    w.push(tokens)?;
    w.finish()?;
    Ok(())
}

/// Errors on the first token of `tokens` that is `>= vocab_size`; `offset` is the file
/// position of `tokens[0]`.
pub(crate) fn check_tokens(
    path: &Path,
    tokens: &[u32],
    vocab_size: usize,
    offset: u64,
) -> Result<(), DataError> {
    match tokens.iter().position(|&t| t as usize >= vocab_size) {
        Some(i) => Err(DataError::TokenOutOfRange {
            path: path.to_owned(),
            position: offset + i as u64,
            id: tokens[i],
            vocab_size,
        }),
        None => Ok(()),
    }
}

/// The temporary name `path` is written under: `.<name>.tmp` in the same directory.
pub(crate) fn temp_path(path: &Path) -> Result<PathBuf, DataError> {
    let name = path.file_name().ok_or_else(|| DataError::MissingFile {
        path: path.to_owned(),
        hint: "the output path must end in a file name, e.g. data/train.bin",
    })?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(".tmp");
    Ok(path.with_file_name(tmp))
}

/// Creates `tmp`, writes `bytes`, flushes and fsyncs it.
pub(crate) fn write_synced(tmp: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let mut f = File::create(tmp).map_err(|e| DataError::io("create", tmp, e))?;
    f.write_all(bytes)
        .map_err(|e| DataError::io("write", tmp, e))?;
    f.sync_all().map_err(|e| DataError::io("fsync", tmp, e))
}

/// Renames `from` to `to`.
pub(crate) fn rename(from: &Path, to: &Path) -> Result<(), DataError> {
    std::fs::rename(from, to).map_err(|e| DataError::Io {
        action: "rename a temporary file to",
        path: to.to_owned(),
        source: e,
    })
}

/// Best-effort fsync of the directory holding `path`, so the renames survive a crash.
pub(crate) fn sync_parent(path: &Path) {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Appends `bytes` to the stream `out` writing the temporary file `tmp`.
pub(crate) fn append(
    out: &mut Option<BufWriter<File>>,
    tmp: &Path,
    bytes: &[u8],
) -> Result<(), DataError> {
    let out = out.as_mut().ok_or_else(|| DataError::Io {
        action: "write",
        path: tmp.to_owned(),
        source: std::io::Error::other("writer already failed"),
    })?;
    out.write_all(bytes)
        .map_err(|e| DataError::io("write", tmp, e))
}

/// Flushes, fsyncs and closes the stream `out` writing the temporary file `tmp`.
pub(crate) fn seal(out: &mut Option<BufWriter<File>>, tmp: &Path) -> Result<(), DataError> {
    let out = out.take().ok_or_else(|| DataError::Io {
        action: "finish",
        path: tmp.to_owned(),
        source: std::io::Error::other("writer already failed"),
    })?;
    let file = out
        .into_inner()
        .map_err(|e| DataError::io("flush", tmp, e.into_error()))?;
    file.sync_all().map_err(|e| DataError::io("fsync", tmp, e))
}

/// Removes `path` if it exists (`action` names the removal in an error).
pub(crate) fn remove_if_present(path: &Path, action: &'static str) -> Result<(), DataError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(DataError::io(action, path, e)),
    }
}

/// Writes `bytes` to `path` atomically: to `.<name>.tmp` in the same directory, flush,
/// fsync, rename. Either the old file or the complete new one is under `path`, never a
/// partial one.
///
/// # Errors
///
/// [`DataError::Io`] naming the file whose write, fsync or rename failed; the temporary
/// file is removed in that case.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let tmp = temp_path(path)?;
    let result = write_synced(&tmp, bytes).and_then(|()| rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    } else {
        sync_parent(path);
    }
    result
}

/// A streaming, atomic token-file writer for inputs too big to hold in memory.
///
/// Tokens go to `.<name>.tmp` next to the final file; [`TokenFileWriter::finish`] fsyncs it,
/// writes the sidecar the same way and renames both into place. Dropping the writer without
/// `finish` (e.g. on an error) removes the temporary files and leaves the final names
/// untouched.
#[derive(Debug)]
pub struct TokenFileWriter {
    path: PathBuf,
    tmp: PathBuf,
    sidecar_tmp: PathBuf,
    out: Option<BufWriter<File>>,
    dtype: Dtype,
    vocab_size: usize,
    num_tokens: u64,
    buf: Vec<u8>,
    tokenizer: Option<PathBuf>,
    hash: crate::fingerprint::StreamHash,
}

impl TokenFileWriter {
    /// Starts writing a token file at `path` for ids below `vocab_size`.
    ///
    /// # Errors
    ///
    /// [`DataError::InvalidVocabSize`], or [`DataError::Io`] when the temporary file cannot
    /// be created (e.g. the directory does not exist).
    pub fn create(path: &Path, vocab_size: usize) -> Result<TokenFileWriter, DataError> {
        check_vocab_size(path, vocab_size as u64)?;
        let tmp = temp_path(path)?;
        let sidecar_tmp = temp_path(&sidecar_path(path))?;
        let file = File::create(&tmp).map_err(|e| DataError::io("create", &tmp, e))?;
        Ok(TokenFileWriter {
            path: path.to_owned(),
            tmp,
            sidecar_tmp,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            dtype: Dtype::for_vocab(vocab_size),
            vocab_size,
            num_tokens: 0,
            buf: Vec::new(),
            tokenizer: None,
            hash: Default::default(),
        })
    }

    /// Records in the sidecar the `tokenizer.json` the ids come from (see
    /// [`Sidecar::tokenizer`]).
    pub fn set_tokenizer(&mut self, path: PathBuf) {
        self.tokenizer = Some(path);
    }

    /// Appends `tokens`.
    ///
    /// # Errors
    ///
    /// [`DataError::TokenOutOfRange`] (nothing of this call is written then) or
    /// [`DataError::Io`].
    pub fn push(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        check_tokens(&self.path, tokens, self.vocab_size, self.num_tokens)?;
        self.buf.clear();
        match self.dtype {
            Dtype::U16 => {
                for &t in tokens {
                    // Checked above: t < vocab_size <= 65536.
                    self.buf.extend_from_slice(&(t as u16).to_le_bytes());
                }
            }
            Dtype::U32 => {
                for &t in tokens {
                    self.buf.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        append(&mut self.out, &self.tmp, &self.buf)?;
        self.hash.update(&self.buf);
        self.num_tokens += tokens.len() as u64;
        Ok(())
    }

    /// Tokens pushed so far.
    pub fn num_tokens(&self) -> u64 {
        self.num_tokens
    }

    /// Flushes, fsyncs, writes the sidecar and renames both files into place. Returns the
    /// number of tokens written.
    ///
    /// # Errors
    ///
    /// [`DataError::Empty`] if no token was pushed, [`DataError::Io`] when a write, fsync or
    /// rename fails. The temporary files are removed on error.
    pub fn finish(mut self) -> Result<u64, DataError> {
        if self.num_tokens == 0 {
            return Err(DataError::Empty {
                path: self.path.clone(),
            });
        }
        seal(&mut self.out, &self.tmp)?;

        let sidecar = Sidecar {
            format: FORMAT_NAME.to_owned(),
            version: FORMAT_VERSION,
            dtype: self.dtype,
            vocab_size: self.vocab_size as u64,
            num_tokens: self.num_tokens,
            tokenizer: self.tokenizer.clone(),
            sha256: Some(std::mem::take(&mut self.hash).hex()),
        };
        let json = serde_json::to_vec(&sidecar).map_err(|e| DataError::BadSidecar {
            path: sidecar_path(&self.path),
            reason: e.to_string(),
        })?;
        write_synced(&self.sidecar_tmp, &json)?;

        // Remove a previous sidecar first: if we crash between the two renames, the new
        // `.bin` then has no sidecar (a clear error on open) rather than a stale one.
        let side = sidecar_path(&self.path);
        remove_if_present(&side, "remove the old sidecar")?;
        rename(&self.tmp, &self.path)?;
        rename(&self.sidecar_tmp, &side)?;
        sync_parent(&self.path);
        Ok(self.num_tokens)
    }
}

impl Drop for TokenFileWriter {
    fn drop(&mut self) {
        // After a successful `finish` both temporary files were renamed away and these
        // removals find nothing; otherwise they clean up a partial write.
        drop(self.out.take());
        let _ = std::fs::remove_file(&self.tmp);
        let _ = std::fs::remove_file(&self.sidecar_tmp);
    }
}
