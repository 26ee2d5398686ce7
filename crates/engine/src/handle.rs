//! [`start`]: a run in the background, as a handle that yields the leader's step metrics as
//! they come and then the run's [`Outcome`].

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use ferrotron_train::stop::{StopCause, StopFlag};
use ferrotron_train::StepStats;

use crate::train::Prepared;
use crate::{Console, EngineError, Outcome, Result, TrainOptions};

/// A started run: an iterator over the leader's step metrics as they come, then
/// [`TrainHandle::wait`] for its [`Outcome`] (or the error that stopped it).
pub struct TrainHandle {
    steps: Receiver<StepStats>,
    stop: StopFlag,
    thread: JoinHandle<Result<Outcome>>,
}

/// Checks `options` before any work (returning what they refuse at once), then runs them in
/// the background, as [`crate::train`] does; `console` hears the run's lines.
///
/// # Errors
///
/// A refused option or path, configuration, data or checkpoint; or no thread to run on.
pub fn start(options: &TrainOptions, console: Arc<dyn Console>) -> Result<TrainHandle> {
    let (tx, steps) = mpsc::channel();
    let relay: Arc<dyn Console> = Arc::new(Relay { console, tx });
    let prepared = Prepared::new(options, relay)?;
    let stop = StopFlag::new();
    let flag = stop.clone();
    let thread = std::thread::Builder::new()
        .name("ferrotron-train".into())
        .spawn(move || prepared.run(flag))
        .map_err(|e| EngineError::Failed(format!("cannot start the run's thread: {e}")))?;
    Ok(TrainHandle {
        steps,
        stop,
        thread,
    })
}

impl TrainHandle {
    /// Asks the run to stop after the step in progress (every rank after the same step),
    /// saving a checkpoint of it where `checkpoint.on_stop` says so; [`Self::wait`] then
    /// returns [`Outcome::Interrupted`].
    pub fn stop(&self) {
        self.stop.request(StopCause::Requested);
    }

    /// Waits for the run to end: its [`Outcome`] (with the summary), or the error that
    /// stopped it.
    ///
    /// # Errors
    ///
    /// The run's error.
    pub fn wait(self) -> Result<Outcome> {
        drop(self.steps);
        self.thread
            .join()
            .map_err(|_| EngineError::Failed("the run's thread panicked".into()))?
    }
}

impl Iterator for TrainHandle {
    type Item = StepStats;

    /// The leader's next step, as soon as it is done; `None` once the run has ended.
    fn next(&mut self) -> Option<StepStats> {
        self.steps.recv().ok()
    }
}

/// The caller's console, with each of the leader's steps also sent to the handle.
struct Relay {
    console: Arc<dyn Console>,
    tx: Sender<StepStats>,
}

impl Console for Relay {
    fn say(&self, line: &str) {
        self.console.say(line);
    }

    fn begin(&self, done: usize, total: usize) {
        self.console.begin(done, total);
    }

    fn step(&self, stats: &StepStats) {
        // A caller that stopped listening does not stop the run.
        let _ = self.tx.send(stats.clone());
        self.console.step(stats);
    }

    fn end(&self) {
        self.console.end();
    }
}
