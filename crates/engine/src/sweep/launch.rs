//! Child processes of a sweep: one run with its output captured in log files, waited for
//! with an optional time limit; and the Unix details (exit signals, executable scripts).

use std::fs::File;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Starts `cmd` with its output in `dir/stdout.log` and `dir/stderr.log` (after removing
/// an earlier run's results there) and waits for it, stopping it at the timeout, and
/// forwarding to it each stop signal the sweep receives ([`crate::signals`]). With
/// `mpirun` (`under_mpirun`) every signal is forwarded as SIGUSR1, which it passes on to
/// the ranks: on SIGTERM or SIGINT it would kill them a few seconds later, maybe before
/// their checkpoint is written.
pub(crate) fn launch(
    cmd: &mut Command,
    dir: &Path,
    (timeout, under_mpirun): (Option<Duration>, bool),
) -> Result<ExitStatus, String> {
    let io = |what: &str, p: &Path| {
        let p = p.display().to_string();
        let what = what.to_string();
        move |e: std::io::Error| format!("cannot {what} {p}: {e}")
    };
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    for stale in ["summary.json", "metrics.jsonl"] {
        match std::fs::remove_file(dir.join(stale)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("remove", &dir.join(stale))(e))
            }
            _ => {}
        }
    }
    let (out_path, err_path) = (dir.join("stdout.log"), dir.join("stderr.log"));
    let stdout = File::create(&out_path).map_err(io("create", &out_path))?;
    let stderr = File::create(&err_path).map_err(io("create", &err_path))?;
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .map_err(|e| format!("cannot start `{program}`: {e} (is it installed and on PATH?)"))?;
    let waited = |e: std::io::Error| format!("waiting for `{program}`: {e}");
    let started = Instant::now();
    let mut forwarded = crate::signals::received().map_or(0, |r| r.count);
    loop {
        if let Some(status) = child.try_wait().map_err(waited)? {
            return Ok(status);
        }
        if let Some(r) = crate::signals::received().filter(|r| r.count > forwarded) {
            forwarded = r.count;
            signal(
                &child,
                if under_mpirun {
                    libc::SIGUSR1
                } else {
                    r.latest
                },
            );
        }
        if timeout.is_some_and(|limit| started.elapsed() >= limit) {
            let limit = timeout.unwrap_or_default();
            stop(&mut child);
            return Err(format!(
                "timed out after {} s (--timeout-s) and was stopped",
                limit.as_secs_f64()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Marks a written script executable (rwxr-xr-x).
pub(crate) fn make_executable(path: &Path) -> crate::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).map_err(|e| {
            crate::EngineError::Failed(format!("cannot make {} executable: {e}", path.display()))
        })?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// The signal that ended the process, if one did.
pub(crate) fn exit_signal(status: &ExitStatus) -> Option<i32> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal()
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        None
    }
}

/// Sends signal `n` to a child that has not been reaped yet.
fn signal(child: &std::process::Child, n: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: sends a signal to our own child process, which has not been reaped yet.
        unsafe {
            libc::kill(pid, n);
        }
    }
}

/// Stops a child: SIGTERM first (so `mpirun` can stop its ranks), SIGKILL after 5 s.
fn stop(child: &mut std::process::Child) {
    #[cfg(unix)]
    {
        signal(child, libc::SIGTERM);
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}
