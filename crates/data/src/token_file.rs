//! Token files: a flat `.bin` of little-endian token ids plus a JSON sidecar.
//!
//! # Format
//!
//! * `data.bin`: `num_tokens` unsigned little-endian integers, nothing else. The width is
//!   2 bytes (`u16`) when `vocab_size <= 65536`, else 4 bytes (`u32`).
//! * `data.bin.json` (the `.bin` file's full name with `.json` appended), e.g.
//!   `{"format":"ferrotron-tokens","version":1,"dtype":"u16","vocab_size":257,"num_tokens":1000}`.
//!
//! Files are written atomically by [`write_token_file`] and [`TokenFileWriter`]: each file is
//! written under a temporary name in the same directory, flushed and fsynced, then renamed,
//! so a crash never leaves a half-written file under the final names.
//!
//! [`TokenFile::open`] checks the sidecar, the byte length and every token id before handing
//! out a memory-mapped view.

mod writer;

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::{DataError, TokenStore};

pub(crate) use writer::{
    append, check_tokens, remove_if_present, rename, seal, sync_parent, temp_path, write_synced,
};
pub use writer::{write_atomic, write_token_file, TokenFileWriter};

/// The `format` field every sidecar carries.
pub const FORMAT_NAME: &str = "ferrotron-tokens";
/// The sidecar `version` this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Width of one stored token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 2 bytes per token; vocabularies of at most 65536 ids.
    U16,
    /// 4 bytes per token.
    U32,
}

impl Dtype {
    /// The narrowest width that holds every id below `vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> Dtype {
        if vocab_size <= 1 << 16 {
            Dtype::U16
        } else {
            Dtype::U32
        }
    }

    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            Dtype::U16 => 2,
            Dtype::U32 => 4,
        }
    }
}

/// The contents of the JSON sidecar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sidecar {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// Always [`FORMAT_VERSION`].
    pub version: u32,
    /// Width of the stored ids.
    pub dtype: Dtype,
    /// Every id is below this.
    pub vocab_size: u64,
    /// Number of tokens in the `.bin` file.
    pub num_tokens: u64,
    /// The `tokenizer.json` the ids came from (an absolute path), where `prepare-data` used
    /// one: `train --save-model` puts a copy beside the model. Absent for bytes and in files
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Lowercase hex SHA-256 of the `.bin` bytes, computed as they were written (absent in
    /// files written before it was recorded: [`TokenFile::fingerprint`] then hashes the
    /// file once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// The validated sidecar of the token file `path` (`<path>.json`), without opening the
/// tokens: e.g. to find the tokenizer it records.
///
/// # Errors
///
/// As [`TokenFile::open`] for the sidecar.
pub fn read_sidecar_of(path: &Path) -> Result<Sidecar, DataError> {
    read_sidecar(path)
}

/// Checks from the sidecar alone (no pass over the tokens) that the token file `path` fits
/// a model of `model_vocab` ids: the check [`TokenStore::check_vocab`] makes, before any work.
pub(crate) fn check_sidecar_vocab(path: &Path, model_vocab: usize) -> Result<(), DataError> {
    let sidecar = read_sidecar(path)?;
    if sidecar.vocab_size > model_vocab as u64 {
        return Err(DataError::VocabTooLarge {
            path: path.to_owned(),
            file_vocab: usize::try_from(sidecar.vocab_size).unwrap_or(usize::MAX),
            model_vocab,
        });
    }
    Ok(())
}

/// What the token file `path` holds, from its sidecar where it records the SHA-256 (no
/// pass over the tokens), else by opening and hashing the file.
pub(crate) fn sidecar_fingerprint(path: &Path) -> Result<crate::DataFingerprint, DataError> {
    let sidecar = read_sidecar(path)?;
    match sidecar.sha256 {
        Some(sha256) => Ok(crate::DataFingerprint::File {
            path: path.to_owned(),
            num_tokens: sidecar.num_tokens,
            sha256,
        }),
        None => Ok(TokenFile::open(path)?.fingerprint()),
    }
}

/// The sidecar path of a token file: the full file name with `.json` appended
/// (`data.bin` -> `data.bin.json`).
pub fn sidecar_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".json");
    PathBuf::from(name)
}

/// Checks that `vocab_size` is storable (1 ..= 2^32).
pub(crate) fn check_vocab_size(path: &Path, vocab_size: u64) -> Result<(), DataError> {
    if vocab_size == 0 || vocab_size > 1 << 32 {
        return Err(DataError::InvalidVocabSize {
            path: path.to_owned(),
            vocab_size,
        });
    }
    Ok(())
}

/// A validated, memory-mapped token file.
///
/// Cheap to read from many threads at once (`Send + Sync`). The file must not be modified
/// by another process while it is open.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    dtype: Dtype,
    vocab_size: usize,
    len: usize,
    /// The sidecar's SHA-256, or the one computed on first use.
    sha256: std::sync::OnceLock<String>,
}

impl TokenFile {
    /// Opens `path` (the `.bin` file) and its sidecar `<path>.json`, and validates them.
    ///
    /// # Errors
    ///
    /// * either file is missing ([`DataError::MissingFile`], naming it);
    /// * the sidecar is not valid JSON or has wrong fields ([`DataError::BadSidecar`]);
    /// * the `.bin` length is not `num_tokens × width` ([`DataError::SizeMismatch`]);
    /// * the file has no tokens ([`DataError::Empty`]);
    /// * some id is `>= vocab_size` ([`DataError::TokenOutOfRange`], naming the first one).
    pub fn open(path: &Path) -> Result<TokenFile, DataError> {
        let sidecar = read_sidecar(path)?;
        let vocab_size =
            usize::try_from(sidecar.vocab_size).map_err(|_| DataError::InvalidVocabSize {
                path: path.to_owned(),
                vocab_size: sidecar.vocab_size,
            })?;
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(DataError::MissingFile {
                    path: path.to_owned(),
                    hint: "its sidecar exists but the token data does not; re-create the file with `prepare-data`",
                })
            }
            Err(e) => return Err(DataError::io("open", path, e)),
        };
        let actual_bytes = file
            .metadata()
            .map_err(|e| DataError::io("read the size of", path, e))?
            .len();
        let width = sidecar.dtype.width() as u64;
        let expected_bytes =
            sidecar
                .num_tokens
                .checked_mul(width)
                .ok_or_else(|| DataError::BadSidecar {
                    path: sidecar_path(path),
                    reason: format!("num_tokens {} is impossibly large", sidecar.num_tokens),
                })?;
        if actual_bytes != expected_bytes {
            return Err(DataError::SizeMismatch {
                path: path.to_owned(),
                what: if actual_bytes < expected_bytes {
                    "truncated"
                } else {
                    "longer than its sidecar says"
                },
                num_tokens: sidecar.num_tokens,
                expected_bytes,
                actual_bytes,
            });
        }
        if sidecar.num_tokens == 0 {
            return Err(DataError::Empty {
                path: path.to_owned(),
            });
        }
        let len = usize::try_from(sidecar.num_tokens).map_err(|_| DataError::BadSidecar {
            path: sidecar_path(path),
            reason: format!(
                "num_tokens {} does not fit this platform's address space",
                sidecar.num_tokens
            ),
        })?;
        // SAFETY: the map is read-only; the documented contract is that nobody modifies
        // the file while it is open. Every access below is bounds-checked against `len`,
        // which was checked against the file length above.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io("memory-map", path, e))?;
        let tf = TokenFile {
            path: path.to_owned(),
            map,
            dtype: sidecar.dtype,
            vocab_size,
            len,
            sha256: std::sync::OnceLock::new(),
        };
        if let Some(sha) = sidecar.sha256 {
            let _ = tf.sha256.set(sha);
        }
        tf.check_ids()?;
        Ok(tf)
    }

    /// Errors on the first id that is `>= vocab_size`.
    fn check_ids(&self) -> Result<(), DataError> {
        let bad = match self.dtype {
            Dtype::U16 => self
                .map
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
                .enumerate()
                .find(|&(_, id)| id as usize >= self.vocab_size),
            Dtype::U32 => self
                .map
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .enumerate()
                .find(|&(_, id)| id as usize >= self.vocab_size),
        };
        match bad {
            Some((position, id)) => Err(DataError::TokenOutOfRange {
                path: self.path.clone(),
                position: position as u64,
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Width of the stored ids.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Token `i`.
    ///
    /// # Panics
    ///
    /// If `i >= len()`, like slice indexing.
    pub fn get(&self, i: usize) -> u32 {
        assert!(
            i < self.len,
            "token index {i} out of range for {} tokens",
            self.len
        );
        self.token_at(i)
    }

    /// Token `i`; `i < len` is the caller's duty (slice indexing still checks it).
    fn token_at(&self, i: usize) -> u32 {
        match self.dtype {
            Dtype::U16 => u32::from(u16::from_le_bytes([self.map[2 * i], self.map[2 * i + 1]])),
            Dtype::U32 => {
                let b = &self.map[4 * i..4 * i + 4];
                u32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
        }
    }
}

impl TokenStore for TokenFile {
    fn len(&self) -> usize {
        self.len
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The `.bin` path the file was opened from.
    fn path(&self) -> &Path {
        &self.path
    }

    /// Its token count and SHA-256 (the sidecar's, else computed over the file once).
    fn fingerprint(&self) -> crate::DataFingerprint {
        let sha = self
            .sha256
            .get_or_init(|| crate::fingerprint::sha256_hex(&self.map));
        crate::DataFingerprint::File {
            path: self.path.clone(),
            num_tokens: self.len as u64,
            sha256: sha.clone(),
        }
    }

    fn copy_into(&self, start: usize, out: &mut [u32]) {
        let w = self.dtype.width();
        let bytes = &self.map[start * w..(start + out.len()) * w];
        match self.dtype {
            Dtype::U16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u32::from(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            Dtype::U32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
    }
}

/// Reads and checks `<path>.json`.
fn read_sidecar(path: &Path) -> Result<Sidecar, DataError> {
    let side = sidecar_path(path);
    let text = match std::fs::read_to_string(&side) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !path.exists() => {
            return Err(DataError::MissingFile {
                path: path.to_owned(),
                hint: "check the path: data is a token file (with its .json sidecar) or a Megatron prefix (PREFIX.bin + PREFIX.idx); write either with `prepare-data`",
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(DataError::MissingFile {
            path: side,
            hint: "every token file needs its JSON sidecar; re-create the file with `prepare-data`",
        }),
        Err(e) => return Err(DataError::io("read", side, e)),
    };
    let sidecar: Sidecar = serde_json::from_str(&text).map_err(|e| DataError::BadSidecar {
        path: side.clone(),
        reason: e.to_string(),
    })?;
    let bad = |reason: String| DataError::BadSidecar {
        path: side.clone(),
        reason,
    };
    if sidecar.format != FORMAT_NAME {
        return Err(bad(format!(
            "format is {:?}, expected {FORMAT_NAME:?}",
            sidecar.format
        )));
    }
    if sidecar.version != FORMAT_VERSION {
        return Err(bad(format!(
            "version is {}, this build reads version {FORMAT_VERSION}",
            sidecar.version
        )));
    }
    check_vocab_size(path, sidecar.vocab_size)?;
    if sidecar.dtype == Dtype::U16 && sidecar.vocab_size > 1 << 16 {
        return Err(bad(format!(
            "dtype u16 cannot hold ids of vocab_size {}",
            sidecar.vocab_size
        )));
    }
    Ok(sidecar)
}
