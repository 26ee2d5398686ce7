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
use std::sync::{Arc, Weak};
use std::time::Duration;

use ferrotron_train::stop::{signal_name, StopCause, StopFlag};

use crate::Console;

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

/// The handlers installed by [`install`] or [`watch`], for as long as this lives: dropping
/// it stops the watcher and puts back the handlers that were there before, so a library
/// caller's process gets its own signal handling back when the run ends.
pub struct SignalGuard {
    /// The handlers replaced, to put back.
    previous: Vec<(libc::c_int, libc::sigaction)>,
    /// Raised when the guard drops: the watcher returns instead of ending the process.
    done: Arc<AtomicBool>,
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        for (n, action) in &self.previous {
            // SAFETY: puts back a handler `sigaction` returned for this signal.
            unsafe {
                libc::sigaction(*n, action, std::ptr::null_mut());
            }
        }
    }
}

/// Installs the handlers: each signal is recorded for [`received`] (counting from none);
/// with `exit_on_second`, a second signal ends the process at once. The handlers stay
/// until the returned guard drops.
pub fn install(exit_on_second: bool) -> std::io::Result<SignalGuard> {
    EXIT_ON_SECOND.store(exit_on_second, Ordering::SeqCst);
    for counter in [&PENDING, &LATEST] {
        counter.store(0, Ordering::SeqCst);
    }
    RECEIVED.store(0, Ordering::SeqCst);
    let mut guard = SignalGuard {
        previous: Vec::new(),
        done: Arc::new(AtomicBool::new(false)),
    };
    for n in STOP_SIGNALS {
        // SAFETY: installs a handler that only touches atomics (or calls `_exit`); the
        // `sigaction` structs are zeroed and then filled as POSIX requires.
        let previous = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            (libc::sigaction(n, &action, &mut previous) == 0).then_some(previous)
        };
        match previous {
            Some(p) => guard.previous.push((n, p)),
            // The guard puts back what was replaced so far.
            None => return Err(std::io::Error::last_os_error()),
        }
    }
    Ok(guard)
}

/// Installs the handlers and starts the watcher: `flag` is raised by the first signal, and
/// the process exits `grace` after it if the run has not ended by then (the guard dropped).
/// `console` hears of it while it is alive.
pub fn watch(
    flag: StopFlag,
    grace: Duration,
    console: Weak<dyn Console>,
) -> std::io::Result<SignalGuard> {
    let guard = install(true)?;
    let done = guard.done.clone();
    std::thread::Builder::new()
        .name("ferrotron-signals".into())
        .spawn(move || watcher(flag, grace, console, done))?;
    Ok(guard)
}

/// Sleeps until `until` or until `done` is raised; whether `done` was.
fn wait_until(until: std::time::Instant, done: &AtomicBool) -> bool {
    while std::time::Instant::now() < until {
        if done.load(Ordering::SeqCst) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done.load(Ordering::SeqCst)
}

/// Waits for the first signal, raises `flag`, and ends the process `grace` later; returns
/// as soon as the run ends (`done`).
fn watcher(flag: StopFlag, grace: Duration, console: Weak<dyn Console>, done: Arc<AtomicBool>) {
    let say = |line: String| match console.upgrade() {
        Some(c) => c.say(&line),
        None => eprintln!("{line}"),
    };
    let n = loop {
        if done.load(Ordering::SeqCst) {
            return;
        }
        match PENDING.load(Ordering::SeqCst) {
            0 => std::thread::sleep(Duration::from_millis(20)),
            n => break n,
        }
    };
    let name = signal_name(n);
    say(format!(
        "{name} received: stopping after the step in progress and saving a checkpoint of it \
         (within run.signal_grace_s = {} s; a second signal exits at once)",
        grace.as_secs_f64()
    ));
    flag.request(StopCause::Signal(n));
    if wait_until(std::time::Instant::now() + grace, &done) {
        return;
    }
    say(format!(
        "{name}: the step and its checkpoint did not finish within run.signal_grace_s = {} s; \
         exiting (the last complete checkpoint is intact)",
        grace.as_secs_f64()
    ));
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
