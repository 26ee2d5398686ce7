//! Stopping a run early, at a step boundary: a caller (the CLI's signal watcher, a library
//! user's [`crate::RunHandle::stop`]) raises a [`StopFlag`]; after each step every rank
//! reduces its flag over the world, so that all of them stop after the same step even when
//! the request reached them at different moments; the hooks then save what they keep
//! ([`crate::StepHook::on_stop`]) and the run reports where it stopped ([`Stopped`]).

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use ferrotron_comm::{CommBuf, CommError, ReduceOp};
use ferrotron_parallel::GroupComm;
use ferrotron_tensor::{Category, Ledger};

/// The label of the transfers that carry the ranks' stop requests.
pub const STOP_REQUEST: &str = "stop request";

/// Slots of the reduced request: 0 for a caller's request, 1..=64 for a signal's number.
const SLOTS: usize = 65;

/// Why a run stops before its last step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// A caller asked (e.g. [`crate::RunHandle::stop`]).
    Requested,
    /// The process received this signal (its number).
    Signal(i32),
}

impl StopCause {
    fn slot(self) -> usize {
        match self {
            StopCause::Requested => 0,
            StopCause::Signal(n) => (n.clamp(1, SLOTS as i32 - 1)) as usize,
        }
    }

    fn of_slot(slot: usize) -> StopCause {
        match slot {
            0 => StopCause::Requested,
            n => StopCause::Signal(n as i32),
        }
    }

    /// `SIGTERM`, `SIGINT`, `SIGUSR1`… (or `signal N`), or `requested`.
    pub fn name(self) -> String {
        match self {
            StopCause::Requested => "requested".into(),
            StopCause::Signal(n) => signal_name(n),
        }
    }
}

/// The usual name of signal `n` on this platform.
pub fn signal_name(n: i32) -> String {
    let known = [
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGHUP, "SIGHUP"),
    ];
    known
        .iter()
        .find(|(k, _)| *k == n)
        .map_or_else(|| format!("signal {n}"), |(_, name)| name.to_string())
}

/// A request to stop at the next step boundary, shared by whoever asks and the ranks (one
/// flag per run, cloned to every rank of the process).
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicI32>);

impl StopFlag {
    /// A flag nobody has raised.
    pub fn new() -> Self {
        StopFlag::default()
    }

    /// Asks the run to stop after the step in progress (the first request is kept).
    pub fn request(&self, cause: StopCause) {
        let code = match cause {
            StopCause::Requested => -1,
            StopCause::Signal(n) => n.max(1),
        };
        let _ = self
            .0
            .compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The request, if one was made.
    pub fn requested(&self) -> Option<StopCause> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            -1 => Some(StopCause::Requested),
            n => Some(StopCause::Signal(n)),
        }
    }
}

/// Where a run stopped before `train.steps`, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    /// The last step taken (the checkpoint hook saves this step).
    pub step: usize,
    /// Why.
    pub cause: StopCause,
}

/// Whether the run stops now, the same answer on every rank of `world` (None: a single
/// rank): each rank's request is summed over the world (one small reduction per step). The
/// lowest slot present wins: a caller's request, then the lowest signal number.
pub fn agree(
    flag: &StopFlag,
    world: Option<&GroupComm>,
    ledger: &Ledger,
) -> Result<Option<StopCause>, CommError> {
    let local = flag.requested();
    let Some(world) = world else {
        return Ok(local);
    };
    let mut slots = vec![0f32; SLOTS];
    if let Some(cause) = local {
        slots[cause.slot()] = 1.0;
    }
    let mine = ledger.upload(Category::Communication, STOP_REQUEST, &slots);
    let handle = world
        .comm
        .all_reduce(&world.group, CommBuf::F32(mine), ReduceOp::Sum);
    let summed = world.comm.wait(handle, STOP_REQUEST)?;
    let summed = summed
        .into_f32()
        .unwrap_or_else(|_| unreachable!("f32 reductions return f32"));
    let summed = ledger.download(STOP_REQUEST, &summed);
    Ok(summed.iter().position(|&n| n > 0.0).map(StopCause::of_slot))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_request_is_kept_and_read_back() {
        let flag = StopFlag::new();
        assert_eq!(flag.requested(), None);
        flag.request(StopCause::Signal(libc::SIGTERM));
        flag.request(StopCause::Requested);
        assert_eq!(flag.requested(), Some(StopCause::Signal(libc::SIGTERM)));
        assert_eq!(
            flag.requested().map(StopCause::name).as_deref(),
            Some("SIGTERM")
        );
        let asked = StopFlag::new();
        asked.request(StopCause::Requested);
        assert_eq!(asked.requested(), Some(StopCause::Requested));
    }

    #[test]
    fn causes_round_trip_through_their_slots() {
        for cause in [
            StopCause::Requested,
            StopCause::Signal(libc::SIGINT),
            StopCause::Signal(libc::SIGUSR1),
        ] {
            assert_eq!(StopCause::of_slot(cause.slot()), cause);
        }
    }
}
