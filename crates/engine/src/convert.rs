//! `ferrotron convert` as a library call: a checkpoint → a Hugging Face model directory, or
//! a Hugging Face directory → a checkpoint of step 0 any layout can resume. What is already
//! at the destination is replaced only when asked, and only once the new one is written.

use std::path::{Path, PathBuf};

use ferrotron_config::{Config, DType};
use ferrotron_train::checkpoint::{export_hf, import_hf, list_checkpoints, Checkpoint};

use crate::overwrite::{check_model_dir, clear_model_dir, move_checkpoints};
use crate::{ensure, EngineError, Result};

/// A conversion: `ferrotron convert`'s flags.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// A checkpoint (a `step_N` folder or a checkpoint root) or a Hugging Face model
    /// directory (one with `config.json`).
    pub from: PathBuf,
    /// A Hugging Face directory (from a checkpoint) or a checkpoint root (from a Hugging
    /// Face directory).
    pub to: PathBuf,
    /// Weight dtype of an exported model: `f32` (default) or `bf16`.
    pub dtype: Option<String>,
    /// Largest weight file of an exported model, in bytes.
    pub max_shard_size: u64,
    /// Configuration of the run an imported model is fine-tuned by.
    pub config: Option<PathBuf>,
    /// Overrides of that configuration.
    pub set: Vec<String>,
    /// Replace the model (or, importing, the checkpoints) already at `to`.
    pub overwrite: bool,
}

/// What a conversion wrote.
#[derive(Debug)]
pub enum Converted {
    /// A Hugging Face directory imported as this checkpoint (step 0).
    Imported(PathBuf),
    /// A checkpoint exported as a Hugging Face directory.
    Exported {
        /// The checkpoint's step.
        step: usize,
        /// The checkpoint's folder.
        from: PathBuf,
        /// The weights' dtype.
        dtype: DType,
    },
}

/// Converts `options.from` into `options.to`, in whichever direction `from` asks.
///
/// # Errors
///
/// A refused option (an import's dtype, an occupied destination without `overwrite`, a
/// source that is neither a model nor a checkpoint), or the conversion's own error.
pub fn convert(options: &ConvertOptions) -> Result<Converted> {
    match options.from.join("config.json").is_file() {
        true => import(options).map(Converted::Imported),
        false => export(options),
    }
}

/// A Hugging Face directory → a checkpoint root; checkpoints already there are moved aside
/// until the import has succeeded.
fn import(options: &ConvertOptions) -> Result<PathBuf> {
    if let Some(d) = &options.dtype {
        return Err(EngineError::Refused(format!(
            "--dtype {d} applies to exporting a checkpoint; an imported model's precision is \
             the run's train.dtype (--set train.dtype=bf16)"
        )));
    }
    let base = Config::load(options.config.as_deref(), &options.set)?;
    let to = &options.to;
    let aside = to.join(".replaced-by-import");
    let failed = |what: &str, path: &Path| {
        let what = format!("--to: {what} {}", path.display());
        move |e: std::io::Error| EngineError::Failed(format!("{what}: {e}"))
    };
    if let Some((step, _)) = list_checkpoints(to).last() {
        ensure(options.overwrite, || {
            format!(
                "--to {}: it already holds checkpoints (the newest at step {step}); pass \
                 --overwrite to replace them, or choose another directory",
                to.display()
            )
        })?;
        move_checkpoints(to, &aside).map_err(failed("setting aside the checkpoints of", to))?;
    }
    match import_hf(&options.from, to, &base) {
        Ok(dir) => {
            if aside.is_dir() {
                std::fs::remove_dir_all(&aside).map_err(failed("deleting the replaced", &aside))?;
            }
            Ok(dir)
        }
        Err(e) => {
            if aside.is_dir() {
                move_checkpoints(&aside, to).map_err(failed("restoring", &aside))?;
                std::fs::remove_dir(&aside).map_err(failed("removing", &aside))?;
            }
            Err(e.into())
        }
    }
}

/// A checkpoint → a Hugging Face directory (its previous model replaced with `overwrite`).
fn export(options: &ConvertOptions) -> Result<Converted> {
    let dtype = match options.dtype.as_deref().unwrap_or("f32") {
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::Bf16,
        other => {
            return Err(EngineError::Refused(format!(
                "--dtype {other}: use f32 or bf16 (an fp16 run's --save-model writes float16; \
                 convert writes f32 or bf16, which keeps f32's range)"
            )))
        }
    };
    let to = &options.to;
    check_model_dir(to, "--to", options.overwrite)?;
    let ck = Checkpoint::open(&options.from).map_err(|e| {
        EngineError::Refused(format!(
            "--from {} is neither a Hugging Face directory (no config.json) nor a checkpoint: \
             {e}",
            options.from.display()
        ))
    })?;
    clear_model_dir(to, None, None).map_err(|e| {
        EngineError::Failed(format!(
            "--to {}: deleting the replaced model: {e}",
            to.display()
        ))
    })?;
    export_hf(&ck, to, dtype, options.max_shard_size)?;
    Ok(Converted::Exported {
        step: ck.manifest.step,
        from: ck.dir.clone(),
        dtype,
    })
}
