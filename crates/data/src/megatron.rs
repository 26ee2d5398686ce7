//! Megatron/NeMo indexed datasets: `PREFIX.bin` (the token ids of every sequence, back to
//! back) and `PREFIX.idx` (where each sequence and document lies), read in place.
//!
//! # The index (`PREFIX.idx`, little-endian throughout)
//!
//! | bytes | field |
//! |---|---|
//! | 9 | magic `MMIDIDX\0\0` |
//! | 8 | version, `u64` = 1 |
//! | 1 | dtype code of the `.bin` ids: 1 `u8`, 2 `i8`, 3 `i16`, 4 `i32`, 5 `i64`, 6 `f64`, 7 `f32`, 8 `u16` |
//! | 8 | sequence count `S`, `u64` |
//! | 8 | document-index count `D`, `u64` |
//! | 4·S | tokens per sequence, `i32` |
//! | 8·S | byte offset of each sequence in `.bin`, `i64` |
//! | 8·D | document boundaries as sequence indices, `i64`: `0 … S` |
//!
//! A multimodal index also carries one mode byte per sequence; ferrotron reads text-only
//! ones and says so. Megatron's `preprocess_data.py` writes `u16` ids for vocabularies
//! below 65,500 and `i32` above.
//!
//! # How ferrotron reads it
//!
//! The sequences, in index order, form one token stream: windows are cut and shuffled from it
//! exactly as from a [`TokenFile`](crate::TokenFile) holding the same tokens
//! ([`crate::sampler`]). Opening checks the header, that the offsets are the running sum of
//! the sizes, that they end at the end of `.bin`, and every id (no negative id, none past
//! `u32`); the vocabulary is the largest id plus one, since the index records none.

mod writer;

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{DataError, DataFingerprint, TokenStore};

pub use writer::MegatronWriter;

/// The first 9 bytes of every index.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The index version written and read.
pub const VERSION: u64 = 1;
/// Bytes before the sizes: magic, version, dtype code, S and D.
const HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// The index file of `prefix`: `prefix` with `.idx` appended (`corpus_text_document.idx`).
pub fn idx_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".idx")
}

/// The data file of `prefix`: `prefix` with `.bin` appended.
pub fn bin_path(prefix: &Path) -> PathBuf {
    with_suffix(prefix, ".bin")
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The id types Megatron's index names by code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MegatronDtype {
    /// Code 1.
    U8,
    /// Code 2.
    I8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 8.
    U16,
}

impl MegatronDtype {
    /// The dtype of `code`; floats (6, 7) and unknown codes are refused with the reason.
    fn from_code(code: u8) -> Result<MegatronDtype, String> {
        Ok(match code {
            1 => MegatronDtype::U8,
            2 => MegatronDtype::I8,
            3 => MegatronDtype::I16,
            4 => MegatronDtype::I32,
            5 => MegatronDtype::I64,
            8 => MegatronDtype::U16,
            6 | 7 => {
                return Err(format!(
                    "dtype code {code} is a float ({}): token ids are integers",
                    if code == 6 { "float64" } else { "float32" }
                ))
            }
            _ => return Err(format!("dtype code {code} is none of Megatron's (1-8)")),
        })
    }

    /// The code written in the index.
    pub fn code(self) -> u8 {
        match self {
            MegatronDtype::U8 => 1,
            MegatronDtype::I8 => 2,
            MegatronDtype::I16 => 3,
            MegatronDtype::I32 => 4,
            MegatronDtype::I64 => 5,
            MegatronDtype::U16 => 8,
        }
    }

    /// Megatron's choice for a vocabulary: `u16` below 65,500 ids, else `i32`.
    pub fn for_vocab(vocab_size: usize) -> MegatronDtype {
        if vocab_size < 65_500 {
            MegatronDtype::U16
        } else {
            MegatronDtype::I32
        }
    }

    /// Bytes per id.
    pub fn width(self) -> usize {
        match self {
            MegatronDtype::U8 | MegatronDtype::I8 => 1,
            MegatronDtype::I16 | MegatronDtype::U16 => 2,
            MegatronDtype::I32 => 4,
            MegatronDtype::I64 => 8,
        }
    }

    /// The id stored in `b` (exactly `width()` bytes), widened.
    fn decode(self, b: &[u8]) -> i64 {
        match self {
            MegatronDtype::U8 => i64::from(b[0]),
            MegatronDtype::I8 => i64::from(b[0] as i8),
            MegatronDtype::I16 => i64::from(i16::from_le_bytes([b[0], b[1]])),
            MegatronDtype::U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
            MegatronDtype::I32 => i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            MegatronDtype::I64 => i64::from_le_bytes(b.try_into().expect("8 bytes")),
        }
    }
}

/// The parsed header of an index.
#[derive(Debug, Clone, Copy)]
struct Header {
    dtype: MegatronDtype,
    sequences: usize,
    doc_entries: usize,
}

/// A validated, memory-mapped Megatron indexed dataset (see the [module docs](self)).
#[derive(Debug)]
pub struct MegatronFile {
    prefix: PathBuf,
    bin: Mmap,
    dtype: MegatronDtype,
    len: usize,
    documents: usize,
    vocab_size: usize,
    sha256: std::sync::OnceLock<String>,
    idx_sha256: String,
}

impl MegatronFile {
    /// Opens `PREFIX.idx` and `PREFIX.bin` and checks them (see the [module docs](self)).
    ///
    /// # Errors
    ///
    /// [`DataError::MissingFile`] naming a missing file, [`DataError::Megatron`] naming the
    /// file and what is wrong (magic, version, dtype, counts, offsets, sizes past the end of
    /// `.bin`, a negative id), [`DataError::Empty`] for no tokens.
    pub fn open(prefix: &Path) -> Result<MegatronFile, DataError> {
        let idx = map(&idx_path(prefix))?;
        let bin_file = bin_path(prefix);
        let bin = map(&bin_file)?;
        let bad_idx = |reason: String| DataError::Megatron {
            path: idx_path(prefix),
            reason,
        };
        let header = parse_header(&idx).map_err(bad_idx)?;
        let len = check_layout(&idx, header, bin.len())
            .map_err(|reason| bad_idx(format!("{reason} ({})", bin_file.display())))?;
        if len == 0 {
            return Err(DataError::Empty { path: bin_file });
        }
        let max = scan_ids(&bin, header.dtype).map_err(|reason| DataError::Megatron {
            path: bin_file.clone(),
            reason,
        })?;
        Ok(MegatronFile {
            prefix: prefix.to_owned(),
            dtype: header.dtype,
            len,
            documents: header.doc_entries.saturating_sub(1),
            vocab_size: max as usize + 1,
            sha256: std::sync::OnceLock::new(),
            idx_sha256: crate::fingerprint::sha256_hex(&idx),
            bin,
        })
    }

    /// The id type of `.bin`.
    pub fn dtype(&self) -> MegatronDtype {
        self.dtype
    }

    /// Documents in the index.
    pub fn documents(&self) -> usize {
        self.documents
    }
}

impl TokenStore for MegatronFile {
    fn len(&self) -> usize {
        self.len
    }

    /// The largest id in `.bin`, plus one.
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The prefix.
    fn path(&self) -> &Path {
        &self.prefix
    }

    /// Its token count and the SHA-256 of the index followed by `.bin` (hashed once).
    fn fingerprint(&self) -> DataFingerprint {
        let sha = self.sha256.get_or_init(|| {
            let mut h = crate::fingerprint::StreamHash::default();
            h.update(self.idx_sha256.as_bytes());
            h.update(&self.bin);
            h.hex()
        });
        DataFingerprint::Megatron {
            prefix: self.prefix.clone(),
            num_tokens: self.len as u64,
            sha256: sha.clone(),
        }
    }

    fn copy_into(&self, start: usize, out: &mut [u32]) {
        let w = self.dtype.width();
        let bytes = &self.bin[start * w..(start + out.len()) * w];
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(w)) {
            // Checked on open: every id is in 0..=u32::MAX.
            *o = self.dtype.decode(c) as u32;
        }
    }

    fn check_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        if self.vocab_size > model_vocab {
            return Err(DataError::Megatron {
                path: bin_path(&self.prefix),
                reason: format!(
                    "it holds id {} ({:?} ids), not below model.vocab = {model_vocab}: the \
                     corpus was tokenized for another vocabulary; set model.vocab to at least \
                     {} or tokenize with the model's tokenizer",
                    self.vocab_size - 1,
                    self.dtype,
                    self.vocab_size
                ),
            });
        }
        Ok(())
    }
}

/// Memory-maps `path` read-only, naming it when it is missing.
fn map(path: &Path) -> Result<Mmap, DataError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(DataError::MissingFile {
                path: path.to_owned(),
                hint: "a Megatron dataset is PREFIX.bin with PREFIX.idx beside it; write one \
                       with `prepare-data --format megatron` or Megatron's preprocess_data.py",
            })
        }
        Err(e) => return Err(DataError::io("open", path, e)),
    };
    // SAFETY: read-only map; the contract (as for token files) is that nobody modifies the
    // files while they are open. Every access is bounds-checked against lengths validated
    // on open.
    unsafe { Mmap::map(&file) }.map_err(|e| DataError::io("memory-map", path, e))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Magic, version, dtype and counts, with the index's length checked against them.
fn parse_header(idx: &[u8]) -> Result<Header, String> {
    if idx.len() < HEADER || &idx[..9] != MAGIC {
        return Err(format!(
            "not a Megatron index: it starts with \"{}\", not the magic \"{}\"; \
             data.path takes a token file or a Megatron prefix (PREFIX.bin + PREFIX.idx)",
            idx[..idx.len().min(9)].escape_ascii(),
            MAGIC.escape_ascii()
        ));
    }
    let version = u64_at(idx, 9);
    if version != VERSION {
        return Err(format!(
            "index version {version}, this build reads {VERSION}"
        ));
    }
    let dtype = MegatronDtype::from_code(idx[17])?;
    let count = |at: usize, what: &str| {
        usize::try_from(u64_at(idx, at))
            .map_err(|_| format!("{what} count {} is impossibly large", u64_at(idx, at)))
    };
    let header = Header {
        dtype,
        sequences: count(18, "sequence")?,
        doc_entries: count(26, "document")?,
    };
    let body = header
        .sequences
        .checked_mul(12)
        .and_then(|s| s.checked_add(header.doc_entries.checked_mul(8)?))
        .and_then(|b| b.checked_add(HEADER))
        .ok_or("its counts are impossibly large")?;
    if idx.len() == body + header.sequences && header.sequences > 0 {
        return Err(
            "it carries sequence modes (a multimodal index): ferrotron reads \
                    text-only indices"
                .to_owned(),
        );
    }
    if idx.len() != body {
        return Err(format!(
            "{} bytes, but its {} sequences and {} document entries need {body}: the index \
             is truncated or damaged; re-create it",
            idx.len(),
            header.sequences,
            header.doc_entries
        ));
    }
    Ok(header)
}

/// Checks that the sequences lie back to back from byte 0 and end exactly at the end of
/// `.bin`, and the document boundaries run `0 ..= S` in order; returns the token count.
fn check_layout(idx: &[u8], h: Header, bin_len: usize) -> Result<usize, String> {
    let sizes = HEADER;
    let pointers = sizes + 4 * h.sequences;
    let docs = pointers + 8 * h.sequences;
    let w = h.dtype.width() as u64;
    let mut offset: u64 = 0;
    for s in 0..h.sequences {
        let size = i32::from_le_bytes(idx[sizes + 4 * s..sizes + 4 * s + 4].try_into().expect("4"));
        let pointer = u64_at(idx, pointers + 8 * s);
        if size < 0 {
            return Err(format!("sequence {s} has size {size}"));
        }
        if pointer != offset {
            return Err(format!(
                "sequence {s} starts at byte {pointer}, not {offset} where the one before it \
                 ends: ferrotron reads indices whose sequences lie back to back"
            ));
        }
        offset += size as u64 * w;
        if offset > bin_len as u64 {
            return Err(format!(
                "its sizes run past the end of .bin: sequence {s} ends at byte {offset}, the \
                 .bin file has {bin_len} bytes (truncated, or the index of another file)"
            ));
        }
    }
    if offset != bin_len as u64 {
        return Err(format!(
            "the .bin file has {bin_len} bytes but its index describes {offset}: they do not \
             belong together; re-create them"
        ));
    }
    let mut last = 0u64;
    for d in 0..h.doc_entries {
        let at = u64_at(idx, docs + 8 * d);
        let first = d == 0 && at != 0;
        if first || at < last || at > h.sequences as u64 {
            return Err(format!(
                "document boundary {d} is {at}: the boundaries must rise from 0 to the \
                 sequence count {}",
                h.sequences
            ));
        }
        last = at;
    }
    Ok((offset / w) as usize)
}

/// The largest id in `bin`, or why an id cannot be a token (negative, past `u32`).
fn scan_ids(bin: &[u8], dtype: MegatronDtype) -> Result<u32, String> {
    let mut max = 0i64;
    for (i, c) in bin.chunks_exact(dtype.width()).enumerate() {
        let id = dtype.decode(c);
        if !(0..=i64::from(u32::MAX)).contains(&id) {
            return Err(format!(
                "token {i} is {id}, which no vocabulary holds ({dtype:?} ids); the file is \
                 corrupted or its index names the wrong dtype"
            ));
        }
        max = max.max(id);
    }
    Ok(max as u32)
}
