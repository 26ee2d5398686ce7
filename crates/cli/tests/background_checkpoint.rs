//! Checkpoints written in the background (`checkpoint.async = true`): the files equal a
//! synchronous save's byte for byte; the snapshot is counted in the ledger's `checkpoint`
//! category as the estimator predicts; a process killed while a background write is in
//! flight leaves `latest` at the previous complete checkpoint, and `--resume latest`
//! continues from it exactly.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

mod common;

use common::{
    assert_killed_in_the_save_of_step_4, assert_resumed_exactly, bin, checkpointed_run, losses, ok,
    run, scratch,
};
use safetensors::SafeTensors;

/// The sets of a two-rank (dp=2, ZeRO-1) run of 6 steps saving every 2, written into `dir`.
fn sets(dir: &Path, background: bool) -> Vec<String> {
    let mut out = checkpointed_run(dir);
    out.push(format!("checkpoint.async={background}"));
    out
}

fn train(dir: &Path, background: bool) -> Command {
    let mut cmd = bin();
    cmd.args(["train", "--quiet"]);
    for set in sets(dir, background) {
        cmd.args(["--set", &set]);
    }
    cmd
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// A rank file's tensors (name → bytes) and metadata (name → value).
type RankFile = (BTreeMap<String, Vec<u8>>, BTreeMap<String, String>);

/// Every tensor of every rank file of a checkpoint, by file and name, as bytes, and each
/// file's metadata (safetensors writes its metadata map in no fixed order, so the files are
/// compared by content, not by hash).
fn contents(checkpoint: &Path) -> BTreeMap<String, RankFile> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(checkpoint).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(entry.path()).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta: BTreeMap<String, String> = meta.metadata().clone().unwrap().into_iter().collect();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let tensors = file
            .tensors()
            .into_iter()
            .map(|(n, view)| (n, view.data().to_vec()))
            .collect();
        out.insert(name, (tensors, meta));
    }
    out
}

#[test]
fn background_saves_equal_synchronous_ones_and_are_counted_as_estimated() {
    let root = scratch("background-equal");
    let (sync, background) = (root.join("sync"), root.join("background"));
    ok(&mut train(&sync, false));
    ok(&mut train(&background, true));
    for step in ["step_00000002", "step_00000004", "step_00000006"] {
        let (a, b) = (
            contents(&sync.join("checkpoints").join(step)),
            contents(&background.join("checkpoints").join(step)),
        );
        assert_eq!(a.len(), 2, "{step}: one file per rank");
        assert!(
            a.values().all(|(t, _)| !t.is_empty()),
            "{step}: a rank file is empty"
        );
        assert!(a == b, "{step}: the rank files differ");
    }
    assert_eq!(
        std::fs::read_to_string(background.join("checkpoints/latest")).unwrap(),
        "step_00000006\n"
    );
    // Steps are the same bits, saved in the background or not.
    assert_eq!(losses(&sync), losses(&background));
    // The snapshot: ZeRO-1 rank 0 owns half of every bucket, as f32 master, m and v.
    let summary = json(&background.join("summary.json"));
    let held = summary["memory_peak_bytes"]["checkpoint"].as_u64().unwrap();
    let sync_summary = json(&sync.join("summary.json"));
    assert_eq!(sync_summary["memory_peak_bytes"]["checkpoint"], 0);
    let mut estimate = bin();
    estimate.args(["estimate", "--json"]);
    for set in sets(&background, true) {
        estimate.args(["--set", &set]);
    }
    let est: serde_json::Value = serde_json::from_str(&ok(&mut estimate)).unwrap();
    assert_eq!(est["memory"]["checkpoint"].as_u64().unwrap(), held);
    let optimizer = summary["memory_peak_bytes"]["optimizer"].as_u64().unwrap();
    assert_eq!(held, 3 * optimizer / 2, "master + m + v of the shard, f32");
    assert!(summary["checkpoint_blocked_s"].as_f64().unwrap() > 0.0);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn killed_during_a_background_write_resumes_from_the_previous_checkpoint() {
    let root = scratch("background-killed");
    let (straight, killed) = (root.join("straight"), root.join("killed"));
    ok(&mut train(&straight, true));
    // Rank 0's writer aborts the process once every rank file of step 4 is written, before
    // the manifest, while the step loop has gone on.
    let out = run(train(&killed, true).args(["--abort-in-save", "4"]));
    assert!(!out.status.success(), "the process was meant to die");
    assert_killed_in_the_save_of_step_4(&killed.join("checkpoints"));
    ok(train(&killed, true).args(["--resume", "latest"]));
    assert_resumed_exactly(&straight, &killed);
    std::fs::remove_dir_all(&root).unwrap();
}
