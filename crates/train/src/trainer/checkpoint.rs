//! Saving a trainer's state as a sharded checkpoint, and what resuming needs from one.

use std::path::{Path, PathBuf};

use ferrotron_comm::GroupKind;
use ferrotron_config::Config;

use super::Trainer;
use crate::checkpoint::format::{partial_dir_name, rank_file_name, step_dir_name, FORMAT};
use crate::checkpoint::{
    finalize, owned_pieces, prepare_partial, write_rank_file, Checkpoint, Kind, Manifest,
    OwnedPiece,
};
use crate::state::TrainState;
use crate::TrainError;
use ferrotron_tensor::Category;

use crate::optim::CHECKPOINT;

/// Refuses a checkpoint whose model or seed differ from `config`'s: its tensors would not
/// fit, or its data position would point into another data order.
pub(super) fn check_compatible(config: &Config, manifest: &Manifest) -> Result<(), TrainError> {
    let theirs = serde_json::to_value(&manifest.config.model).expect("serialisable");
    let ours = serde_json::to_value(&config.model).expect("serialisable");
    if let (Some(theirs), Some(ours)) = (theirs.as_object(), ours.as_object()) {
        for (field, value) in ours {
            // seq_len may change (e.g. fine-tuning an imported model on shorter sequences),
            // but not in the middle of a token file's order, which depends on it.
            let moved = manifest.samples_done > 0 && config.data.reads_files();
            // The padding of the vocabulary under TP is a layout: checkpoints hold the real
            // rows only.
            // The capacity factor is a routing setting, not a shape: it may change.
            let layout_only = field == "vocab_multiple" || field == "moe_capacity_factor";
            if !layout_only && (field != "seq_len" || moved) && theirs.get(field) != Some(value) {
                return Err(TrainError::Checkpoint(format!(
                    "model.{field} = {value} but the checkpoint was saved with {}: resume with the checkpoint's model section",
                    theirs.get(field).cloned().unwrap_or_default()
                )));
            }
        }
    }
    let (ours, theirs) = (config.train.optimizer, manifest.config.train.optimizer);
    if ours != theirs {
        return Err(TrainError::Checkpoint(format!(
            "train.optimizer = \"{}\" but the checkpoint was saved with \"{}\": its moments mean \
             other things under each (Muon keeps one momentum per matrix, AdamW two moments); \
             resume with train.optimizer = \"{}\", or export its weights (`ferrotron convert`) and \
             start a new run from them (`train --init-from`)",
            ours.name(),
            theirs.name(),
            theirs.name()
        )));
    }
    if config.train.seed != manifest.seed {
        return Err(TrainError::Checkpoint(format!(
            "train.seed = {} but the checkpoint was saved with {}: the seed fixes the data order, so resuming with another one would repeat or skip samples; drop the override",
            config.train.seed, manifest.seed
        )));
    }
    Ok(())
}

/// Fills this rank's shard of both Adam moments from the checkpoint.
/// One moment at a time, so loading holds one stage-sized buffer besides the state (counted
/// as workspace).
pub(super) fn load_moments(
    state: &mut TrainState,
    ck: &Checkpoint,
    dev: ferrotron_tensor::Device<'_>,
) -> Result<(), TrainError> {
    for kind in [Kind::ExpAvg, Kind::ExpAvgSq] {
        let full = ck.local(kind, &state.layout)?;
        let full = dev.ledger.upload(Category::Workspace, CHECKPOINT, &full);
        let dst = if kind == Kind::ExpAvg {
            &mut state.m
        } else {
            &mut state.v
        };
        for (_, range, at) in state.plan.pieces(state.dp_rank) {
            dev.backend
                .copy(&mut dst[at..at + range.len()], &full[range]);
        }
    }
    Ok(())
}

impl Trainer {
    /// Training samples consumed so far (the data position).
    pub fn samples_done(&self) -> u64 {
        self.position.samples_done
    }

    /// Waits until every rank of the run reaches this point (no-op on a single rank).
    pub fn world_barrier(&self) -> Result<(), TrainError> {
        let Some(world) = self.mesh.link(GroupKind::World) else {
            return Ok(());
        };
        world.comm.barrier(&world.group).wait()?;
        Ok(())
    }

    /// Saves the state after the steps taken so far as `root/step_NNNNNNNN`. Collective:
    /// every rank writes what it owns into a partial folder; rank 0 then writes the manifest,
    /// renames the folder into place, points `root/latest` at it and keeps the newest `keep`.
    /// A crash at any point leaves the previous checkpoint whole and still the latest.
    pub fn save_checkpoint(&self, root: &Path, keep: usize) -> Result<PathBuf, TrainError> {
        let snapshot = self.snapshot(root, keep, Category::Workspace)?;
        // Every rank writes a file, even an empty one, so rank 0 can tell a missing file
        // (a filesystem the ranks do not share) from a rank that owns nothing.
        write_rank_file(&snapshot.rank_file, &snapshot.pieces)?;
        drop(snapshot.pieces);
        self.world_barrier()?;
        let result = match snapshot.finish {
            Some(finish) => finish.run(),
            None => Ok(snapshot.root.join(step_dir_name(snapshot.step))),
        };
        // Nobody returns before the checkpoint is visible, so an immediate load finds it.
        self.world_barrier()?;
        result
    }

    /// The first half of a save, at a step boundary: rank 0 empties the partial folder, then
    /// every rank copies what it owns to host memory, counted under `category` until the
    /// snapshot's pieces are dropped. Collective.
    pub(super) fn snapshot(
        &self,
        root: &Path,
        keep: usize,
        category: Category,
    ) -> Result<Snapshot, TrainError> {
        let step = self.position.step;
        if self.rank() == 0 {
            std::fs::create_dir_all(root).map_err(crate::io_err("create directory", root))?;
            prepare_partial(root, step)?;
        }
        self.world_barrier()?;
        let partial = root.join(partial_dir_name(step));
        let (tp, tp_rank) = self.mesh.coords(GroupKind::Tp);
        // The pieces copy this rank's share of the state once, until the file is written
        // (each counts its own bytes under `category`).
        let pieces = self
            .device
            .pool
            .install(|| owned_pieces(&self.state, self.device.dev(), (tp, tp_rank), category));
        let finish = (self.rank() == 0).then(|| Finish {
            root: root.to_path_buf(),
            partial: partial.clone(),
            manifest: Manifest {
                format: FORMAT.into(),
                step,
                samples_done: self.position.samples_done,
                seed: self.config.train.seed,
                config: self.config.clone(),
                files: Vec::new(),
                data: Some(self.data.fingerprint()),
                expert_bias: self.expert_bias.layers().map(|_| self.expert_bias.blocks()),
                loss_scale: self.scaler.as_ref().map(|s| s.state()),
                fp8_amax_history: self.fp8_history.as_ref().map(|h| h.save()),
            },
            keep,
            ranks: self.config.parallel.world_size(),
            abort: self.faults.abort_in_save == Some(step),
        });
        Ok(Snapshot {
            step,
            root: root.to_path_buf(),
            rank_file: partial.join(rank_file_name(self.rank())),
            pieces,
            finish,
        })
    }
}

/// A rank's share of a save, copied at a step boundary.
pub(super) struct Snapshot {
    /// The step saved.
    pub step: usize,
    /// The checkpoint root.
    pub root: PathBuf,
    /// Where this rank's file goes (in the partial folder).
    pub rank_file: PathBuf,
    /// What this rank owns, as host bytes.
    pub pieces: Vec<OwnedPiece>,
    /// On rank 0: what makes the written files a checkpoint.
    pub finish: Option<Finish>,
}

/// Rank 0's last part of a save, once every rank's file is written: the manifest, the
/// rename into place, `latest` and pruning.
pub(super) struct Finish {
    root: PathBuf,
    /// The partial folder the rank files are written into.
    pub partial: PathBuf,
    manifest: Manifest,
    keep: usize,
    /// Ranks of the run (one file each).
    pub ranks: usize,
    /// Fault injection: abort the process here, after the rank files, before the manifest.
    abort: bool,
}

impl Finish {
    /// Finalizes the save (see [`finalize`]).
    pub fn run(self) -> Result<PathBuf, TrainError> {
        if self.abort {
            std::process::abort();
        }
        finalize(
            &self.root,
            &self.partial,
            self.manifest,
            self.keep,
            self.ranks,
        )
    }
}
