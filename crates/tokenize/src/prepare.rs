//! `prepare-data`: tokenize input files into a ferrotron token file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrotron_data::TokenFileWriter;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::input::{documents, total_input_bytes, ReadOptions};
use crate::{train_bpe, ByteTokenizer, HfTokenizer, TokenizeError, Tokenizer};

/// Which tokenizer [`prepare_data`] uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerChoice {
    /// [`ByteTokenizer`]: UTF-8 bytes plus end-of-document, vocabulary 257.
    Bytes,
    /// A Hugging Face `tokenizer.json` ([`HfTokenizer`]).
    HfFile(PathBuf),
    /// Train a byte-level BPE tokenizer on the inputs first ([`train_bpe`]) and save it.
    TrainBpe {
        /// Upper bound on the number of ids.
        vocab_size: usize,
        /// Where the trained `tokenizer.json` is written.
        save_to: PathBuf,
    },
}

/// What [`prepare_data`] reads, writes and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareOptions {
    /// Input files: text, or `.jsonl`/`.json` lines (see [`crate::input`]).
    pub inputs: Vec<PathBuf>,
    /// The token file to write (its sidecar goes to `<output>.json`).
    pub output: PathBuf,
    /// The tokenizer.
    pub tokenizer: TokenizerChoice,
    /// The string field of each JSON line holding the document (usually `text`).
    pub jsonl_field: String,
    /// Read plain text files as one document per line instead of one per file.
    pub lines_as_documents: bool,
    /// Show a progress bar (bytes processed, rate, ETA) on stderr.
    pub progress: bool,
}

impl PrepareOptions {
    /// Options with the defaults: field `text`, one document per text file, no progress bar.
    pub fn new(inputs: Vec<PathBuf>, output: PathBuf, tokenizer: TokenizerChoice) -> Self {
        PrepareOptions {
            inputs,
            output,
            tokenizer,
            jsonl_field: "text".to_owned(),
            lines_as_documents: false,
            progress: false,
        }
    }

    fn read_options(&self) -> ReadOptions {
        ReadOptions {
            jsonl_field: self.jsonl_field.clone(),
            lines_as_documents: self.lines_as_documents,
        }
    }
}

/// The outcome of [`prepare_data`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrepareReport {
    /// Documents tokenized (empty ones are skipped).
    pub documents: u64,
    /// Tokens written, end-of-document tokens included.
    pub tokens: u64,
    /// The token file's vocab_size (the tokenizer's).
    pub vocab_size: usize,
    /// The token file written.
    pub output: PathBuf,
    /// Total size of the input files in bytes.
    pub input_bytes: u64,
}

/// Documents are encoded in batches of about this many bytes (the HF tokenizer encodes a
/// batch in parallel).
const BATCH_BYTES: usize = 4 << 20;
/// ... or this many documents, whichever comes first.
const BATCH_DOCS: usize = 4096;

/// Tokenizes `opts.inputs` with the chosen tokenizer into the token file `opts.output`.
///
/// Every document is followed by the tokenizer's end-of-document token (if it has one).
/// The token file is written through [`TokenFileWriter`], so it appears atomically when
/// everything succeeded and nothing is left under its name otherwise. Missing parent
/// directories of the output are created.
///
/// # Errors
///
/// Input errors (missing file, bad UTF-8, bad JSON line, missing field — each naming file
/// and line), tokenizer load/train/encode errors, and [`TokenizeError::Data`] when the
/// token file cannot be written or no document had any text.
pub fn prepare_data(opts: &PrepareOptions) -> Result<PrepareReport, TokenizeError> {
    let input_bytes = total_input_bytes(&opts.inputs)?;
    let read = opts.read_options();
    let tokenizer: Box<dyn Tokenizer> = match &opts.tokenizer {
        TokenizerChoice::Bytes => Box::new(ByteTokenizer),
        TokenizerChoice::HfFile(path) => Box::new(HfTokenizer::from_file(path)?),
        TokenizerChoice::TrainBpe {
            vocab_size,
            save_to,
        } => {
            let spinner = spinner(opts.progress, "training BPE tokenizer");
            let tok = train_bpe(&opts.inputs, &read, *vocab_size, save_to);
            spinner.finish_and_clear();
            Box::new(tok?)
        }
    };
    create_parent(&opts.output)?;
    let vocab_size = tokenizer.vocab_size();
    let mut writer = TokenFileWriter::create(&opts.output, vocab_size)?;
    let bar = bytes_bar(opts.progress, input_bytes);

    let mut documents_done = 0u64;
    let mut batch = Batch::default();
    let mut docs = documents(&opts.inputs, &read);
    for doc in docs.by_ref() {
        let doc = doc?;
        batch.text_bytes += doc.text.len();
        batch.input_bytes += doc.bytes;
        batch.docs.push(doc.text);
        if batch.text_bytes >= BATCH_BYTES || batch.docs.len() >= BATCH_DOCS {
            documents_done += batch.flush(tokenizer.as_ref(), &mut writer, &bar)?;
        }
    }
    documents_done += batch.flush(tokenizer.as_ref(), &mut writer, &bar)?;
    bar.inc(docs.unreported_bytes());
    let tokens = writer.finish()?;
    bar.finish_and_clear();
    Ok(PrepareReport {
        documents: documents_done,
        tokens,
        vocab_size,
        output: opts.output.clone(),
        input_bytes,
    })
}

/// Documents waiting to be encoded together.
#[derive(Default)]
struct Batch {
    docs: Vec<String>,
    text_bytes: usize,
    input_bytes: u64,
}

impl Batch {
    /// Encodes and writes the batch, advances the bar, empties the batch; returns the
    /// number of documents written.
    fn flush(
        &mut self,
        tokenizer: &dyn Tokenizer,
        writer: &mut TokenFileWriter,
        bar: &ProgressBar,
    ) -> Result<u64, TokenizeError> {
        if self.docs.is_empty() {
            return Ok(0);
        }
        for ids in tokenizer.encode_documents(&self.docs)? {
            writer.push(&ids)?;
        }
        bar.inc(self.input_bytes);
        let n = self.docs.len() as u64;
        *self = Batch::default();
        Ok(n)
    }
}

/// Creates the parent directory of `path` if it is missing.
fn create_parent(path: &Path) -> Result<(), TokenizeError> {
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => {
            std::fs::create_dir_all(dir).map_err(|e| TokenizeError::io("create directory", dir, e))
        }
        None => Ok(()),
    }
}

/// A progress bar over `total` input bytes with rate and ETA, or a hidden one.
fn bytes_bar(show: bool, total: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "tokenizing [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, ETA {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(total).with_style(style)
}

/// A ticking spinner with `msg`, or a hidden one.
fn spinner(show: bool, msg: &'static str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner().with_message(msg);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}
