//! `ferrotron eval`.

use std::path::PathBuf;

use ferrotron_train::eval_dir::{check_finite, evaluate_dir, EvalDir};

use crate::device::{inference_backend, DeviceArg};

/// Arguments of `eval`.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// Hugging Face Llama directory (config.json + model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// Token file (`.bin` with its `.bin.json` sidecar) or Megatron dataset prefix.
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
    /// Document masking, as in training with `data.document_mask`: each window attends only
    /// within its documents, which end at this token id (the run's `data.eos_id`).
    #[arg(long, value_name = "ID")]
    document_eos: Option<u32>,
    /// Where the model runs: the host, or GPU 0 (a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t)]
    device: DeviceArg,
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let call = EvalDir {
        model: &args.model,
        data: &args.data,
        seq: args.seq,
        batch: args.batch,
        threads: args.threads,
        document_eos: args.document_eos,
    };
    let outcome = evaluate_dir(call, inference_backend(args.device)?)?;
    for w in &outcome.warnings {
        eprintln!("warning: {w}");
    }
    println!("{}", serde_json::to_string(&outcome.report)?);
    check_finite(&outcome.report, call)?;
    Ok(())
}
