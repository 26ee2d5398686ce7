//! `prepare-data`: tokenize input files into a ferrotron token file or a Megatron indexed
//! dataset.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrotron_data::{CorpusWriter, Format};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::input::{documents, total_input_bytes, ReadOptions};
use crate::{train_bpe, ByteTokenizer, HfTokenizer, TokenizeError, Tokenizer};

/// Which tokenizer [`prepare_data`] uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerChoice {
    /// [`ByteTokenizer`]: UTF-8 bytes plus end-of-document, vocabulary 257.
    Bytes,
    /// A Hugging Face `tokenizer.json` ([`HfTokenizer`]), or a model directory holding one
    /// (with the BOS/EOS its `tokenizer_config.json` says, [`HfTokenizer::from_dir`]).
    HfFile(PathBuf),
    /// Train a byte-level BPE tokenizer on the inputs first ([`train_bpe`]) and save it.
    TrainBpe {
        /// Upper bound on the number of ids.
        vocab_size: usize,
        /// Where the trained `tokenizer.json` is written.
        save_to: PathBuf,
    },
}

impl TokenizerChoice {
    /// The `tokenizer.json` this choice reads or writes, as an absolute path where it can be
    /// resolved (the token files' sidecars record it); `None` for bytes.
    pub fn json_path(&self) -> Option<PathBuf> {
        let path = match self {
            TokenizerChoice::Bytes => return None,
            TokenizerChoice::HfFile(p) if p.is_dir() => p.join("tokenizer.json"),
            TokenizerChoice::HfFile(p) => p.clone(),
            TokenizerChoice::TrainBpe { save_to, .. } => save_to.clone(),
        };
        Some(std::fs::canonicalize(&path).unwrap_or_else(|_| {
            std::env::current_dir()
                .map(|d| d.join(&path))
                .unwrap_or(path)
        }))
    }
}

/// What [`prepare_data`] reads, writes and how.
#[derive(Debug, Clone, PartialEq)]
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
    /// Shuffle the documents with this seed (each split on its own) before writing them.
    /// The tokenized documents are held in memory until the end.
    pub shuffle_seed: Option<u64>,
    /// Send this fraction of the documents (chosen by `split_seed`, independently of their
    /// order) to a validation file beside the output ([`val_path`]); 0 writes none.
    pub val_fraction: f64,
    /// Seed of the validation split.
    pub split_seed: u64,
    /// The output's format: ferrotron's token file, or a Megatron indexed dataset (then
    /// `output` is its prefix).
    pub format: Format,
}

/// The validation file of `output`: `train.bin` → `train.val.bin`.
pub fn val_path(output: &Path) -> PathBuf {
    let stem = output
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("tokens");
    let ext = output.extension().and_then(|s| s.to_str()).unwrap_or("bin");
    output.with_file_name(format!("{stem}.val.{ext}"))
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
            shuffle_seed: None,
            val_fraction: 0.0,
            split_seed: 0,
            format: Format::Tokens,
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
    /// Documents written to the output (empty ones are skipped).
    pub documents: u64,
    /// Tokens written, end-of-document tokens included.
    pub tokens: u64,
    /// The token file's vocab_size (the tokenizer's).
    pub vocab_size: usize,
    /// The end-of-document token written after every document (None: the tokenizer has
    /// none): the `data.eos_id` that document masking (`data.document_mask`) reads.
    pub eos_id: Option<u32>,
    /// The token file written.
    pub output: PathBuf,
    /// Total size of the input files in bytes.
    pub input_bytes: u64,
    /// Input files read (after expanding directories and patterns).
    pub input_files: usize,
    /// The validation file, when a split was asked for.
    pub validation: Option<ValidationReport>,
}

/// The validation file [`prepare_data`] wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ValidationReport {
    /// The token file.
    pub output: PathBuf,
    /// Documents written to it.
    pub documents: u64,
    /// Tokens written to it, end-of-document tokens included.
    pub tokens: u64,
}

/// Documents are encoded in batches of about this many bytes (the HF tokenizer encodes a
/// batch in parallel).
const BATCH_BYTES: usize = 4 << 20;
/// ... or this many documents, whichever comes first.
const BATCH_DOCS: usize = 4096;

/// Tokenizes `opts.inputs` with the chosen tokenizer into the token file (or Megatron
/// dataset, per `opts.format`) `opts.output`.
///
/// Every document is followed by the tokenizer's end-of-document token (if it has one).
/// The output is written through [`CorpusWriter`], so it appears atomically when
/// everything succeeded and nothing is left under its name otherwise. Missing parent
/// directories of the output are created.
///
/// # Errors
///
/// Input errors (missing file, bad UTF-8, bad JSON line, missing field — each naming file
/// and line), tokenizer load/train/encode errors, and [`TokenizeError::Data`] when the
/// token file cannot be written or no document had any text.
pub fn prepare_data(opts: &PrepareOptions) -> Result<PrepareReport, TokenizeError> {
    if !(0.0..1.0).contains(&opts.val_fraction) {
        return Err(TokenizeError::BadOption {
            option: "--val-fraction",
            reason: format!("{} is not in [0, 1)", opts.val_fraction),
        });
    }
    let inputs = crate::sources::expand(&opts.inputs)?;
    let input_bytes = total_input_bytes(&inputs)?;
    let read = opts.read_options();
    let tokenizer: Box<dyn Tokenizer> = match &opts.tokenizer {
        TokenizerChoice::Bytes => Box::new(ByteTokenizer),
        TokenizerChoice::HfFile(path) if path.is_dir() => Box::new(HfTokenizer::from_dir(path)?),
        TokenizerChoice::HfFile(path) => Box::new(HfTokenizer::from_file(path)?),
        TokenizerChoice::TrainBpe {
            vocab_size,
            save_to,
        } => {
            let spinner = spinner(opts.progress, "training BPE tokenizer");
            let tok = train_bpe(&inputs, &read, *vocab_size, save_to);
            spinner.finish_and_clear();
            Box::new(tok?)
        }
    };
    create_parent(&opts.output)?;
    let vocab_size = tokenizer.vocab_size();
    let mut sink = Sink::new(opts, vocab_size)?;
    let bar = bytes_bar(opts.progress, input_bytes);
    let mut batch = Batch::default();
    let mut docs = documents(&inputs, &read);
    for doc in docs.by_ref() {
        let doc = doc?;
        batch.text_bytes += doc.text.len();
        batch.input_bytes += doc.bytes;
        batch.docs.push(doc.text);
        if batch.text_bytes >= BATCH_BYTES || batch.docs.len() >= BATCH_DOCS {
            batch.flush(tokenizer.as_ref(), &mut sink, &bar)?;
        }
    }
    batch.flush(tokenizer.as_ref(), &mut sink, &bar)?;
    bar.inc(docs.unreported_bytes());
    let [(documents, tokens), val] = sink.finish()?;
    bar.finish_and_clear();
    Ok(PrepareReport {
        documents,
        tokens,
        vocab_size,
        eos_id: tokenizer.eos_id(),
        output: opts.format.target(&opts.output),
        input_bytes,
        input_files: inputs.len(),
        validation: (opts.val_fraction > 0.0).then(|| ValidationReport {
            output: opts.format.target(&val_path(&opts.output)),
            documents: val.0,
            tokens: val.1,
        }),
    })
}

/// Where tokenized documents go: the output and, with a split, the validation file; in
/// arrival order, or held and shuffled at the end.
struct Sink {
    writers: [Option<CorpusWriter>; 2],
    /// The outputs the writers commit to.
    paths: [PathBuf; 2],
    format: Format,
    held: Option<[Vec<Vec<u32>>; 2]>,
    shuffle_seed: u64,
    val_fraction: f64,
    split_seed: u64,
    index: u64,
    documents: [u64; 2],
}

impl Sink {
    fn new(opts: &PrepareOptions, vocab_size: usize) -> Result<Sink, TokenizeError> {
        let val = if opts.val_fraction > 0.0 {
            Some(CorpusWriter::create(
                opts.format,
                &val_path(&opts.output),
                vocab_size,
            )?)
        } else {
            None
        };
        let mut writers = [
            Some(CorpusWriter::create(opts.format, &opts.output, vocab_size)?),
            val,
        ];
        if let Some(path) = opts.tokenizer.json_path() {
            for w in writers.iter_mut().flatten() {
                w.set_tokenizer(path.clone());
            }
        }
        Ok(Sink {
            writers,
            paths: [opts.output.clone(), val_path(&opts.output)],
            format: opts.format,
            held: opts.shuffle_seed.map(|_| Default::default()),
            shuffle_seed: opts.shuffle_seed.unwrap_or(0),
            val_fraction: opts.val_fraction,
            split_seed: opts.split_seed,
            index: 0,
            documents: [0; 2],
        })
    }

    fn push(&mut self, ids: Vec<u32>) -> Result<(), TokenizeError> {
        let split = usize::from(
            self.writers[1].is_some() && unit(self.split_seed, self.index) < self.val_fraction,
        );
        self.index += 1;
        self.documents[split] += 1;
        match &mut self.held {
            Some(held) => held[split].push(ids),
            None => self.writers[split]
                .as_mut()
                .expect("a writer")
                .push_document(&ids)?,
        }
        Ok(())
    }

    /// Writes what is held (shuffled) and closes the files: (documents, tokens) of the
    /// output and of the validation file.
    ///
    /// Both files appear or neither: a split left without documents is refused before
    /// anything is committed, and a failure committing the second removes the first.
    fn finish(mut self) -> Result<[(u64, u64); 2], TokenizeError> {
        if self.writers[1].is_some() && self.documents[0] > 0 && self.documents[1] == 0 {
            return Err(TokenizeError::BadOption {
                option: "--val-fraction",
                reason: format!(
                    "no document of {} fell in the validation split: raise it or add documents",
                    self.documents[0]
                ),
            });
        }
        let mut out = [(0, 0); 2];
        let held = self.held.take();
        for (split, writer) in self.writers.iter_mut().enumerate() {
            let Some(mut w) = writer.take() else {
                continue;
            };
            if let Some(held) = &held {
                let docs = &held[split];
                for i in permutation(docs.len(), self.shuffle_seed ^ split as u64) {
                    w.push_document(&docs[i])?;
                }
            }
            match w.finish() {
                Ok(tokens) => out[split] = (self.documents[split], tokens),
                Err(e) => {
                    if split == 1 {
                        for file in self.format.files(&self.paths[0]) {
                            let _ = std::fs::remove_file(file);
                        }
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(out)
    }
}

/// A number in [0, 1) from `seed` and `i` alone (SplitMix64).
fn unit(seed: u64, i: u64) -> f64 {
    let mut z = seed
        .wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

/// A permutation of `0..n` from `seed` (Fisher–Yates).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (unit(seed, i as u64) * (i + 1) as f64) as usize;
        p.swap(i, j.min(i));
    }
    p
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
        sink: &mut Sink,
        bar: &ProgressBar,
    ) -> Result<(), TokenizeError> {
        if self.docs.is_empty() {
            return Ok(());
        }
        for ids in tokenizer.encode_documents(&self.docs)? {
            sink.push(ids)?;
        }
        bar.inc(self.input_bytes);
        *self = Batch::default();
        Ok(())
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
