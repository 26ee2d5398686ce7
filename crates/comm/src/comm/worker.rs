//! A rank's worker thread: runs the rank's operations in issue order on the transport,
//! timing and tracing each, and turns a panic inside one into a failure of the world.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use ferrotron_tensor::trace::{Tracer, Track};
use ferrotron_tensor::Ledger;

use super::{Job, OpTiming, Transport};
use crate::error::CommError;
use crate::op::OpOutput;

/// The ledgers of a rank's worker: the rank's own, and the host staging ledger the transport
/// allocates on when the rank's memory is not host-accessible.
pub(super) struct Ledgers {
    pub rank: Ledger,
    pub staging: Option<Ledger>,
}

impl Ledgers {
    /// Where the transport allocates outputs.
    fn transport(&self) -> &Ledger {
        self.staging.as_ref().unwrap_or(&self.rank)
    }

    /// An output of the transport, on the rank's ledger.
    fn deliver(&self, out: OpOutput) -> OpOutput {
        match (&self.staging, out) {
            (Some(staging), OpOutput::Buf(b)) => OpOutput::Buf(b.restaged(staging, &self.rank)),
            (_, out) => out,
        }
    }
}

/// The loop of rank `rank`'s worker: each queued job executed on `transport`, its result
/// and timing sent back (the caller may have dropped its handle), until the queue closes.
pub(super) fn worker(
    rank: usize,
    transport: Arc<dyn Transport>,
    ledgers: Ledgers,
    jobs: mpsc::Receiver<Job>,
    tracer: Arc<Mutex<Option<Arc<Tracer>>>>,
) {
    for Job { op, reply } in jobs {
        let name = op.name();
        let tracing = tracer.lock().expect("tracer lock").clone();
        let details = tracing.as_ref().map(|_| {
            let group = op
                .group()
                .map(|g| format!("{g:?}"))
                .unwrap_or_else(|| "point-to-point".into());
            vec![("group", group), ("bytes", op.payload_bytes().to_string())]
        });
        let started = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| {
            let out = transport.execute(rank, op, ledgers.transport());
            out.map(|o| ledgers.deliver(o))
        }))
        .unwrap_or_else(|payload| {
            let reason = format!("{name} panicked: {}", panic_message(payload.as_ref()));
            transport.fail(rank, &reason);
            Err(CommError::PeerFailed { rank, reason })
        });
        // The caller may have dropped its handle; the operation still happened.
        let timing = OpTiming {
            started,
            finished: Instant::now(),
        };
        if let (Some(t), Some(args)) = (tracing, details) {
            t.record(
                Track::Comm,
                name,
                "collective",
                timing.started,
                timing.finished,
                args,
            );
        }
        let _ = reply.send((result, Some(timing)));
    }
}

/// The message of a panic payload (`&str` or `String`), or a placeholder.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}
