//! What `--overwrite` may replace, checked before any work: a Hugging Face model directory
//! (`train --save-model`, `convert --to`), a replaced run's checkpoints. Without the flag,
//! nothing already there is written over.

use std::path::{Path, PathBuf};

use ferrotron_train::checkpoint::format::LATEST;
use ferrotron_train::checkpoint::list_checkpoints;

use crate::{ensure, say, Console, EngineError, Result};

/// The first file of a Hugging Face model in `dir` (its `config.json`, a `*.safetensors`
/// weight file or their index), if there is one.
fn model_file(dir: &Path) -> Option<PathBuf> {
    let config = dir.join("config.json");
    if config.is_file() {
        return Some(config);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && is_weight_file(p))
        .collect();
    found.sort();
    found.into_iter().next()
}

fn is_weight_file(p: &Path) -> bool {
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
    name.is_some_and(|n| n.ends_with(".safetensors") || n == "model.safetensors.index.json")
}

/// Refuses a model directory `dir` (named by `flag`) that already holds a model, unless
/// `overwrite`.
pub fn check_model_dir(dir: &Path, flag: &str, overwrite: bool) -> Result<()> {
    ensure(!dir.join("manifest.json").exists(), || {
        format!(
            "{flag} {}: it is a checkpoint's folder (it holds manifest.json), which a model is \
             never written over, --overwrite or not; choose another directory",
            dir.display()
        )
    })?;
    match model_file(dir) {
        Some(file) if !overwrite => Err(EngineError::Refused(format!(
            "{flag} {}: it already holds a model ({}); pass --overwrite to replace it, or \
             choose another directory",
            dir.display(),
            file.display()
        ))),
        _ => Ok(()),
    }
}

/// The tokenizer's files a Hugging Face model directory may hold beside its weights: what
/// `train --init-from` carries over to `--save-model`.
const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

/// Deletes the model files in `dir` (`config.json`, `*.safetensors`, their index, the
/// `TOKENIZER_FILES`) before a replacement is written, so that nothing of the old model
/// stays beside the new one.
///
/// The tokenizer files stay when `dir` is also the `--init-from` directory `source`, or holds
/// the tokenizer the training `data` was prepared with: they are the ones the saved model is
/// given.
pub fn clear_model_dir(
    dir: &Path,
    source: Option<&Path>,
    data: Option<&Path>,
) -> std::io::Result<()> {
    let data_tokenizer_here = data_tokenizer(data)
        .and_then(|t| t.parent().map(|p| same_dir(p, dir)))
        .unwrap_or(false);
    let keep_tokenizer = source.is_some_and(|s| same_dir(s, dir)) || data_tokenizer_here;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let tokenizer = !keep_tokenizer && TOKENIZER_FILES.contains(&name.as_str());
        let ours = name == "config.json" || tokenizer;
        if p.is_file() && (ours || is_weight_file(&p)) {
            std::fs::remove_file(&p)?;
        }
    }
    Ok(())
}

/// The `tokenizer.json` the token file `data`'s sidecar records, if any.
fn data_tokenizer(data: Option<&Path>) -> Option<PathBuf> {
    data.and_then(|d| ferrotron_data::read_sidecar_of(d).ok())
        .and_then(|s| s.tokenizer)
}

/// Whether `a` and `b` name the same existing directory.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Copies the [`TOKENIZER_FILES`] that `from` (a `--init-from` model) holds into `to` (its
/// fine-tuned copy), so that `generate` and transformers read text with it.
fn copy_tokenizer(from: &Path, to: &Path) -> std::io::Result<()> {
    if same_dir(from, to) {
        return Ok(());
    }
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.is_file() {
            std::fs::copy(&src, to.join(name))?;
        }
    }
    Ok(())
}

/// Puts the tokenizer beside a saved model `dir`: `init_from`'s files, else the one the
/// training data's sidecar records.
pub fn save_tokenizer(
    init_from: Option<&Path>,
    cfg: &ferrotron_config::Config,
    dir: &Path,
    console: &dyn Console,
) -> std::result::Result<(), String> {
    let copied = match init_from {
        Some(from) => copy_tokenizer(from, dir),
        None => copy_data_tokenizer(cfg.data.path.as_deref(), dir, console),
    };
    copied.map_err(|e| format!("--save-model {}: copying the tokenizer: {e}", dir.display()))
}

/// Copies the `tokenizer.json` the training data `data` was tokenized with (its sidecar's
/// record, [`ferrotron_data::Sidecar::tokenizer`]) into the model directory `to`; warns when
/// the recorded file is gone. Nothing for the synthetic corpus or bytes.
fn copy_data_tokenizer(
    data: Option<&Path>,
    to: &Path,
    console: &dyn Console,
) -> std::io::Result<()> {
    let Some(src) = data_tokenizer(data) else {
        return Ok(());
    };
    let dst = to.join("tokenizer.json");
    if std::fs::canonicalize(&src).ok() == std::fs::canonicalize(&dst).ok() {
        // Already there (copying a file onto itself would empty it).
        return Ok(());
    }
    if !src.is_file() {
        say!(
            console,
            "warning: the data's tokenizer {} (recorded by prepare-data) is gone: the saved \
             model has no tokenizer.json; copy it there by hand",
            src.display()
        );
        return Ok(());
    }
    std::fs::copy(&src, dst).map(|_| ())
}

/// With `--overwrite` on a fresh run: the checkpoint root `root` of run directory `run_dir`
/// goes with the replaced run, which `--overwrite` may clear only inside `run_dir`. A root
/// elsewhere that holds checkpoints is refused here, before any work.
pub fn check_checkpoint_root(run_dir: &Path, root: &Path) -> Result<()> {
    if inside(root, run_dir) {
        return Ok(());
    }
    let found = list_checkpoints(root);
    if let Some((step, _)) = found.last() {
        return Err(EngineError::Refused(format!(
            "--overwrite: checkpoint.dir {} holds {} checkpoint(s) (the newest at step {step}) \
             outside run.dir {}, which --overwrite does not delete; delete them, or set \
             checkpoint.dir to another directory",
            root.display(),
            found.len(),
            run_dir.display()
        )));
    }
    Ok(())
}

/// Whether `path` lies inside `dir` (by their absolute paths where they exist).
fn inside(path: &Path, dir: &Path) -> bool {
    let abs = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let dir = abs(dir);
    // The root may not exist yet: compare its nearest existing ancestor.
    path.ancestors()
        .find(|a| a.exists())
        .map(|a| abs(a).join(path.strip_prefix(a).unwrap_or(Path::new(""))))
        .is_some_and(|p| p.starts_with(&dir))
}

/// Moves the checkpoints of `from` (its `latest` and every `step_N` folder) into `to`,
/// created if needed: a replaced root set aside until its replacement is written.
pub fn move_checkpoints(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == LATEST || name.starts_with("step_") {
            std::fs::rename(entry.path(), to.join(&name))?;
        }
    }
    Ok(())
}

/// `--overwrite` on a fresh run: the replaced run's checkpoints under `root` go with it
/// (`--resume latest` must not continue it), once the evaluation file, the last input not
/// yet checked, is known good.
pub fn replace_run(
    cfg: &ferrotron_config::Config,
    root: &Path,
    console: &dyn Console,
) -> std::result::Result<(), ferrotron_train::TrainError> {
    if let Some(path) = &cfg.data.eval_path {
        ferrotron_data::check_vocab_of(path, cfg.model.vocab)?;
    }
    ferrotron_train::tensorboard::clear_event_files(&cfg.run.dir.join("tensorboard"))?;
    clear_checkpoints(&cfg.run.dir, root, console).map_err(ferrotron_train::TrainError::RunDir)
}

/// Deletes the checkpoints of the run `--overwrite` replaces (under `root`, inside run.dir:
/// [`check_checkpoint_root`] refused any elsewhere), saying so.
pub fn clear_checkpoints(
    run_dir: &Path,
    root: &Path,
    console: &dyn Console,
) -> std::result::Result<(), String> {
    if !inside(root, run_dir) {
        // Elsewhere nothing is deleted: complete checkpoints there were refused before any
        // work, and `--resume latest` never takes a partial one.
        return Ok(());
    }
    let removed =
        ferrotron_train::checkpoint::clear_checkpoints(root).map_err(|e| e.to_string())?;
    if removed > 0 {
        say!(
            console,
            "--overwrite: deleted the replaced run's {removed} checkpoint folder(s) in {}",
            root.display()
        );
    }
    Ok(())
}
