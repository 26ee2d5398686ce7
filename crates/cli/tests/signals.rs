//! Signals through the binary (ranks as threads; the MPI case is in `mpi.rs`): SIGTERM stops
//! every rank after the same step, saves a checkpoint of it and an `interrupted` summary,
//! exits 128 + 15, and `--resume latest` continues bit for bit as if nothing happened; a
//! second signal exits at once with the last complete checkpoint intact; a run that cannot
//! save within `run.signal_grace_s` exits anyway; `sweep` forwards the signal to its run.

use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

mod common;

use common::{bin, losses, ok, run, scratch};

/// A two-rank run long enough to be signalled while it trains.
const RUN: [&str; 11] = [
    "model.hidden=64",
    "model.layers=2",
    "model.heads=4",
    "model.kv_heads=2",
    "model.ffn=128",
    "model.seq_len=32",
    "train.micro_batch=2",
    "train.steps=1500",
    "train.threads=1",
    "parallel.dp=2",
    "parallel.comm_timeout_s=60",
];

fn train(dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = bin();
    cmd.args(["train", "--quiet"]);
    for set in RUN.iter().chain(extra) {
        cmd.args(["--set", set]);
    }
    cmd.args(["--set", &format!("run.dir={}", dir.display())]);
    cmd
}

/// Lines of `metrics.jsonl` so far.
fn logged(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count())
}

/// Waits until `dir` has logged `steps` steps (panics after 120 s or if the child ended).
fn wait_for_steps(child: &mut Child, dir: &Path, steps: usize) {
    let start = Instant::now();
    while logged(dir) < steps {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(start.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn send(child: &Child, signal: i32) {
    // SAFETY: signals our own child, not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
}

/// Waits for the child, at most `limit`.
fn wait(child: &mut Child, limit: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `dir`'s `latest` names a checkpoint that opens and verifies (checksums of every file).
fn assert_latest_verifies(dir: &Path, sets: &[&str]) {
    let out = run(train(dir, sets).args(["--resume", "latest", "--dry-run"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn sigterm_saves_the_step_reached_and_the_resume_loses_nothing() {
    sigterm_then_resume("sigterm", &[]);
}

/// With background saves every 7 steps in flight: the stop waits for the one being written,
/// then saves its own step, and the resume loses nothing either.
#[test]
fn sigterm_during_background_saves_loses_nothing() {
    sigterm_then_resume(
        "sigterm-async",
        &["checkpoint.every=7", "checkpoint.async=true"],
    );
}

/// SIGTERM after 5 steps of a run with `extra` settings; then `--resume latest` must give
/// the uninterrupted run's 1,500 losses bit for bit.
fn sigterm_then_resume(name: &str, extra: &[&str]) {
    let root = scratch(name);
    let (straight, stopped) = (root.join("straight"), root.join("stopped"));
    let mut child = train(&stopped, extra).spawn().unwrap();
    wait_for_steps(&mut child, &stopped, 5);
    send(&child, libc::SIGTERM);
    let status = wait(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
    let s = summary(&stopped);
    assert_eq!(s["status"], "interrupted");
    assert_eq!(s["stopped_by"], "SIGTERM");
    let step = s["stopped_at_step"].as_u64().unwrap();
    assert!((5..1500).contains(&step), "stopped at {step}");
    assert_eq!(s["steps"].as_u64(), Some(step));
    // The save of the stop step is the one the step loop waited for.
    assert!(s["checkpoint_blocked_s"].as_f64().unwrap() > 0.0, "{s}");
    assert_eq!(logged(&stopped) as u64, step, "every step taken is logged");
    let latest = std::fs::read_to_string(stopped.join("checkpoints/latest")).unwrap();
    assert_eq!(latest, format!("step_{step:08}\n"));

    ok(train(&stopped, extra).args(["--resume", "latest"]));
    ok(&mut train(&straight, &[]));
    let want = losses(&straight);
    let got = losses(&stopped);
    assert_eq!(got.len(), 1500);
    assert_eq!(
        got, want,
        "the stopped and resumed run is the uninterrupted run"
    );
    assert_eq!(summary(&stopped)["status"], "completed");
    std::fs::remove_dir_all(&root).unwrap();
}

/// SIGKILL while background saves of every step are being written: whatever the moment,
/// `latest` names a checkpoint that opens and verifies.
#[test]
fn a_kill_during_background_writes_leaves_latest_whole() {
    let root = scratch("kill-async");
    let dir = root.join("run");
    let slow = ["model.hidden=256", "model.seq_len=128"];
    let saves = [
        "checkpoint.every=1",
        "checkpoint.keep=3",
        "checkpoint.async=true",
    ];
    let mut child = train(&dir, &[&slow[..], &saves[..]].concat())
        .spawn()
        .unwrap();
    wait_for_steps(&mut child, &dir, 4);
    send(&child, libc::SIGKILL);
    wait(&mut child, Duration::from_secs(20));
    assert_latest_verifies(&dir, &slow);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_second_signal_exits_at_once_and_the_latest_checkpoint_stays_whole() {
    let root = scratch("twice");
    let dir = root.join("run");
    // Steps of tens of milliseconds with a save after each: the second signal lands in the
    // middle of one. Two different signals, so that the kernel does not merge them.
    let slow = ["model.hidden=256", "model.seq_len=128"];
    let mut child = train(
        &dir,
        &[&slow[..], &["checkpoint.every=1", "checkpoint.keep=3"]].concat(),
    )
    .spawn()
    .unwrap();
    wait_for_steps(&mut child, &dir, 3);
    send(&child, libc::SIGINT);
    send(&child, libc::SIGTERM);
    let status = wait(&mut child, Duration::from_secs(20));
    let code = status.code().unwrap_or_default();
    assert!(
        [128 + libc::SIGINT, 128 + libc::SIGTERM].contains(&code),
        "{status}"
    );
    assert!(!dir.join("summary.json").exists(), "it exited at once");
    assert_latest_verifies(&dir, &slow);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_run_that_cannot_save_within_the_grace_period_exits_anyway() {
    let root = scratch("grace");
    let dir = root.join("run");
    // Steps of tens of milliseconds against a grace of one.
    let log = root.join("stderr.log");
    let mut child = train(
        &dir,
        &[
            "model.hidden=256",
            "model.seq_len=128",
            "run.signal_grace_s=0.001",
        ],
    )
    .stderr(std::fs::File::create(&log).unwrap())
    .spawn()
    .unwrap();
    wait_for_steps(&mut child, &dir, 2);
    send(&child, libc::SIGTERM);
    let status = wait(&mut child, Duration::from_secs(20));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(
        stderr.contains("did not finish within run.signal_grace_s = 0.001 s"),
        "{stderr}"
    );
    assert!(
        !dir.join("summary.json").exists(),
        "the run had no time to save"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn sweep_forwards_the_signal_to_its_run_and_stops() {
    let root = scratch("sweep");
    let out = root.join("sweep");
    let mut cmd = bin();
    cmd.args(["sweep", "--out", out.to_str().unwrap()]);
    cmd.args(["--grid", "parallel.dp=2,1"]);
    for set in RUN.iter().filter(|s| !s.starts_with("parallel.dp")) {
        cmd.args(["--set", set]);
    }
    let mut child = cmd.spawn().unwrap();
    // The first layout's run directory, once it logs.
    let start = Instant::now();
    let first = loop {
        let logging = std::fs::read_dir(&out)
            .ok()
            .and_then(|entries| entries.flatten().map(|e| e.path()).find(|p| logged(p) >= 3));
        if let Some(dir) = logging {
            break dir;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(10));
    };
    send(&child, libc::SIGTERM);
    let status = wait(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
    let s = summary(&first);
    assert_eq!(s["status"], "interrupted", "the run got the signal: {s}");
    let step = s["stopped_at_step"].as_u64().unwrap();
    let latest = std::fs::read_to_string(first.join("checkpoints/latest")).unwrap();
    assert_eq!(latest, format!("step_{step:08}\n"));
    let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "the second layout did not start: {csv}");
    assert!(rows[0].contains(",interrupted,"), "{csv}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Under `--backend mpi` the sweep forwards a signal to `mpirun` as SIGUSR1 (mpirun passes
/// it on to the ranks; after SIGTERM it would SIGKILL them a few seconds later). A stand-in
/// launcher records what it received.
#[test]
fn an_mpi_sweep_forwards_signals_to_mpirun_as_sigusr1() {
    let root = scratch("sweep-mpi");
    let (out, script) = (root.join("sweep"), root.join("launcher.sh"));
    let got = root.join("got");
    std::fs::write(
        &script,
        format!(
            "trap 'echo USR1 > {g}; exit 1' USR1\ntrap 'echo TERM > {g}; exit 1' TERM\n\
             touch {g}.started\nwhile true; do sleep 0.05; done\n",
            g = got.display()
        ),
    )
    .unwrap();
    let launcher = format!("sh {} {{world}}", script.display());
    let mut child = bin()
        .args(["sweep", "--out", out.to_str().unwrap(), "--backend", "mpi"])
        .args(["--mpirun", &launcher, "--grid", "parallel.dp=1,2"])
        .spawn()
        .unwrap();
    let started = root.join("got.started");
    let start = Instant::now();
    while !started.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the launcher never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    send(&child, libc::SIGTERM);
    let status = wait(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
    assert_eq!(std::fs::read_to_string(&got).unwrap().trim(), "USR1");
    let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "one layout, interrupted: {csv}");
    assert!(csv.contains(",interrupted,"), "{csv}");
    std::fs::remove_dir_all(&root).unwrap();
}
