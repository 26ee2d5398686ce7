//! Between checkpoints and Hugging Face model directories: a trained model goes to
//! `transformers`, and a Hugging Face model becomes a step-0 checkpoint that resumes (is
//! fine-tuned) under any layout.

use std::path::{Path, PathBuf};

use ferrotron_config::{Config, DType};
use ferrotron_model::ParamLayout;
use ferrotron_tensor::{Category, CpuBackend, Device, Ledger, Store};

use crate::optim::CHECKPOINT;

use super::{Checkpoint, Kind};
use crate::hf::{load_model, save_model};
use crate::state::store_dtype;
use crate::{TrainError, Trainer};

/// Writes the checkpoint's model (its fp32 master, rounded once to `dtype`) as a Hugging
/// Face directory, in shards of at most `max_shard` bytes when larger.
pub fn export_hf(
    ck: &Checkpoint,
    dir: &Path,
    dtype: DType,
    max_shard: u64,
) -> Result<(), TrainError> {
    let model = &ck.manifest.config.model;
    let layout = ParamLayout::new(model);
    let master = ck.local(Kind::Master, &layout)?;
    let ledger = Ledger::new();
    let dev = Device {
        ledger: &ledger,
        backend: &CpuBackend::default(),
    };
    let store = Store::keep(
        dev,
        Category::Workspace,
        store_dtype(dtype),
        ledger.upload(Category::Workspace, CHECKPOINT, &master),
    );
    save_model(dir, model, &layout, &store, &ledger, max_shard)
}

/// Writes the Hugging Face model in `hf_dir` as the step-0 checkpoint of `base` (its model
/// section replaced by the directory's; `model.seq_len` is `max_position_embeddings`, and a
/// resumed run may train on shorter sequences with `--set model.seq_len=…`) under `root`:
/// master = the weights, Adam moments zero. Returns the checkpoint's folder.
pub fn import_hf(hf_dir: &Path, root: &Path, base: &Config) -> Result<PathBuf, TrainError> {
    if !super::list_checkpoints(root).is_empty() {
        return Err(TrainError::Checkpoint(format!(
            "{} already holds checkpoints: import into an empty directory (its `latest` would point at the imported step 0)",
            root.display()
        )));
    }
    let loaded = load_model(hf_dir)?;
    let mut config = base.clone();
    config.model = loaded.config;
    // Saved from one rank; the checkpoint loads into any layout afterwards.
    config.parallel = Default::default();
    config.train.threads = 1;
    config.validate()?;
    let trainer = Trainer::with_weights(config, &loaded.weights)?;
    trainer.save_checkpoint(root, usize::MAX)
}
