//! SIGTERM, SIGINT and SIGUSR1 as a request to stop at the next step boundary: what Slurm
//! and preemptible machines send before the kill (Slurm's `--signal=USR1@90`, Megatron's
//! `--exit-signal-handler`). The first signal raises the run's [`StopFlag`]: every rank
//! stops after the same step, saves a checkpoint of it and writes an `interrupted`
//! summary. If that takes longer than `run.signal_grace_s`, the process exits anyway; a
//! second signal exits at once. Either way the last complete checkpoint stays intact, since
//! checkpoints are written into a partial folder and renamed into place.
//!
//! `sweep` installs the same handlers without the exit on a second signal, and forwards
//! each signal to the run in progress ([`received`]).
//!
//! A signal handler is process-wide by nature, so its state is the one set of statics
//! here: the first and the latest signal's number and how many arrived. A watcher thread
//! turns it into the run's flag.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferrotron_train::stop::{signal_name, StopCause, StopFlag};

use crate::{say, Console};

/// The first signal received (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);
/// The latest signal received (0: none).
static LATEST: AtomicI32 = AtomicI32::new(0);
/// Signals received so far.
static RECEIVED: AtomicU32 = AtomicU32::new(0);
/// Whether a second signal ends the process at once.
static EXIT_ON_SECOND: AtomicBool = AtomicBool::new(true);

/// The signals that stop a run gracefully.
pub const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1];

/// The exit status of a process that stops for signal `n` (the shell's convention).
pub fn exit_status(n: i32) -> u8 {
    u8::try_from(128 + n).unwrap_or(1)
}

/// Async-signal-safe: atomic stores, or `_exit` on the second signal.
extern "C" fn on_signal(n: libc::c_int) {
    LATEST.store(n, Ordering::SeqCst);
    let _ = PENDING.compare_exchange(0, n, Ordering::SeqCst, Ordering::SeqCst);
    if RECEIVED.fetch_add(1, Ordering::SeqCst) > 0 && EXIT_ON_SECOND.load(Ordering::SeqCst) {
        // SAFETY: `_exit` is async-signal-safe; the last complete checkpoint is on disk.
        unsafe { libc::_exit(i32::from(exit_status(n))) };
    }
}

/// The first signal received and how many arrived, with the latest one (None: none yet).
pub fn received() -> Option<Received> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        count => Some(Received {
            first: PENDING.load(Ordering::SeqCst),
            latest: LATEST.load(Ordering::SeqCst),
            count,
        }),
    }
}

/// What [`received`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// The first signal's number.
    pub first: i32,
    /// The latest signal's number.
    pub latest: i32,
    /// How many arrived.
    pub count: u32,
}

/// Installs the handlers: each signal is recorded for [`received`]; with `exit_on_second`,
/// a second signal ends the process at once.
pub fn install(exit_on_second: bool) -> std::io::Result<()> {
    EXIT_ON_SECOND.store(exit_on_second, Ordering::SeqCst);
    for n in STOP_SIGNALS {
        // SAFETY: installs a handler that only touches atomics (or calls `_exit`); the
        // `sigaction` struct is zeroed and then filled as POSIX requires.
        let failed = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(n, &action, std::ptr::null_mut()) != 0
        };
        if failed {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Installs the handlers and starts the watcher: the returned flag is raised by the first
/// signal, and the process exits `grace` after it if it has not ended by then.
pub fn watch(flag: StopFlag, grace: Duration, console: Arc<dyn Console>) -> std::io::Result<()> {
    install(true)?;
    std::thread::Builder::new()
        .name("ferrotron-signals".into())
        .spawn(move || watcher(flag, grace, &*console))?;
    Ok(())
}

/// Waits for the first signal, raises `flag`, and ends the process `grace` later.
fn watcher(flag: StopFlag, grace: Duration, console: &dyn Console) {
    let n = loop {
        match PENDING.load(Ordering::SeqCst) {
            0 => std::thread::sleep(Duration::from_millis(20)),
            n => break n,
        }
    };
    let name = signal_name(n);
    say!(
        console,
        "{name} received: stopping after the step in progress and saving a checkpoint of it \
         (within run.signal_grace_s = {} s; a second signal exits at once)",
        grace.as_secs_f64()
    );
    flag.request(StopCause::Signal(n));
    std::thread::sleep(grace);
    say!(
        console,
        "{name}: the step and its checkpoint did not finish within run.signal_grace_s = {} s; \
         exiting (the last complete checkpoint is intact)",
        grace.as_secs_f64()
    );
    std::process::exit(i32::from(exit_status(n)));
}

/// A command that a signal stopped after it saved what it could: the process exits with
/// 128 + the signal's number, as a process the signal ended would (1 for a caller's stop).
#[derive(Debug)]
pub struct Interrupted {
    /// Why.
    pub cause: StopCause,
    /// What was stopped and where its state is.
    pub message: String,
}

impl Interrupted {
    /// The process's exit status.
    pub fn exit_status(&self) -> u8 {
        match self.cause {
            StopCause::Signal(n) => exit_status(n),
            StopCause::Requested => 1,
        }
    }
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Interrupted {}
