//! Checkpoints written in the background (`checkpoint.async`): at a step boundary every rank
//! copies what it owns to host memory (the ledger's `checkpoint` category), and a thread of
//! its own writes the copy while the next steps run. Rank 0's thread then waits until every
//! rank's file is in the partial folder (each appears whole: written under a temporary
//! name, synced, renamed) and finalizes the save as a synchronous one does, so until then
//! the previous checkpoint stays the latest, whatever kills the process.
//!
//! Completing a save ([`Trainer::complete_save`]) is collective, at points every rank
//! reaches after the same step: before the next save (so at most one snapshot exists), after
//! the last step and when a run stops early.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferrotron_tensor::Category;

use super::checkpoint::Snapshot;
use super::Trainer;
use crate::checkpoint::format::{rank_file_name, step_dir_name};
use crate::checkpoint::write_rank_file;
use crate::TrainError;

/// How often rank 0's writer looks for the other ranks' files.
const POLL: Duration = Duration::from_millis(2);

/// What a background save's thread reports.
#[derive(Debug, Clone)]
pub struct Written {
    /// The checkpoint's folder.
    pub path: PathBuf,
    /// Seconds from the start of the write to the checkpoint being complete (on rank 0;
    /// on other ranks, to their file being written).
    pub write_s: f64,
}

/// A save being written in the background.
pub struct InFlight {
    /// The step saved.
    pub step: usize,
    handle: Option<JoinHandle<Result<Written, TrainError>>>,
    /// Tells rank 0's thread to stop waiting for the other ranks' files (the run failed).
    cancel: Arc<AtomicBool>,
    written: Option<Written>,
    /// Seconds the step loop has waited for this save so far.
    pub blocked_s: f64,
}

impl InFlight {
    /// Whether this rank's thread has ended (its result not yet collected).
    pub fn finished(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| h.is_finished())
    }

    /// Waits for this rank's thread and collects its result; once collected, returns it
    /// again.
    pub fn join(&mut self) -> Result<&Written, TrainError> {
        if let Some(handle) = self.handle.take() {
            let written = handle.join().map_err(|_| {
                TrainError::Checkpoint(format!(
                    "the background writer of step {}'s checkpoint panicked",
                    self.step
                ))
            })??;
            self.written = Some(written);
        }
        self.written.as_ref().ok_or_else(|| {
            TrainError::Checkpoint(format!(
                "the background save of step {} failed before",
                self.step
            ))
        })
    }
}

impl Drop for InFlight {
    /// A save left behind by a failed run: its thread stops waiting for files that may never
    /// come; a write in progress ends first (the partial folder is never read).
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

impl Trainer {
    /// Starts saving the state after the steps taken so far as `root/step_NNNNNNNN` in the
    /// background: the snapshot is taken now (collective), the files are written by a thread
    /// of this rank while training goes on. [`Trainer::complete_save`] waits for it.
    pub fn save_in_background(
        &self,
        root: &std::path::Path,
        keep: usize,
    ) -> Result<InFlight, TrainError> {
        let start = Instant::now();
        let snapshot = self.snapshot(root, keep, Category::Checkpoint)?;
        let step = snapshot.step;
        let cancel = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&cancel);
        let handle = std::thread::Builder::new()
            .name(format!("checkpoint-writer-{}", self.rank()))
            .spawn(move || write(snapshot, &stop))
            .map_err(|e| {
                TrainError::Checkpoint(format!("starting the checkpoint writer thread: {e}"))
            })?;
        Ok(InFlight {
            step,
            handle: Some(handle),
            cancel,
            written: None,
            blocked_s: start.elapsed().as_secs_f64(),
        })
    }

    /// Waits until `save` is a complete checkpoint, visible to every rank. Collective: each
    /// rank but 0 waits for its own file, all meet, then rank 0 (whose thread finds every
    /// file) finalizes and all meet again.
    pub fn complete_save(&self, save: &mut InFlight) -> Result<Written, TrainError> {
        let start = Instant::now();
        if self.rank() != 0 {
            save.join()?;
        }
        self.world_barrier()?;
        let written = save.join()?.clone();
        self.world_barrier()?;
        save.blocked_s += start.elapsed().as_secs_f64();
        Ok(written)
    }
}

/// The writer thread: this rank's file, then on rank 0 the wait for the others' and the
/// final step.
fn write(snapshot: Snapshot, cancel: &AtomicBool) -> Result<Written, TrainError> {
    let start = Instant::now();
    write_rank_file(&snapshot.rank_file, &snapshot.pieces)?;
    drop(snapshot.pieces);
    let path = match snapshot.finish {
        Some(finish) => {
            wait_for_files(&finish.partial, finish.ranks, cancel, snapshot.step)?;
            finish.run()?
        }
        None => snapshot.root.join(step_dir_name(snapshot.step)),
    };
    Ok(Written {
        path,
        write_s: start.elapsed().as_secs_f64(),
    })
}

/// Waits until `partial` holds the files of all `ranks`, or `cancel` is raised.
fn wait_for_files(
    partial: &std::path::Path,
    ranks: usize,
    cancel: &AtomicBool,
    step: usize,
) -> Result<(), TrainError> {
    let mut next = 0;
    while next < ranks {
        if partial.join(rank_file_name(next)).is_file() {
            next += 1;
            continue;
        }
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Checkpoint(format!(
                "the background save of step {step} was abandoned: rank {next}'s file never came (the run failed)"
            )));
        }
        std::thread::sleep(POLL);
    }
    Ok(())
}
