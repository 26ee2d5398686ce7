//! End-to-end tests of `ferrotron sweep` (threads, a stand-in MPI launcher, Slurm scripts)
//! and of the charts of a real training run.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A model small enough that a 3-step run takes milliseconds.
const TINY: [&str; 9] = [
    "model.hidden=32",
    "model.layers=2",
    "model.heads=4",
    "model.kv_heads=2",
    "model.ffn=64",
    "model.seq_len=16",
    "train.steps=3",
    "train.micro_batch=2",
    "train.threads=1",
];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotron-sweep-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `ferrotron <subcommand> --set <TINY>... <rest>` (so `rest` overrides TINY), checked for
/// panics.
fn ferrotron(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotron"));
    cmd.arg(args[0]);
    for item in TINY {
        cmd.args(["--set", item]);
    }
    cmd.args(&args[1..]);
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    out
}

fn succeeds(args: &[&str]) -> String {
    let out = ferrotron(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "failed: {stderr}");
    stderr
}

/// Rows of a CSV file as header → value maps (RFC 4180 quoting).
fn read_csv(path: &Path) -> Vec<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut records = Vec::new();
    let (mut record, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => record.push(std::mem::take(&mut field)),
            ('\n', false) => {
                record.push(std::mem::take(&mut field));
                records.push(std::mem::take(&mut record));
            }
            (c, _) => field.push(c),
        }
    }
    let header: Vec<String> = records.remove(0);
    assert!(
        records.iter().all(|r| r.len() == header.len()),
        "ragged CSV: {text}"
    );
    records
        .into_iter()
        .map(|r| header.iter().cloned().zip(r).collect())
        .collect()
}

fn num(row: &HashMap<String, String>, key: &str) -> f64 {
    row[key]
        .parse()
        .unwrap_or_else(|_| panic!("{key} = {:?} in {row:?}", row[key]))
}

#[test]
fn thread_sweep_runs_every_layout_and_records_invalid_ones() {
    let out = scratch("threads");
    let out_s = out.to_str().unwrap();
    #[rustfmt::skip]
    let args = ["sweep", "--out", out_s, "--grid", "parallel.dp=1,2", "--grid", "parallel.tp=1,2,3", "--grid", "parallel.zero=0,1"];
    let stderr = succeeds(&args);
    assert!(stderr.contains("sweep: 8 of 12 layouts ran"), "{stderr}");

    let header = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    assert!(header.starts_with("layout,parallel.dp,parallel.tp,parallel.zero,status,world,tokens_per_s,tokens_per_s_per_rank,mfu,peak_memory_bytes_per_rank,peak_weights_bytes,"));
    let rows = read_csv(&out.join("sweep.csv"));
    assert_eq!(rows.len(), 12);
    let by_name: HashMap<&str, &HashMap<String, String>> =
        rows.iter().map(|r| (r["layout"].as_str(), r)).collect();
    for row in &rows {
        let name = &row["layout"];
        if row["parallel.tp"] == "3" {
            assert_eq!(row["status"], "invalid_layout", "{row:?}");
            assert!(
                row["error"].contains("tp=3 does not divide heads=4"),
                "{row:?}"
            );
            assert!(!row["error"].contains("backtrace"), "{row:?}");
            continue;
        }
        assert_eq!(row["status"], "ok", "{row:?}");
        assert!(row["error"].is_empty());
        let world = num(row, "parallel.dp") * num(row, "parallel.tp");
        assert_eq!(num(row, "world"), world);
        let tps = num(row, "tokens_per_s");
        assert!(tps > 0.0, "{row:?}");
        assert!((num(row, "tokens_per_s_per_rank") - tps / world).abs() <= 1e-9 * tps);
        assert!(num(row, "peak_memory_bytes_per_rank") > 0.0 && num(row, "final_loss").is_finite());
        let metrics = std::fs::read_to_string(out.join(name).join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 3, "{name}");
    }
    // The rows carry each layout's own ledger: ZeRO-1 shards the optimizer state over dp=2,
    // tensor parallelism splits the weights.
    let optimizer = |n: &str| num(by_name[n], "peak_optimizer_bytes");
    assert_eq!(optimizer("dp2-tp1-zero1") * 2.0, optimizer("dp2-tp1-zero0"));
    let weights = |n: &str| num(by_name[n], "peak_weights_bytes");
    assert!(weights("dp1-tp2-zero0") < weights("dp1-tp1-zero0"));

    let svg = std::fs::read_to_string(out.join("sweep.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(
        svg.matches("<rect").count(),
        8,
        "one bar per successful layout"
    );
    assert_eq!(svg.matches(r#"<circle class="mfu""#).count(), 8);
    assert_eq!(svg.matches(">invalid_layout</text>").count(), 4);
    for row in &rows {
        assert!(svg.contains(&format!(">{}</text>", row["layout"])));
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn run_plots_reflect_a_real_run() {
    let dir = scratch("plots");
    let run_dir = format!("run.dir={}", dir.display());
    succeeds(&[
        "train",
        "--quiet",
        "--set",
        &run_dir,
        "--set",
        "train.steps=5",
    ]);
    let paths = ferrotron_report::write_run_plots(&dir).unwrap();
    let names: Vec<_> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap())
        .collect();
    assert_eq!(names, ["loss.svg", "memory.svg", "time.svg"]);
    let read = |name: &str| {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(
            text.starts_with("<svg") && text.len() > 500,
            "{name}: {text}"
        );
        text
    };
    let loss = read("loss.svg");
    let line = loss
        .lines()
        .find(|l| l.contains(r#"<polyline class="loss""#))
        .unwrap();
    let points = line
        .split("points=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    assert_eq!(points.split(' ').count(), 5, "one point per step: {line}");
    assert!(loss.contains("Training loss over 5 steps"));

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let memory = read("memory.svg");
    assert_eq!(
        memory.matches(r#"<rect class="bar""#).count(),
        7,
        "one bar per memory category"
    );
    for category in ["weights", "optimizer", "activations"] {
        let bytes = summary["memory_peak_bytes"][category].as_u64().unwrap();
        assert!(
            bytes > 0 && memory.contains(&format!("{category}: {bytes} bytes")),
            "{category}"
        );
    }
    let time = read("time.svg");
    assert_eq!(
        time.matches(r#"<rect class="bar""#).count(),
        5 * 3,
        "3 stacked parts per step"
    );
    assert!(time.contains("compute + other") && time.contains("exposed reduction"));

    let empty = scratch("plots-empty");
    let err = format!(
        "{:#}",
        ferrotron_report::write_run_plots(&empty).unwrap_err()
    );
    assert!(err.contains("metrics.jsonl: not found"), "{err}");
    std::fs::write(empty.join("metrics.jsonl"), "").unwrap();
    let err = format!(
        "{:#}",
        ferrotron_report::write_run_plots(&empty).unwrap_err()
    );
    assert!(err.contains("no step recorded"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&empty).unwrap();
}

#[test]
fn mpi_sweep_launches_through_the_prefix_and_survives_failures() {
    let out = scratch("mpi");
    let out_s = out.to_str().unwrap();
    #[rustfmt::skip]
    let args = ["sweep", "--out", out_s, "--backend", "mpi", "--mpirun", "no-such-launcher-xyz -np {world}", "--grid", "parallel.tp=1,3"];
    succeeds(&args);
    let rows = read_csv(&out.join("sweep.csv"));
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["status"], "crashed");
    assert!(
        rows[0]["error"].contains("cannot start `no-such-launcher-xyz`"),
        "{:?}",
        rows[0]
    );
    assert_eq!(rows[1]["status"], "invalid_layout");
    assert!(
        rows[1]["error"].contains("tp=3 does not divide"),
        "{:?}",
        rows[1]
    );
    let svg = std::fs::read_to_string(out.join("sweep.svg")).unwrap();
    assert_eq!(svg.matches("<rect").count(), 0);
    assert!(svg.contains(">crashed</text>") && svg.contains(">invalid_layout</text>"));
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn slurm_sweep_writes_scripts_and_runs_nothing() {
    let out = scratch("slurm");
    let out_s = out.to_str().unwrap();
    #[rustfmt::skip]
    let args = ["sweep", "--out", out_s, "--backend", "slurm", "--grid", "parallel.dp=1,16", "--grid", "parallel.tp=1,3"];
    succeeds(&args);
    let script = std::fs::read_to_string(out.join("dp16-tp1/job.sbatch")).unwrap();
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks=16",
        "#SBATCH --ntasks-per-node=8",
    ] {
        assert!(script.contains(line), "{line}: {script}");
    }
    let srun = script.lines().find(|l| l.starts_with("srun ")).unwrap();
    assert!(
        srun.contains(" train --quiet ") && srun.contains("parallel.backend=mpi"),
        "{srun}"
    );
    assert!(
        srun.contains("parallel.dp=16") && srun.contains("dp16-tp1"),
        "{srun}"
    );
    let single = std::fs::read_to_string(out.join("dp1-tp1/job.sbatch")).unwrap();
    assert!(
        single.contains("#SBATCH --nodes=1\n#SBATCH --ntasks=1\n"),
        "{single}"
    );
    let submit = std::fs::read_to_string(out.join("submit_all.sh")).unwrap();
    assert_eq!(
        submit.lines().filter(|l| l.starts_with("sbatch ")).count(),
        2
    );
    assert!(
        submit.contains("# skipped dp1-tp3 (invalid_layout)"),
        "{submit}"
    );
    assert!(!out.join("dp1-tp1/metrics.jsonl").exists() && !out.join("sweep.csv").exists());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn bad_arguments_fail_with_the_fix() {
    let out = scratch("bad");
    let out_s = out.to_str().unwrap();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--grid", "parallel.dp"],
            "--grid `parallel.dp`: expected section.key=v1,v2,...",
        ),
        (
            &["--config", "/no/such.toml"],
            "--config /no/such.toml: cannot read",
        ),
        (
            &["--timeout-s", "0"],
            "--timeout-s 0: give a positive number",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["sweep", "--out", out_s];
        args.extend_from_slice(extra);
        let result = ferrotron(&args);
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(
            !result.status.success() && stderr.contains(needle),
            "{needle}: {stderr}"
        );
    }
    std::fs::remove_dir_all(&out).unwrap();
}
