//! The bad-input suite: one row per case — the command, whether it must fail, and what its
//! message must contain. Every case runs under a timeout and must not panic: bad input gets
//! a clear error naming the field or file and the fix, before any work starts.

#[path = "../common/mod.rs"]
mod common;
mod hugging_face;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, ok, scratch};

/// How long any case may run.
const TIMEOUT: Duration = Duration::from_secs(60);

/// One case: its arguments, whether it must succeed, a substring of its stderr.
struct Case {
    args: Vec<String>,
    succeeds: bool,
    needle: &'static str,
}

fn fails(args: &[&str], needle: &'static str) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        succeeds: false,
        needle,
    }
}

fn succeeds(args: &[&str], needle: &'static str) -> Case {
    Case {
        succeeds: true,
        ..fails(args, needle)
    }
}

/// Runs a case to completion or the timeout; its (exit success, stderr).
fn run_case(args: &[String], dir: &Path) -> (bool, String) {
    // Many users set RUST_BACKTRACE: their errors must still read as messages, not crashes.
    let mut child = bin()
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut stderr)
                .unwrap();
            return (status.success(), stderr);
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            panic!("{args:?} ran past {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check(cases: &[Case], dir: &Path) {
    for case in cases {
        let (success, stderr) = run_case(&case.args, dir);
        assert!(
            !stderr.contains("panicked"),
            "{:?} panicked: {stderr}",
            case.args
        );
        assert_eq!(success, case.succeeds, "{:?} exit: {stderr}", case.args);
        assert!(
            !stderr.contains("Stack backtrace"),
            "{:?} printed a backtrace: {stderr}",
            case.args
        );
        assert!(
            stderr.contains(case.needle),
            "{:?}: stderr lacks {:?}: {stderr}",
            case.args,
            case.needle
        );
    }
}

fn train(sets: &[&str], needle: &'static str) -> Case {
    let mut args = vec!["train", "--quiet"];
    for s in sets {
        args.extend(["--set", s]);
    }
    fails(&args, needle)
}

#[test]
fn configuration_errors_name_the_field() {
    let dir = scratch("bad-config");
    check(
        &[
            train(&["train.lr=inf"], "train.lr"),
            train(&["train.lr=nan"], "train.lr"),
            train(&["train.lr=-1"], "train.lr"),
            train(&["train.lr=0"], "train.lr"),
            train(&["train.min_lr=1"], "train.min_lr"),
            train(&["train.min_lr=-1"], "train.min_lr"),
            train(&["train.eps=inf"], "train.eps"),
            train(&["train.eps=0"], "train.eps"),
            train(&["train.weight_decay=inf"], "train.weight_decay"),
            train(&["train.weight_decay=-0.1"], "train.weight_decay"),
            train(&["train.grad_clip=nan"], "train.grad_clip"),
            train(&["train.grad_clip=inf"], "train.grad_clip"),
            train(&["train.beta1=1"], "train.beta1"),
            train(&["train.beta2=-0.5"], "train.beta2"),
            train(&["train.micro_batch=0"], "train.micro_batch"),
            train(&["train.grad_accum=0"], "train.grad_accum"),
            train(&["train.loss_chunk=0"], "train.loss_chunk"),
            train(&["train.fp32_grad_accum=true"], "train.fp32_grad_accum"),
            train(&["model.vocab=100000000"], "model.vocab"),
            train(&["model.hiden=3"], "hiden"),
            train(&["model.kv_heads=3"], "kv_heads=3"),
            train(&["model.hidden=130"], "hidden=130"),
            train(&["parallel.zero=4"], "parallel.zero"),
            train(&["parallel.bucket_mb=0"], "parallel.bucket_mb"),
            train(&["parallel.comm_timeout_s=0"], "parallel.comm_timeout_s"),
            train(&["parallel.cp=3"], "parallel.cp"),
            train(&["parallel.virtual_stages=0"], "parallel.virtual_stages"),
            train(&["train.loss_scale.init=1024"], "train.loss_scale"),
            train(
                &["train.dtype=\"fp16\"", "train.device=\"cuda\""],
                "\"fp16\" runs on the CPU for now",
            ),
            train(
                &["train.dtype=\"fp16\"", "train.fp8=\"rowwise\""],
                "train.fp8",
            ),
            train(
                &["train.dtype=\"fp16\"", "train.loss_scale.init=0"],
                "train.loss_scale.init",
            ),
            train(
                &["train.dtype=\"fp16\"", "train.loss_scale.backoff_factor=1"],
                "train.loss_scale.backoff_factor",
            ),
            train(
                &["train.dtype=\"fp16\"", "train.loss_scale.growth_interval=0"],
                "train.loss_scale.growth_interval",
            ),
            train(
                &[
                    "parallel.pp=2",
                    "parallel.pp_schedule=\"dualpipev\"",
                    "train.grad_accum=3",
                ],
                "2·pp micro-batches (pp=2, so 4), got grad_accum=3",
            ),
            train(
                &[
                    "parallel.pp=2",
                    "parallel.pp_schedule=\"dualpipev\"",
                    "parallel.virtual_stages=2",
                ],
                "parallel.virtual_stages",
            ),
            train(
                &["checkpoint.every=1", "checkpoint.keep=0"],
                "checkpoint.keep",
            ),
            train(&["run.log_every=0"], "run.log_every"),
            train(&["run.signal_grace_s=0"], "run.signal_grace_s"),
            train(&["run.signal_grace_s=nan"], "run.signal_grace_s"),
            train(&["checkpoint.keep=0"], "checkpoint.on_stop"),
            train(&["checkpoint.async=true"], "checkpoint.every"),
            train(&["train.attention=products"], "train.attention"),
            train(&["train.attention=flash"], "expected `tiles` or `products`"),
            train(&["train.steps=\"many\""], "invalid type"),
            train(&["model.moe_balance=\"bias\""], "model.moe_balance"),
            train(&["model.moe_balance=\"sometimes\""], "aux_loss"),
            train(&["model.moe_bias_rate=0"], "model.moe_bias_rate"),
        ],
        &dir,
    );
}

#[test]
fn files_and_paths_are_checked_before_training() {
    let dir = scratch("bad-paths");
    std::fs::write(dir.join("afile"), "not a directory").unwrap();
    std::fs::write(dir.join("notes.txt"), "some text to tokenize\n").unwrap();
    // A Megatron pair whose index is not one.
    std::fs::write(dir.join("corpus.idx"), "not an index").unwrap();
    std::fs::write(dir.join("corpus.bin"), [0u8; 8]).unwrap();
    let run_dir = |name: &str| format!("run.dir={}", dir.join(name).display());
    let r1 = run_dir("r1");
    check(
        &[
            train(&["data.path=missing.bin", &r1], "missing.bin"),
            train(
                &["data.path=corpus", &r1],
                "corpus.idx: not a Megatron index",
            ),
            train(
                &["data.blend=[[1, \"corpus\"]]", &r1],
                "corpus.idx: not a Megatron index",
            ),
            train(
                &["data.blend=[[1, \"missing-part.bin\"]]", &r1],
                "missing-part.bin",
            ),
            train(
                &["data.eval_path=missing-eval.bin", &r1],
                "missing-eval.bin",
            ),
            fails(
                &["train", "--quiet", "--save-model", "afile/model"],
                "afile is a file",
            ),
            fails(&["train", "--config", "missing.toml"], "missing.toml"),
            fails(
                &["train", "--resume", "no-such-checkpoint"],
                "no-such-checkpoint",
            ),
            fails(&["train", "--init-from", "no-such-model"], "no-such-model"),
            fails(
                &["prepare-data", "notes.txt", "-o", "notes.txt"],
                "would overwrite the input",
            ),
            fails(
                &["prepare-data", "missing.txt", "-o", "out.bin"],
                "missing.txt",
            ),
            fails(
                &["eval", "--model", "no-such-model", "--data", "notes.bin"],
                "no-such-model",
            ),
        ],
        &dir,
    );
    // Nothing of a refused run was written, and the input survived.
    assert!(!dir.join("r1").join("metrics.jsonl").exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "some text to tokenize\n"
    );
}

#[test]
fn commands_bound_their_work_and_validate_their_arguments() {
    let dir = scratch("bad-bounds");
    let r = |name: &str| format!("run.dir={}", dir.join(name).display());
    let (r1, r2, r3, r4) = (r("r1"), r("r2"), r("r3"), r("r4"));
    check(
        &[
            succeeds(
                &[
                    "train",
                    "--quiet",
                    "--set",
                    "train.threads=100000",
                    "--set",
                    "train.steps=1",
                    "--set",
                    &r1,
                ],
                "compute threads asked for",
            ),
            fails(&["bench-pipeline", "--pp", "0"], "--pp 0"),
            fails(&["bench-pipeline", "--pp", "1"], "--pp 1"),
            fails(
                &["bench-pipeline", "--pp", "1000", "--steps", "1"],
                "no schedule can run with --pp 1000",
            ),
            fails(
                &["bench-pipeline", "--micro-batches", "0"],
                "--micro-batches",
            ),
            fails(&["bench-pipeline", "--steps", "0"], "--steps"),
            // Sizes beyond this machine's memory are refused before anything is allocated.
            train(&["model.seq_len=1000000000"], "--no-memory-check"),
            train(&["model.hidden=65536", "model.ffn=65536"], "GiB available"),
            train(&["model.layers=100000"], "GiB available"),
            train(&["train.micro_batch=100000"], "GiB available"),
            train(&["train.micro_batch=10000000"], "train.micro_batch"),
            // Divergence stops the run before the step is applied, with the right hint.
            train(
                &["train.lr=1e30", "train.grad_clip=0", "train.steps=30", &r2],
                "or set train.grad_clip",
            ),
            train(
                &["train.lr=1e30", "train.grad_clip=1", "train.steps=30", &r3],
                "is already on",
            ),
            // ... or skips such steps and carries on when asked to.
            succeeds(
                &[
                    "train",
                    "--quiet",
                    "--set",
                    "train.lr=1e30",
                    "--set",
                    "train.grad_clip=0",
                    "--set",
                    "train.on_nonfinite=\"skip\"",
                    "--set",
                    "train.steps=4",
                    "--set",
                    &r4,
                ],
                "the step was not applied",
            ),
            train(&["train.on_nonfinite=\"retry\""], "on_nonfinite"),
        ],
        &dir,
    );
}

#[test]
fn a_finished_checkpoint_and_a_broken_model_are_refused() {
    let dir = scratch("bad-state");
    let run = dir.join("run");
    let sets = |extra: &[&str]| {
        let mut a: Vec<String> = vec!["train".into(), "--quiet".into()];
        for s in [
            format!("run.dir={}", run.display()),
            "train.steps=3".into(),
            "checkpoint.every=3".into(),
        ]
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
        {
            a.extend(["--set".into(), s.to_string()]);
        }
        a
    };
    ok(bin().args(sets(&[])).current_dir(&dir));
    // Resuming a step-3 checkpoint for 2 steps has nothing to do: named, not a silent no-op.
    let mut resume = sets(&["train.steps=2"]);
    resume.extend(["--resume".into(), "latest".into()]);
    let (success, stderr) = run_case(&resume, &dir);
    assert!(
        !success && stderr.contains("at step 3") && stderr.contains("train.steps = 2"),
        "{stderr}"
    );
    // A model whose weights are NaN evaluates to an error, not a null loss with exit 0.
    let model = dir.join("model");
    ok(bin()
        .args([
            "train",
            "--quiet",
            "--set",
            "train.steps=0",
            "--set",
            "model.vocab=257",
        ])
        .arg("--save-model")
        .arg(&model)
        .args(["--set", &format!("run.dir={}", dir.join("r0").display())])
        .current_dir(&dir));
    poison_weights(&model.join("model.safetensors"));
    std::fs::write(dir.join("text.txt"), "abcdefghij".repeat(200)).unwrap();
    ok(Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["prepare-data", "text.txt", "-o", "text.bin", "--quiet"])
        .current_dir(&dir));
    let eval = [
        "eval", "--model", "model", "--data", "text.bin", "--seq", "16",
    ];
    let (success, stderr) = run_case(&eval.map(String::from), &dir);
    assert!(!success && stderr.contains("not finite"), "{stderr}");
    // eval's own flags are named: a window longer than the file, a data file not there.
    let long = [
        "eval", "--model", "model", "--data", "text.bin", "--seq", "5000",
    ];
    let (success, stderr) = run_case(&long.map(String::from), &dir);
    assert!(
        !success && stderr.contains("fewer than one window of 5000 + 1: pass a smaller --seq"),
        "{stderr}"
    );
    let missing = ["eval", "--model", "model", "--data", "gone.bin"];
    let (success, stderr) = run_case(&missing.map(String::from), &dir);
    assert!(
        !success && stderr.contains("gone.bin does not exist"),
        "{stderr}"
    );
}

/// Overwrites every f32 of a safetensors file's data with NaN.
fn poison_weights(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for b in &mut bytes[8 + header..] {
        *b = 0xff;
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_run_directory_holds_one_run_at_a_time() {
    let dir = scratch("bad-lock");
    let run = format!("run.dir={}", dir.join("run").display());
    let mut first = bin()
        .args([
            "train",
            "--quiet",
            "--set",
            "train.steps=100000",
            "--set",
            &run,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the first run holds the directory (it writes its pid into the lock).
    let lock = dir.join("run").join(".lock");
    let start = Instant::now();
    while !std::fs::read_to_string(&lock).is_ok_and(|s| s.starts_with("pid")) {
        assert!(
            start.elapsed() < TIMEOUT,
            "the first run never took the lock"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = ["train", "--quiet", "--set", "train.steps=1", "--set", &run].map(String::from);
    let (success, stderr) = run_case(&second, &dir);
    let _ = first.kill();
    let _ = first.wait();
    assert!(!success, "a second run on a held directory ran");
    let holder = format!("pid {}", first.id());
    assert!(
        stderr.contains("is in use by another run") && stderr.contains(&holder),
        "{stderr}"
    );
    // Once the first run is gone, the directory is free again (its results replaced on
    // request).
    let mut again = second.to_vec();
    again.push("--overwrite".into());
    let (success, stderr) = run_case(&again, &dir);
    assert!(success, "{stderr}");
}

/// The steps recorded in a run's metrics, in file order.
fn metric_steps(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["step"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn a_used_directory_is_kept_resumes_do_not_duplicate_and_failures_are_summarised() {
    let dir = scratch("bad-rundir");
    let run = dir.join("run");
    let train = |extra: &[&str]| {
        let mut a: Vec<String> = ["train", "--quiet", "--set"].map(String::from).to_vec();
        a.push(format!("run.dir={}", run.display()));
        for s in ["train.steps=4", "checkpoint.every=2", "checkpoint.keep=2"] {
            a.extend(["--set".into(), s.into()]);
        }
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let (success, stderr) = run_case(&train(&[]), &dir);
    assert!(success, "{stderr}");
    let before = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    // A fresh run does not silently replace the results in the directory.
    let (success, stderr) = run_case(&train(&[]), &dir);
    assert!(!success && stderr.contains("--overwrite"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl")).unwrap(),
        before
    );
    // Resuming from step 2 drops the rows of steps 3 and 4 before redoing them.
    let step2 = run.join("checkpoints").join("step_00000002");
    let (success, stderr) = run_case(&train(&["--resume", step2.to_str().unwrap()]), &dir);
    assert!(success, "{stderr}");
    assert_eq!(metric_steps(&run), [1, 2, 3, 4]);
    assert_eq!(
        std::fs::read_to_string(run.join("metrics.jsonl.bak")).unwrap(),
        before
    );
    // --overwrite replaces them; a run that fails says so in summary.json.
    let diverge = [
        "--overwrite",
        "--set",
        "train.lr=1e30",
        "--set",
        "train.grad_clip=0",
    ];
    let (success, stderr) = run_case(&train(&diverge), &dir);
    assert!(!success && stderr.contains("became"), "{stderr}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "failed", "{summary}");
    assert!(
        summary["error"].as_str().unwrap().contains("became"),
        "{summary}"
    );
}
