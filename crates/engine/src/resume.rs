//! The run's configuration before any rank starts: loaded with its overrides, resumed from
//! a checkpoint or initialised from a Hugging Face model, and the output directories it
//! will write checked.

use std::path::Path;

use ferrotron_config::Config;
use ferrotron_train::checkpoint::{Checkpoint, DataChange};
use ferrotron_train::hf::load_model;

use crate::{ensure, say, Console, EngineError, Result, TrainOptions};

/// Opens (and verifies) the checkpoint `spec` names and returns it with the run's
/// configuration: `options`' own if it gives one, else the checkpoint's; `options.set` applies
/// on top.
pub(crate) fn open_resume(
    options: &TrainOptions,
    config: Config,
    spec: &Path,
    console: &dyn Console,
) -> Result<(Config, Checkpoint)> {
    let path = if spec == Path::new("latest") {
        let root = config.checkpoint.dir_for(&config.run.dir);
        ensure(
            !ferrotron_train::checkpoint::list_checkpoints(&root).is_empty(),
            || {
                format!(
                    "--resume latest: there is no checkpoint in {} (checkpoint.dir of run.dir \
                     {}); a run saves checkpoints only with checkpoint.every = N (0, the \
                     default, saves none). Start a fresh run, or pass --resume a step_N folder \
                     or a checkpoint root",
                    root.display(),
                    config.run.dir.display()
                )
            },
        )?;
        root
    } else {
        spec.to_path_buf()
    };
    let checkpoint = Checkpoint::open(&path)?;
    let config = match options.gives_config() {
        true => config,
        false => checkpoint.manifest.config.with_overrides(&options.set)?,
    };
    let at = checkpoint.manifest.step;
    ensure(at < config.train.steps, || {
        format!(
            "--resume {}: the checkpoint is at step {at}, and train.steps = {} leaves nothing \
             to train; set train.steps above {at} to continue",
            checkpoint.dir.display(),
            config.train.steps,
        )
    })?;
    let change = checkpoint.check_data(&config, options.allow_data_change)?;
    if let DataChange::Changed { from, to } = change {
        say!(
            console,
            "note: --allow-data-change: continuing on {} (the checkpoint consumed {}); the \
             data position carries over as a sample index",
            to.describe(),
            from.describe()
        );
    }
    say!(
        console,
        "resuming from {} (step {at}, {} samples consumed, saved as {})",
        checkpoint.dir.display(),
        checkpoint.manifest.samples_done,
        checkpoint.manifest.config.describe_layout(),
    );
    Ok((config, checkpoint))
}

/// The weights of the Hugging Face model in `dir`, its shape taking the place of
/// `config`'s model (the configured sequence length kept, with a warning past the model's).
pub(crate) fn init_from(
    dir: &Path,
    config: &mut Config,
    console: &dyn Console,
) -> Result<Vec<f32>> {
    let loaded = load_model(dir)?;
    let seq_len = config.model.seq_len;
    let trained = loaded.config.seq_len;
    if seq_len > trained {
        say!(
            console,
            "warning: model.seq_len = {seq_len} uses positions beyond the model's \
             max_position_embeddings = {trained}: its quality there is untested"
        );
    }
    config.model = ferrotron_config::ModelConfig {
        seq_len,
        ..loaded.config
    };
    config.validate()?;
    Ok(loaded.weights)
}

/// Checks, before any work, that `dir` can be created (or is a directory) and written:
/// the nearest existing ancestor must be a writable directory.
pub fn check_output_dir(dir: &Path, flag: &str) -> Result<()> {
    let existing = dir
        .ancestors()
        .find(|a| a.as_os_str().is_empty() || a.exists())
        .map(|a| match a.as_os_str().is_empty() {
            true => Path::new("."),
            false => a,
        })
        .unwrap_or(Path::new("."));
    ensure(existing.is_dir(), || {
        format!(
            "{flag} {}: {} is a file, not a directory; choose another path",
            dir.display(),
            existing.display()
        )
    })?;
    // Named for this process and thread: runs started in parallel from one process (the
    // library's callers) probe the same directory at once.
    let probe = existing.join(format!(
        ".ferrotron-write-check-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&probe, b"")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| {
            EngineError::Refused(format!(
                "{flag} {}: cannot write in {} ({e}); choose a writable path",
                dir.display(),
                existing.display()
            ))
        })
}
