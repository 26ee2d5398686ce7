//! `ferrotron prepare-data`.

use std::path::{Path, PathBuf};

use ferrotron_tokenize::{prepare_data, PrepareOptions, TokenizerChoice};

/// Arguments of `prepare-data`.
#[derive(clap::Args)]
pub struct PrepareArgs {
    /// Input files: plain text (one document per file, or per line with --lines), or JSON
    /// lines (`.jsonl`/`.json`, the document in --field).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Token file to write (`.bin`; its sidecar goes to `<output>.json`).
    #[arg(long, short)]
    output: PathBuf,
    /// A Hugging Face `tokenizer.json`; default: byte-level (vocabulary 257, 256 = end of document).
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
    refuse_overwriting_inputs(&a.inputs, &a.output)?;
    let mut opts = PrepareOptions::new(a.inputs, a.output, tokenizer);
    opts.jsonl_field = a.field;
    opts.lines_as_documents = a.lines;
    opts.progress = !a.quiet;
    let report = prepare_data(&opts)?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// The token file and its sidecar must not be any of the inputs: writing them would destroy
/// the text being read.
fn refuse_overwriting_inputs(inputs: &[PathBuf], output: &Path) -> anyhow::Result<()> {
    let sidecar = PathBuf::from(format!("{}.json", output.display()));
    for written in [output, sidecar.as_path()] {
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
