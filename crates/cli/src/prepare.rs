//! `ferrotron prepare-data`.

use std::path::{Path, PathBuf};

use ferrotron_data::Format;
use ferrotron_tokenize::{prepare_data, PrepareOptions, TokenizerChoice};

/// Arguments of `prepare-data`.
#[derive(clap::Args)]
pub struct PrepareArgs {
    /// Input files, directories (every .txt/.md/.jsonl/.json file under them) or glob
    /// patterns (quoted: 'data/*.jsonl.gz'): plain text (one document per file, or per line
    /// with --lines), or JSON lines (`.jsonl`/`.json`, the document in --field); `.gz` and
    /// `.zst` files are decompressed as they are read.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Token file to write (`.bin`; its sidecar goes to `<output>.json`), or with
    /// `--format megatron` the dataset's prefix (`<prefix>.bin` + `<prefix>.idx`).
    #[arg(long, short)]
    output: PathBuf,
    /// The output format: ferrotron's token file, or Megatron/NeMo's indexed dataset (one
    /// sequence per document; read by `data.path` and by Megatron, NeMo and torchtitan).
    #[arg(long, value_enum, default_value_t = FormatArg::Tokens)]
    format: FormatArg,
    /// A Hugging Face `tokenizer.json`, or a model directory holding one (BOS/EOS as its
    /// tokenizer_config.json says); default: byte-level (vocabulary 257, 256 = end of document).
    #[arg(long, conflicts_with = "train_bpe")]
    tokenizer: Option<PathBuf>,
    /// Train a byte-level BPE tokenizer of this vocabulary size on the inputs first.
    #[arg(long, value_name = "VOCAB_SIZE", requires = "save_tokenizer")]
    train_bpe: Option<usize>,
    /// Where --train-bpe writes its `tokenizer.json`.
    #[arg(long)]
    save_tokenizer: Option<PathBuf>,
    /// JSON field holding each document.
    #[arg(long, default_value = "text")]
    field: String,
    /// Plain text: one document per line.
    #[arg(long)]
    lines: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Shuffle the documents (holding them in memory until the end).
    #[arg(long)]
    shuffle: bool,
    /// Seed of --shuffle and of the validation split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write this fraction of the documents to `<output stem>.val.bin` instead (chosen by
    /// the seed, whatever their order).
    #[arg(long, default_value_t = 0.0)]
    val_fraction: f64,
}

/// `--format`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum FormatArg {
    /// `.bin` + `.bin.json`.
    Tokens,
    /// `PREFIX.bin` + `PREFIX.idx`.
    Megatron,
}

pub fn run(a: PrepareArgs) -> anyhow::Result<()> {
    let tokenizer = match (a.tokenizer, a.train_bpe, a.save_tokenizer) {
        (Some(path), _, _) => TokenizerChoice::HfFile(path),
        (None, Some(vocab_size), Some(save_to)) => TokenizerChoice::TrainBpe {
            vocab_size,
            save_to,
        },
        _ => TokenizerChoice::Bytes,
    };
    let files = ferrotron_tokenize::sources::expand(&a.inputs)?;
    let format = match a.format {
        FormatArg::Tokens => Format::Tokens,
        FormatArg::Megatron => Format::Megatron,
    };
    refuse_overwriting_inputs(&files, format, &a.output)?;
    if a.val_fraction > 0.0 {
        let val = ferrotron_tokenize::val_path(&a.output);
        refuse_overwriting_inputs(&files, format, &val)?;
    }
    let mut opts = PrepareOptions::new(a.inputs, a.output, tokenizer);
    opts.jsonl_field = a.field;
    opts.lines_as_documents = a.lines;
    opts.progress = !a.quiet;
    opts.shuffle_seed = a.shuffle.then_some(a.seed);
    opts.val_fraction = a.val_fraction;
    opts.split_seed = a.seed;
    opts.format = format;
    let report = prepare_data(&opts)?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// The files written (the token file and its sidecar, or the Megatron pair) must not be any
/// of the inputs: writing them would destroy the text being read.
fn refuse_overwriting_inputs(
    inputs: &[PathBuf],
    format: Format,
    output: &Path,
) -> anyhow::Result<()> {
    for written in format.files(output) {
        let Ok(target) = written.canonicalize() else {
            continue; // does not exist yet: cannot be an input
        };
        for input in inputs {
            if input.canonicalize().is_ok_and(|i| i == target) {
                anyhow::bail!(
                    "-o {}: the output would overwrite the input {}; choose another output path",
                    output.display(),
                    input.display()
                );
            }
        }
    }
    Ok(())
}
