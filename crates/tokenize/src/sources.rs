//! Where input bytes come from: the files a list of paths, directories and glob patterns
//! names, each opened through its decompressor (`.gz`, `.zst`) with a count of the raw bytes
//! read, so progress follows the files on disk.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::TokenizeError;

/// Compression of an input, from its last extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Read as is.
    None,
    /// gzip (`.gz`), possibly several members.
    Gzip,
    /// Zstandard (`.zst`).
    Zstd,
}

impl Compression {
    /// The compression of `path`.
    pub fn of(path: &Path) -> Compression {
        match ext(path).as_deref() {
            Some("gz") => Compression::Gzip,
            Some("zst") => Compression::Zstd,
            _ => Compression::None,
        }
    }
}

fn ext(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
}

/// The name that says how the content reads: `path` without a compression extension
/// (`data.jsonl.gz` reads as `data.jsonl`).
pub fn content_name(path: &Path) -> PathBuf {
    match Compression::of(path) {
        Compression::None => path.to_path_buf(),
        _ => path.with_extension(""),
    }
}

/// Extensions of the files a directory input contributes (after any compression extension).
const READABLE: [&str; 6] = ["txt", "text", "md", "jsonl", "json", "parquet"];

fn readable(path: &Path) -> bool {
    let name = content_name(path);
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.'));
    !hidden && ext(&name).is_some_and(|e| READABLE.contains(&e.as_str()))
}

/// The files `inputs` name, in order: a file as is; a directory as every readable file under
/// it (recursively, sorted, hidden ones skipped); a pattern with `*`, `?` or `[` as its
/// matches, sorted. A pattern matching nothing or a directory holding no readable file is an
/// error naming it.
pub fn expand(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, TokenizeError> {
    let mut files = Vec::new();
    for input in inputs {
        let text = input.to_string_lossy();
        if text.contains(['*', '?', '[']) && !input.exists() {
            // As a shell matches: `*` does not match a leading dot.
            let options = glob::MatchOptions {
                require_literal_leading_dot: true,
                ..Default::default()
            };
            let matches =
                glob::glob_with(&text, options).map_err(|e| TokenizeError::BadPattern {
                    pattern: text.to_string(),
                    reason: e.to_string(),
                })?;
            let mut found: Vec<PathBuf> = matches
                .filter_map(Result::ok)
                .filter(|p| p.is_file())
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(TokenizeError::NoMatch {
                    pattern: text.to_string(),
                });
            }
            files.extend(found);
        } else if input.is_dir() {
            let mut found = Vec::new();
            walk(input, &mut found)?;
            found.sort();
            if found.is_empty() {
                return Err(TokenizeError::EmptyDirectory {
                    path: input.clone(),
                });
            }
            files.extend(found);
        } else {
            files.push(input.clone());
        }
    }
    Ok(files)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), TokenizeError> {
    let entries = std::fs::read_dir(dir).map_err(|e| TokenizeError::io("list", dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| TokenizeError::io("list", dir, e))?.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if readable(&path) {
            out.push(path);
        }
    }
    Ok(())
}

/// A reader that counts the bytes it passes on.
struct Counting<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// An opened input: its decompressed content, and how many bytes of the file were read.
pub struct Opened {
    /// The content.
    pub reader: Box<dyn Read + Send>,
    /// Bytes read from the file so far (compressed bytes for a compressed file).
    pub raw: Arc<AtomicU64>,
}

/// Opens `path` through its decompressor.
pub fn open(path: &Path) -> Result<Opened, TokenizeError> {
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => TokenizeError::MissingInput {
            path: path.to_owned(),
        },
        _ => TokenizeError::io("open", path, e),
    })?;
    let raw = Arc::new(AtomicU64::new(0));
    let counted = std::io::BufReader::with_capacity(
        1 << 20,
        Counting {
            inner: file,
            count: raw.clone(),
        },
    );
    let reader: Box<dyn Read + Send> = match Compression::of(path) {
        Compression::None => Box::new(counted),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(counted)),
        Compression::Zstd => Box::new(ruzstd::decoding::StreamingDecoder::new(counted).map_err(
            |e| {
                TokenizeError::io(
                    "read the zstd header of",
                    path,
                    std::io::Error::other(e.to_string()),
                )
            },
        )?),
    };
    Ok(Opened { reader, raw })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_and_content_come_from_the_extensions() {
        assert_eq!(Compression::of(Path::new("a.jsonl.gz")), Compression::Gzip);
        assert_eq!(Compression::of(Path::new("a.JSONL.ZST")), Compression::Zstd);
        assert_eq!(Compression::of(Path::new("a.txt")), Compression::None);
        assert_eq!(
            content_name(Path::new("d/a.jsonl.gz")),
            Path::new("d/a.jsonl")
        );
        assert!(readable(Path::new("x/train-0001.parquet")));
        assert!(readable(Path::new("notes.txt.zst")));
        assert!(!readable(Path::new("model.bin")));
        assert!(!readable(Path::new(".hidden.txt")));
    }
}
