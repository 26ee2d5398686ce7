//! The MPI backend end to end: `mpirun -np 4 ferrotron train --set parallel.backend=mpi`
//! against the threads backend (same losses, byte-identical saved model), a rank failing
//! mid-run, and a job of the wrong size.
//!
//! Needs OpenMPI (`mpirun` on the PATH) and runs only with `--features mpi`. The threads
//! backend is proven equal to the single-rank run elsewhere; this proves MPI equals threads.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferrotron");

/// The tiny model and schedule every run here trains (dp = 4).
const TINY: [&str; 14] = [
    "model.hidden=64",
    "model.layers=2",
    "model.heads=4",
    "model.kv_heads=2",
    "model.ffn=128",
    "model.seq_len=32",
    "train.steps=10",
    "train.micro_batch=2",
    "train.grad_accum=2",
    "train.warmup_steps=2",
    "train.threads=1",
    "parallel.bucket_mb=0.05",
    "parallel.dp=4",
    "parallel.comm_timeout_s=60",
];

/// A fresh directory for one run.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("mpi-tests")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// `train` arguments for the tiny model with `extra` settings.
fn train_args(extra: &[String]) -> Vec<String> {
    let mut args = vec!["train".to_string(), "--quiet".to_string()];
    for s in TINY
        .iter()
        .map(|s| s.to_string())
        .chain(extra.iter().cloned())
    {
        args.push("--set".to_string());
        args.push(s);
    }
    args
}

/// `mpirun -np N ferrotron ARGS`, with a temporary directory of its own: OpenMPI makes its
/// session directory under `TMPDIR`, and two `mpirun` starting at once in the same one can
/// race to create it ("A call to mkdir was unable to create the desired directory … File
/// exists", seen once in CI with the tests running in parallel). The path stays short
/// because OpenMPI puts Unix sockets under it.
fn mpirun(np: usize, args: &[String]) -> Command {
    static LAUNCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = std::env::temp_dir().join(format!("ferrotron-mpi-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("create mpirun's temporary directory");
    let mut cmd = Command::new("mpirun");
    cmd.env("TMPDIR", &tmp);
    cmd.args([
        "-np",
        &np.to_string(),
        "--allow-run-as-root",
        "--oversubscribe",
    ])
    .arg(BIN)
    .args(args);
    cmd
}

/// Runs `cmd`, killing it after `limit`; returns its output and how long it took.
fn run_with_limit(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the command (is OpenMPI's mpirun installed?)");
    // Read the pipes on threads so a chatty child never blocks on a full pipe.
    let mut out_pipe = child.stdout.take().expect("stdout piped");
    let mut err_pipe = child.stderr.take().expect("stderr piped");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut out_pipe, &mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err_pipe, &mut v);
        v
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the command") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break child.wait().expect("wait for the killed command");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let elapsed = start.elapsed();
    let output = Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    };
    (output, elapsed)
}

fn describe(what: &str, out: &Output) -> String {
    format!(
        "{what}: {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Per-step losses of a run directory's metrics.jsonl.
fn losses(run_dir: &Path) -> Vec<f64> {
    let path = run_dir.join("metrics.jsonl");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("metrics line is JSON");
            v["loss"].as_f64().expect("metrics line has a loss")
        })
        .collect()
}

/// Trains the tiny model with `extra` settings on the threads backend and under `mpirun -np
/// 4` with the MPI backend; asserts identical per-step losses and identical saved models.
fn assert_mpi_matches_threads(dtype: &str, zero: usize) {
    assert_layout_matches(
        &format!("{dtype}-zero{zero}"),
        &[
            format!("parallel.zero={zero}"),
            format!("train.dtype={dtype}"),
        ],
    );
}

/// The same comparison for any 4-rank layout given as `settings`.
fn assert_layout_matches(name: &str, settings: &[String]) {
    let mut runs = Vec::new();
    for backend in ["threads", "mpi"] {
        let dir = scratch(&format!("{name}-{backend}"));
        let run_dir = dir.join("run");
        let model_dir = dir.join("model");
        let mut extra = settings.to_vec();
        extra.push(format!("run.dir={}", run_dir.display()));
        extra.push(format!("parallel.backend={backend}"));
        let mut args = train_args(&extra);
        args.push("--save-model".to_string());
        args.push(model_dir.display().to_string());
        let cmd = if backend == "mpi" {
            mpirun(4, &args)
        } else {
            let mut c = Command::new(BIN);
            c.args(&args);
            c
        };
        let (out, took) = run_with_limit(cmd, Duration::from_secs(120));
        assert!(
            out.status.success(),
            "{}",
            describe(&format!("{name} on {backend}"), &out)
        );
        eprintln!("{name} on {backend}: {took:.2?}");
        runs.push((losses(&run_dir), model_dir.join("model.safetensors")));
    }
    let (threads_losses, threads_model) = &runs[0];
    let (mpi_losses, mpi_model) = &runs[1];
    assert_eq!(threads_losses.len(), 10, "{name}: steps in metrics.jsonl");
    // Same reductions in the same order: the losses agree to the bit.
    assert_eq!(
        mpi_losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>(),
        threads_losses
            .iter()
            .map(|l| l.to_bits())
            .collect::<Vec<_>>(),
        "{name}: per-step losses differ (mpi {mpi_losses:?} vs threads {threads_losses:?})"
    );
    let a = std::fs::read(threads_model).expect("threads model saved");
    let b = std::fs::read(mpi_model).expect("mpi model saved");
    assert!(!a.is_empty(), "{name}: empty model file");
    assert!(a == b, "{name}: saved model.safetensors files differ");
}

/// Context parallelism (ring send/recv between processes) with data parallelism and ZeRO-1.
#[test]
fn mpi_matches_threads_with_context_parallelism() {
    assert_layout_matches(
        "cp2-dp2",
        &[
            "parallel.dp=2".into(),
            "parallel.cp=2".into(),
            "parallel.zero=1".into(),
        ],
    );
}

#[test]
fn mpi_matches_threads_f32() {
    for zero in 0..=3 {
        assert_mpi_matches_threads("f32", zero);
    }
}

#[test]
fn mpi_matches_threads_bf16() {
    for zero in 0..=3 {
        assert_mpi_matches_threads("bf16", zero);
    }
}

#[test]
fn failing_rank_stops_the_job() {
    let dir = scratch("fail");
    let mut args = train_args(&[
        "parallel.backend=mpi".to_string(),
        "parallel.zero=1".to_string(),
        format!("run.dir={}", dir.join("run").display()),
    ]);
    args.push("--fail-rank-at".to_string());
    args.push("2:3".to_string());
    let (out, took) = run_with_limit(mpirun(4, &args), Duration::from_secs(90));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{}", describe("failing run", &out));
    assert!(
        took < Duration::from_secs(60),
        "the job took {took:?} to stop\n{}",
        describe("failing run", &out)
    );
    assert!(
        stderr.contains("rank 2 failed"),
        "{}",
        describe("failing run", &out)
    );
}

#[test]
fn wrong_world_size_is_a_clear_error() {
    let dir = scratch("world-size");
    let args = train_args(&[
        "parallel.backend=mpi".to_string(),
        format!("run.dir={}", dir.join("run").display()),
    ]);
    let (out, _) = run_with_limit(mpirun(3, &args), Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{}",
        describe("3 ranks for dp=4", &out)
    );
    assert!(
        stderr.contains("the MPI job has 3 processes but the layout needs 4")
            && stderr.contains("world size 3 ≠ dp·pp·cp·tp = 4"),
        "{}",
        describe("3 ranks for dp=4", &out)
    );
    // Only rank 0 explains.
    assert_eq!(
        stderr.matches("the MPI job has 3 processes").count(),
        1,
        "{}",
        describe("3 ranks for dp=4", &out)
    );
}

/// Four MPI processes (dp=4, ZeRO-1) save a checkpoint at step 5 on the shared filesystem;
/// the threads backend resumes it as tp=2·pp=2 and finishes with the losses of the
/// uninterrupted MPI run (parity tolerance: relative 1e-5).
#[test]
fn an_mpi_checkpoint_resumes_on_threads_under_another_layout() {
    let dir = scratch("checkpoint");
    let mpi_dir = dir.join("mpi");
    let (out, _) = run_with_limit(
        mpirun(
            4,
            &train_args(&[
                "parallel.backend=\"mpi\"".into(),
                "parallel.zero=1".into(),
                "checkpoint.every=5".into(),
                format!("run.dir=\"{}\"", mpi_dir.display()),
            ]),
        ),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", describe("mpi run", &out));
    let straight = losses(&mpi_dir);
    let resumed_dir = dir.join("resumed");
    let out = Command::new(BIN)
        .args([
            "train",
            "--quiet",
            "--resume",
            mpi_dir.join("checkpoints/step_00000005").to_str().unwrap(),
        ])
        .args([
            "--set",
            "parallel.backend=threads",
            "--set",
            "parallel.dp=1",
        ])
        .args(["--set", "parallel.tp=2", "--set", "parallel.pp=2"])
        .args(["--set", "parallel.zero=0", "--set", "train.grad_accum=8"])
        .args(["--set", &format!("run.dir={}", resumed_dir.display())])
        .output()
        .expect("run ferrotron");
    assert!(out.status.success(), "{}", describe("resume", &out));
    let resumed = losses(&resumed_dir);
    assert_eq!(resumed.len(), 5);
    for (a, b) in resumed.iter().zip(&straight[5..]) {
        assert!(
            (a - b).abs() <= 1e-5 * b,
            "resumed {a} vs uninterrupted {b}"
        );
    }
}

/// SIGUSR1 to `mpirun` (which forwards it to every rank, as Slurm's `--signal=USR1@N`
/// reaches every task): the ranks agree on the step, save its checkpoint, the leader writes
/// an `interrupted` summary, and the job exits non-zero; `--resume latest` then finishes it.
#[test]
fn sigusr1_stops_every_rank_after_the_same_step_with_a_checkpoint() {
    let dir = scratch("sigusr1");
    let run_dir = dir.join("run");
    let mut extra = vec![
        format!("run.dir={}", run_dir.display()),
        "parallel.backend=mpi".to_string(),
        "train.steps=3000".to_string(),
    ];
    let mut child = mpirun(4, &train_args(&extra))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start mpirun");
    let start = Instant::now();
    let logged = |p: &Path| std::fs::read_to_string(p).map_or(0, |t| t.lines().count());
    while logged(&run_dir.join("metrics.jsonl")) < 3 {
        assert!(child.try_wait().unwrap().is_none(), "the job ended early");
        assert!(start.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signals our own child, not yet reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) }, 0);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "the job did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success(), "a stopped job exits non-zero");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["status"], "interrupted", "{summary}");
    assert_eq!(summary["stopped_by"], "SIGUSR1");
    let step = summary["stopped_at_step"].as_u64().unwrap();
    assert!(step < 3000, "{step}");
    let latest = std::fs::read_to_string(run_dir.join("checkpoints/latest")).unwrap();
    assert_eq!(latest, format!("step_{step:08}\n"));
    // The checkpoint holds every rank's part: the job finishes from it.
    extra[2] = format!("train.steps={}", step + 2);
    let mut args = train_args(&extra);
    args.extend(["--resume".to_string(), "latest".to_string()]);
    let (out, _) = run_with_limit(mpirun(4, &args), Duration::from_secs(120));
    assert!(out.status.success(), "{}", describe("resume", &out));
    assert_eq!(losses(&run_dir).len() as u64, step + 2);
}
