//! `ferrotron convert`: checkpoint → Hugging Face model directory, and back
//! ([`ferrotron_engine::convert`]).

use std::path::PathBuf;

use ferrotron_engine::convert::{convert, ConvertOptions, Converted};

/// Arguments of `convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// A checkpoint (a `step_N` folder or a checkpoint root) or a Hugging Face model
    /// directory (one with `config.json`).
    #[arg(long)]
    from: PathBuf,
    /// Output: a Hugging Face directory (from a checkpoint) or a checkpoint root (from a
    /// Hugging Face directory; the checkpoint is `<to>/step_00000000`).
    #[arg(long)]
    to: PathBuf,
    /// Weight dtype of an exported Hugging Face model: `f32` (default) or `bf16`. An import's
    /// precision is the run's `train.dtype`.
    #[arg(long)]
    dtype: Option<String>,
    /// Largest weight file of an exported model: bigger ones are written as shards with an
    /// index (bytes, or 500MB, 5GB, 2GiB …; transformers' default).
    #[arg(long, default_value = "50GB", value_parser = crate::train::parse_shard_size)]
    max_shard_size: u64,
    /// Configuration of the run an imported model is fine-tuned by (train, data sections;
    /// the model section comes from the directory).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a configuration value of an import (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Replace the model (or, importing, the checkpoints) already at `--to`; without it,
    /// such a `--to` is refused.
    #[arg(long)]
    overwrite: bool,
}

/// `ferrotron convert` ([`ferrotron_engine::convert`]): converts and says what it wrote.
pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let options = ConvertOptions {
        from: args.from,
        to: args.to,
        dtype: args.dtype,
        max_shard_size: args.max_shard_size,
        config: args.config,
        set: args.set,
        overwrite: args.overwrite,
    };
    match convert(&options)? {
        Converted::Imported(dir) => eprintln!(
            "checkpoint: {} (step 0; resume it under any layout with `ferrotron train --resume {}`)",
            dir.display(),
            dir.display()
        ),
        Converted::Exported { step, from, dtype } => eprintln!(
            "model: {} (step {step} of {}, {dtype:?})",
            options.to.display(),
            from.display()
        ),
    }
    Ok(())
}
