//! `ferrotron eval`.

use std::path::PathBuf;

use ferrotron_data::{open_tokens, TokenStore};
use ferrotron_train::hf::load_model;
use ferrotron_train::on_device::DeviceModel;
use ferrotron_train::trainer::thread_pool;

use crate::device::{inference_backend, DeviceArg};

/// Arguments of `eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// Hugging Face Llama directory (config.json + model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Token file (`.bin` with its `.bin.json` sidecar).
    #[arg(long)]
    data: PathBuf,
    /// Tokens per window; default: the model's max_position_embeddings. The file is cut into
    /// consecutive windows of seq+1 tokens with stride seq, each predicting seq tokens; the
    /// trailing partial window is dropped.
    #[arg(long)]
    seq: Option<usize>,
    /// Windows per forward pass (does not change the result).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where the model runs: the host, or GPU 0 (a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t)]
    device: DeviceArg,
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let loaded = load_model(&args.model)?;
    let mut cfg = loaded.config;
    let loaded_seq = cfg.seq_len;
    if let Some(seq) = args.seq {
        anyhow::ensure!(seq > 0, "--seq must be at least 1");
        if seq > cfg.seq_len {
            eprintln!(
                "warning: --seq {seq} uses positions beyond the model's max_position_embeddings \
                 = {}: its loss there is untested",
                cfg.seq_len
            );
        }
        cfg.seq_len = seq;
    }
    let file = open_tokens(&args.data)?;
    anyhow::ensure!(
        file.vocab_size() <= cfg.vocab,
        "--data {}: its vocab_size {} exceeds the model's vocabulary of {} (vocab_size in {}): \
         evaluate on data tokenized with this model's tokenizer",
        args.data.display(),
        file.vocab_size(),
        cfg.vocab,
        args.model.join("config.json").display()
    );
    anyhow::ensure!(
        file.len() > cfg.seq_len,
        "--data {} holds {} tokens, fewer than one window of {} + 1: pass a smaller --seq \
         (the model's own is {})",
        args.data.display(),
        file.len(),
        cfg.seq_len,
        loaded_seq
    );
    let backend = inference_backend(args.device)?;
    let model = DeviceModel::new(&cfg, &loaded.weights, loaded.dtype, backend);
    drop(loaded.weights);
    let pool = thread_pool(args.threads)?;
    let shape = ferrotron_train::EvalShape {
        seq_len: cfg.seq_len,
        batch: args.batch,
        loss_chunk: 256,
    };
    let report = pool.install(|| model.evaluate(&file, shape))?;
    println!("{}", serde_json::to_string(&report)?);
    anyhow::ensure!(
        report.loss.is_finite(),
        "the loss of {} on {} is not finite ({}): its weights hold NaN or infinite values, or \
         are too large for f32",
        args.model.display(),
        args.data.display(),
        report.loss
    );
    Ok(())
}
