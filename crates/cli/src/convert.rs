//! `ferrotron convert`: checkpoint → Hugging Face model directory, and back.

use std::path::PathBuf;

use anyhow::Context;
use ferrotron_config::{Config, DType};
use ferrotron_train::checkpoint::{export_hf, import_hf, list_checkpoints, Checkpoint};

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

pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    if args.from.join("config.json").is_file() {
        if let Some(d) = &args.dtype {
            anyhow::bail!(
                "--dtype {d} applies to exporting a checkpoint; an imported model's precision \
                 is the run's train.dtype (--set train.dtype=bf16)"
            );
        }
        let base = Config::load(args.config.as_deref(), &args.set)?;
        let aside = args.to.join(".replaced-by-import");
        if let Some((step, _)) = list_checkpoints(&args.to).last() {
            anyhow::ensure!(
                args.overwrite,
                "--to {}: it already holds checkpoints (the newest at step {step}); pass \
                 --overwrite to replace them, or choose another directory",
                args.to.display()
            );
            // Moved aside, not deleted, until the import has succeeded.
            ferrotron_engine::overwrite::move_checkpoints(&args.to, &aside)?;
        }
        let dir = match import_hf(&args.from, &args.to, &base) {
            Ok(dir) => dir,
            Err(e) => {
                if aside.is_dir() {
                    ferrotron_engine::overwrite::move_checkpoints(&aside, &args.to)?;
                    std::fs::remove_dir(&aside)?;
                }
                return Err(e.into());
            }
        };
        if aside.is_dir() {
            std::fs::remove_dir_all(&aside)
                .with_context(|| format!("--to: deleting the replaced {}", aside.display()))?;
        }
        eprintln!(
            "checkpoint: {} (step 0; resume it under any layout with `ferrotron train --resume {}`)",
            dir.display(),
            dir.display()
        );
        return Ok(());
    }
    let dtype = match args.dtype.as_deref().unwrap_or("f32") {
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::Bf16,
        other => anyhow::bail!(
            "--dtype {other}: use f32 or bf16 (an fp16 run's --save-model writes float16; \
             convert writes f32 or bf16, which keeps f32's range)"
        ),
    };
    ferrotron_engine::overwrite::check_model_dir(&args.to, "--to", args.overwrite)?;
    let ck = Checkpoint::open(&args.from).with_context(|| {
        format!(
            "--from {} is neither a Hugging Face directory (no config.json) nor a checkpoint",
            args.from.display()
        )
    })?;
    ferrotron_engine::overwrite::clear_model_dir(&args.to, None, None)
        .with_context(|| format!("--to {}: deleting the replaced model", args.to.display()))?;
    export_hf(&ck, &args.to, dtype, args.max_shard_size)?;
    eprintln!(
        "model: {} (step {} of {}, {:?})",
        args.to.display(),
        ck.manifest.step,
        ck.dir.display(),
        dtype
    );
    Ok(())
}
