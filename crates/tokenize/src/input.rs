//! Reading documents from input files.
//!
//! * Inputs are files, directories (every readable file under them) or glob patterns
//!   ([`crate::sources::expand`]); a `.gz` or `.zst` file is decompressed as it is read and
//!   read as the name without that extension says.
//! * A `*.parquet` file is read row by row: its string column [`ReadOptions::jsonl_field`]
//!   (default `text`) is one document per row ([`crate::parquet_input`]).
//! * A file named `*.jsonl` or `*.json` is read as JSON lines: every non-blank line is one
//!   JSON object and its string field [`ReadOptions::jsonl_field`] (default `text`) is one
//!   document.
//! * Any other file is UTF-8 text: the whole file is **one** document, unless
//!   [`ReadOptions::lines_as_documents`] is set, in which case every line (without its line
//!   ending) is one document.
//!
//! Empty documents (an empty file, an empty line, an empty `text`) are skipped.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::sources;

use crate::TokenizeError;

/// How input files are turned into documents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOptions {
    /// The string field of each JSON line that holds the document.
    pub jsonl_field: String,
    /// Read plain text files as one document per line instead of one per file.
    pub lines_as_documents: bool,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            jsonl_field: "text".to_owned(),
            lines_as_documents: false,
        }
    }
}

/// Whether `path` is read as JSON lines (by its extension, `.jsonl` or `.json`).
pub fn is_json_lines(path: &Path) -> bool {
    let path = crate::sources::content_name(path);
    matches!(
        path.extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("jsonl" | "json")
    )
}

/// Checks that every input exists and is a file; returns their total size in bytes.
///
/// # Errors
///
/// [`TokenizeError::NoInputs`], [`TokenizeError::MissingInput`],
/// [`TokenizeError::InputIsDirectory`] or [`TokenizeError::Io`].
pub fn total_input_bytes(inputs: &[PathBuf]) -> Result<u64, TokenizeError> {
    if inputs.is_empty() {
        return Err(TokenizeError::NoInputs);
    }
    let mut total = 0u64;
    for path in inputs {
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TokenizeError::MissingInput { path: path.clone() })
            }
            Err(e) => return Err(TokenizeError::io("read the metadata of", path, e)),
        };
        if meta.is_dir() {
            return Err(TokenizeError::InputIsDirectory { path: path.clone() });
        }
        total += meta.len();
    }
    Ok(total)
}

/// One document read from an input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// The document text.
    pub text: String,
    /// Input bytes consumed since the previous document (for progress reporting; includes
    /// skipped blank lines and line endings).
    pub bytes: u64,
}

/// The file currently being read line by line.
struct LineReader {
    path: PathBuf,
    reader: BufReader<Box<dyn Read + Send>>,
    raw: Arc<AtomicU64>,
    line: u64,
    json: bool,
}

impl std::fmt::Debug for LineReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LineReader({}, line {})", self.path.display(), self.line)
    }
}

/// An iterator over the documents of a list of input files, in order.
///
/// Yields `Err` at most once, then ends.
#[derive(Debug)]
pub struct Documents {
    files: Vec<PathBuf>,
    next_file: usize,
    current: Option<LineReader>,
    /// The Parquet file being read, and its size on disk.
    parquet: Option<(crate::parquet_input::ParquetRows, u64)>,
    opts: ReadOptions,
    /// Raw bytes read from the files already closed.
    finished_raw: u64,
    /// Raw bytes already reported with a document.
    reported: u64,
    done: bool,
    buf: Vec<u8>,
}

/// The documents of `inputs`, read as described in the [module docs](self).
pub fn documents(inputs: &[PathBuf], opts: &ReadOptions) -> Documents {
    Documents {
        files: inputs.to_vec(),
        next_file: 0,
        current: None,
        parquet: None,
        opts: opts.clone(),
        finished_raw: 0,
        reported: 0,
        done: false,
        buf: Vec::new(),
    }
}

/// The 1-based line of byte offset `pos` in `bytes`.
fn line_of(bytes: &[u8], pos: usize) -> u64 {
    1 + bytes[..pos].iter().filter(|&&b| b == b'\n').count() as u64
}

impl Documents {
    /// Raw (on-disk) input bytes read so far.
    fn consumed(&self) -> u64 {
        self.finished_raw
            + self
                .current
                .as_ref()
                .map_or(0, |c| c.raw.load(Ordering::Relaxed))
    }

    /// Input bytes consumed after the last yielded document (e.g. skipped trailing blank
    /// lines or empty files), so a progress bar can reach 100%.
    pub fn unreported_bytes(&self) -> u64 {
        self.consumed() - self.reported
    }

    /// The next document or error, `None` at the end; empty documents are returned too
    /// (`next` skips them).
    fn next_raw(&mut self) -> Option<Result<String, TokenizeError>> {
        loop {
            if let Some((rows, size)) = self.parquet.as_mut() {
                match rows.next_document() {
                    Ok(Some(doc)) => return Some(Ok(doc)),
                    Ok(None) => {
                        self.finished_raw += *size;
                        self.parquet = None;
                        continue;
                    }
                    Err(e) => return Some(Err(e)),
                }
            }
            if let Some(cur) = self.current.as_mut() {
                self.buf.clear();
                let n = match cur.reader.read_until(b'\n', &mut self.buf) {
                    Ok(n) => n,
                    Err(e) => return Some(Err(TokenizeError::io("read", &cur.path, e))),
                };
                if n == 0 {
                    self.finished_raw += cur.raw.load(Ordering::Relaxed);
                    self.current = None;
                    continue;
                }
                cur.line += 1;
                let mut end = self.buf.len();
                if self.buf[..end].ends_with(b"\n") {
                    end -= 1;
                }
                if self.buf[..end].ends_with(b"\r") {
                    end -= 1;
                }
                let Ok(text) = std::str::from_utf8(&self.buf[..end]) else {
                    return Some(Err(TokenizeError::NotUtf8 {
                        path: cur.path.clone(),
                        line: cur.line,
                    }));
                };
                if !cur.json {
                    return Some(Ok(text.to_owned()));
                }
                if text.trim().is_empty() {
                    continue;
                }
                return Some(json_field(
                    text,
                    &cur.path,
                    cur.line,
                    &self.opts.jsonl_field,
                ));
            }
            let path = self.files.get(self.next_file)?.clone();
            self.next_file += 1;
            if crate::parquet_input::is_parquet(&path) {
                let size = std::fs::metadata(&path).map_or(0, |m| m.len());
                match crate::parquet_input::ParquetRows::open(&path, &self.opts.jsonl_field) {
                    Ok(rows) => self.parquet = Some((rows, size)),
                    Err(e) => return Some(Err(e)),
                }
                continue;
            }
            let opened = match sources::open(&path) {
                Ok(f) => f,
                Err(e) => return Some(Err(e)),
            };
            let json = is_json_lines(&path);
            if json || self.opts.lines_as_documents {
                self.current = Some(LineReader {
                    path,
                    reader: BufReader::with_capacity(1 << 20, opened.reader),
                    raw: opened.raw,
                    line: 0,
                    json,
                });
                continue;
            }
            let text = read_whole(opened.reader, &path);
            self.finished_raw += opened.raw.load(Ordering::Relaxed);
            return Some(text);
        }
    }
}

/// Reads a whole file as one UTF-8 document.
fn read_whole(mut file: Box<dyn Read + Send>, path: &Path) -> Result<String, TokenizeError> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| TokenizeError::io("read", path, e))?;
    String::from_utf8(bytes).map_err(|e| {
        let pos = e.utf8_error().valid_up_to();
        TokenizeError::NotUtf8 {
            path: path.to_owned(),
            line: line_of(e.as_bytes(), pos),
        }
    })
}

/// Extracts the string field `field` of the JSON object on `line`.
fn json_field(text: &str, path: &Path, line: u64, field: &str) -> Result<String, TokenizeError> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| TokenizeError::BadJsonLine {
            path: path.to_owned(),
            line,
            reason: e.to_string(),
        })?;
    let bad = |problem| TokenizeError::BadField {
        path: path.to_owned(),
        line,
        field: field.to_owned(),
        problem,
    };
    match value {
        serde_json::Value::Object(mut map) => match map.remove(field) {
            Some(serde_json::Value::String(s)) => Ok(s),
            Some(_) => Err(bad("a non-string")),
            None => Err(bad("no")),
        },
        _ => Err(TokenizeError::BadJsonLine {
            path: path.to_owned(),
            line,
            reason: "the line is JSON but not an object".to_owned(),
        }),
    }
}

impl Iterator for Documents {
    type Item = Result<Document, TokenizeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        loop {
            match self.next_raw() {
                None => {
                    self.done = true;
                    return None;
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                Some(Ok(text)) if text.is_empty() => continue,
                Some(Ok(text)) => {
                    let now = self.consumed();
                    let bytes = now - self.reported;
                    self.reported = now;
                    return Some(Ok(Document { text, bytes }));
                }
            }
        }
    }
}
