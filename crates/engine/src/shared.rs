//! What the ranks of this process share while they run.

use std::sync::{Arc, Mutex};

use ferrotron_train::stop::StopFlag;
use ferrotron_train::trace_files::TraceSink;
use ferrotron_train::RunSummary;

use crate::{Console, TrainOptions};

/// What this process's ranks share while they run: the request to stop early, where they
/// leave their traces and ledger peaks, the console and the run's options.
pub(crate) struct Shared {
    /// Raised by a signal (see [`crate::signals`]); every rank stops after the same step.
    pub(crate) stop: Option<StopFlag>,
    /// The traced ranks' timelines and every rank's ledger peak.
    pub(crate) sink: TraceSink,
    /// Where the run's lines and progress go.
    pub(crate) console: Arc<dyn Console>,
    /// The run's options.
    pub(crate) options: TrainOptions,
    /// The leader's summary, once written.
    pub(crate) summary: Mutex<Option<RunSummary>>,
}
