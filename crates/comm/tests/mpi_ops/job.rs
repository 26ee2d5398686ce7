//! The plumbing of an `mpirun` job of this test binary: launching it, the ranks'
//! transcripts in a scratch directory, aborting the job when a rank goes wrong, and
//! comparing the transcripts with the threads backend's.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use ferrotron_comm::{CommError, MpiWorld, Transport};

/// Environment variable naming the directory where launched ranks write their transcripts.
pub const DIR_VAR: &str = "FERROTRON_MPI_OPS_DIR";
/// Ranks of every job.
pub const RANKS: usize = 4;
/// Longest an `mpirun` job may take before it is killed.
pub const JOB_LIMIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------
// In the ranks.

/// The transcript directory when this process is a rank launched by a test here.
pub fn launched_dir() -> Option<PathBuf> {
    let dir = std::env::var_os(DIR_VAR).map(PathBuf::from);
    if dir.is_none() {
        eprintln!("nothing to do: this test is one MPI rank of a test that launches it");
    }
    dir
}

/// Where rank `rank` writes its transcript of `job`.
pub fn transcript_path(dir: &Path, job: &str, rank: usize) -> PathBuf {
    dir.join(format!("{job}-rank{rank}.txt"))
}

/// Writes a transcript whole (through a rename, so that readers never see part of it).
pub fn write_transcript(dir: &Path, job: &str, rank: usize, lines: &[String]) {
    let path = transcript_path(dir, job, rank);
    let partial = path.with_extension("partial");
    std::fs::write(&partial, lines.join("\n") + "\n").expect("write the transcript");
    std::fs::rename(&partial, &path).expect("rename the transcript");
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    match (
        payload.downcast_ref::<&str>(),
        payload.downcast_ref::<String>(),
    ) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "(non-string panic payload)".to_string(),
    }
}

/// Runs `f`; any error or panic aborts the whole job (so that no rank waits for it).
pub fn or_abort<T>(world: &MpiWorld, f: impl FnOnce() -> Result<T, CommError>) -> T {
    let reason = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => return value,
        Ok(Err(e)) => e.to_string(),
        Err(payload) => format!("panicked: {}", panic_message(payload.as_ref())),
    };
    world.fail(world.rank(), &reason);
    unreachable!("fail aborts the job")
}

/// Waits (up to [`JOB_LIMIT`]) until every rank has written its transcript of `job`.
pub fn wait_for_transcripts(dir: &Path, job: &str) {
    let start = Instant::now();
    while !(0..RANKS).all(|r| transcript_path(dir, job, r).exists()) && start.elapsed() < JOB_LIMIT
    {
        thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------
// In the launching test.

/// A fresh scratch directory for one job.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("mpi-ops")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// Runs the ignored test `rank_test` of this binary as every rank of
/// `mpirun -np RANKS`, killing the job after [`JOB_LIMIT`].
pub fn launch(rank_test: &str, dir: &Path) -> Output {
    let exe = std::env::current_exe().expect("path of this test binary");
    let mut child = Command::new("mpirun")
        .args([
            "-np",
            &RANKS.to_string(),
            "--allow-run-as-root",
            "--oversubscribe",
        ])
        .args(["-x", DIR_VAR])
        .arg(exe)
        .args([rank_test, "--exact", "--ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(DIR_VAR, dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpirun (is OpenMPI installed?)");
    // Read the pipes on threads so that a chatty job never blocks on a full pipe.
    let mut out = child.stdout.take().expect("stdout is piped");
    let mut err = child.stderr.take().expect("stderr is piped");
    let out = thread::spawn(move || std::io::read_to_string(&mut out).unwrap_or_default());
    let err = thread::spawn(move || std::io::read_to_string(&mut err).unwrap_or_default());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for mpirun") {
            break status;
        }
        if start.elapsed() > JOB_LIMIT {
            let _ = child.kill();
            break child.wait().expect("wait for the killed mpirun");
        }
        thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: out.join().unwrap_or_default().into_bytes(),
        stderr: err.join().unwrap_or_default().into_bytes(),
    }
}

pub fn describe(out: &Output) -> String {
    format!(
        "mpirun: {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Asserts that every MPI rank's transcript of `job` equals the threads backend's.
pub fn assert_same(job: &str, dir: &Path, out: &Output, threads: &[Vec<String>]) {
    let mut differences = Vec::new();
    for (rank, expected) in threads.iter().enumerate() {
        let path = transcript_path(dir, job, rank);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("rank {rank} wrote no transcript ({e})\n{}", describe(out)));
        let got: Vec<&str> = text.lines().collect();
        if got.len() != expected.len() {
            differences.push(format!(
                "rank {rank}: {} lines with MPI, {} with threads",
                got.len(),
                expected.len()
            ));
        }
        for (i, (mpi, threads)) in got.iter().zip(expected).enumerate() {
            if mpi != threads {
                differences.push(format!(
                    "rank {rank} line {i}:\n  mpi:     {mpi}\n  threads: {threads}"
                ));
            }
        }
    }
    assert!(
        differences.is_empty(),
        "MPI and threads differ:\n{}\n{}",
        differences.join("\n"),
        describe(out)
    );
}
