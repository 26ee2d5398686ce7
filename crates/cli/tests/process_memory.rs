//! The ledger against the process: a run's peak RSS growth (`VmHWM` at the end − `VmRSS` when
//! `train` started) agrees with the ledger's peak — the sum over the process's ranks — within
//! 10% plus a fixed 64 MiB for what the ledger does not count (the binary's pages touched
//! after start, thread stacks and `gemm`'s per-thread slabs, the data's pages, the allocator).
//! On the bench's medium preset (one rank), a 4-rank dp2·tp2 run of the small one and a dp2
//! run of it at the default 25 MB buckets.

mod common;

use common::{bin, ok, scratch};

const ALLOWANCE: f64 = 64.0 * 1024.0 * 1024.0;

fn process_memory(name: &str, sets: &[&str]) -> (f64, f64) {
    let dir = scratch(name);
    let mut cmd = bin();
    cmd.args(["train", "--quiet"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.args(["--set", &format!("run.dir={:?}", dir.to_str().unwrap())]);
    ok(&mut cmd);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let m = &summary["process_memory"];
    let growth = m["peak_rss_growth_bytes"].as_f64().unwrap();
    let ledger = m["ledger_peak_bytes"].as_f64().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    (growth, ledger)
}

fn assert_agree(what: &str, (growth, ledger): (f64, f64)) {
    let mib = |b: f64| b / (1 << 20) as f64;
    eprintln!(
        "{what}: peak RSS growth {:.1} MiB, ledger peak {:.1} MiB ({:+.1}%)",
        mib(growth),
        mib(ledger),
        100.0 * (growth - ledger) / ledger
    );
    assert!(
        (growth - ledger).abs() <= 0.10 * ledger + ALLOWANCE,
        "{what}: peak RSS growth {:.1} MiB vs the ledger's {:.1} MiB",
        mib(growth),
        mib(ledger)
    );
}

#[test]
fn the_ledger_agrees_with_the_process_on_medium_and_on_dp2_tp2() {
    let medium = [
        "model.vocab=32000",
        "model.hidden=768",
        "model.layers=12",
        "model.heads=12",
        "model.kv_heads=12",
        "model.ffn=2048",
        "model.seq_len=512",
        "train.micro_batch=2",
        "train.grad_accum=1",
        "train.steps=2",
    ];
    assert_agree("medium", process_memory("medium", &medium));
    let dp2_tp2 = [
        "model.vocab=8192",
        "model.hidden=512",
        "model.layers=8",
        "model.heads=8",
        "model.kv_heads=4",
        "model.ffn=1536",
        "model.seq_len=256",
        "train.micro_batch=4",
        "train.steps=2",
        "train.threads=1",
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        // Buckets of 4 MB: at the default 25 MB the heap keeps freed bucket-sized blocks it
        // cannot reuse, +12–15% over the ledger on this run (the README's "Precision and
        // memory" gives the measurements); that gap is known and not what this test checks.
        "parallel.bucket_mb=4",
    ];
    assert_agree("small on dp2·tp2", process_memory("dp2-tp2", &dp2_tp2));
    // The same model on dp2 at the default 25 MB buckets (issue 46's bound; measured +137 to
    // +165 MiB, +9% to +10.9%, against the bound's 214 MiB). dp4 (+306 to +325 MiB against 366) is measured by
    // hand, not here: its margin is within the noise of a loaded machine.
    let dp2: Vec<&str> = dp2_tp2
        .iter()
        .copied()
        .filter(|s| !s.starts_with("parallel.tp") && !s.starts_with("parallel.seq"))
        .filter(|s| !s.starts_with("parallel.bucket_mb"))
        .collect();
    assert_agree("small on dp2, 25 MB buckets", process_memory("dp2", &dp2));
}
