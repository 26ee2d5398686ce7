//! Writing a checkpoint: what one rank owns, its safetensors file, and the final step that
//! makes the checkpoint visible (manifest, rename, `latest`, pruning).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ferrotron_data::token_file::write_atomic;
use ferrotron_tensor::{Category, Device, DeviceSlice, Held};

use crate::optim::CHECKPOINT;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::format::{
    partial_dir_name, step_dir_name, FileEntry, Kind, Manifest, PieceMeta, FORMAT, LATEST, MANIFEST,
};
use crate::state::TrainState;
use crate::{io_err, TrainError};

/// One stored piece: where it belongs and its values (in [`Kind`] order) as little-endian
/// f32 bytes, the form they are written in, so the state is copied once while saving.
pub struct OwnedPiece {
    /// Metadata of the piece; `kind` is set per stored tensor.
    pub meta: PieceMeta,
    /// Master, first moment, second moment.
    pub bytes: [Vec<u8>; 3],
    /// The bytes above, counted on the rank's ledger (as workspace for a save that writes at
    /// once, as `checkpoint` for one written in the background) until the piece is dropped.
    _held: Held,
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice(values).to_vec()
    } else {
        values.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

/// The pieces this rank owns: its ZeRO shard (under ZeRO-0, whole buckets on the first member
/// of each bucket's group — data-parallel rank 0 for dense buckets, expert-data index 0 for
/// this rank's experts — and nothing on the other replicas), cut at parameter boundaries,
/// without the replicated parameters on tensor-parallel ranks other than 0. Experts are
/// stored once, under their global names. `(tp, tp_rank)`: the tensor-parallel degree and
/// this rank's index; the copies are counted under `category`.
pub fn owned_pieces(
    state: &TrainState,
    dev: Device<'_>,
    (tp, tp_rank): (usize, usize),
    category: Category,
) -> Vec<OwnedPiece> {
    let mut out = Vec::new();
    for (k, range, at) in state.plan.pieces(state.dp_rank) {
        if !state.plan.sharded && state.plan.member(k, state.dp_rank) != 0 {
            continue;
        }
        for spec in &state.layout.params {
            let p = spec.range();
            let (start, end) = (range.start.max(p.start), range.end.min(p.end));
            if start >= end || (spec.split == ferrotron_model::Split::Replicated && tp_rank != 0) {
                continue;
            }
            // `local`: indices into this rank's shard buffers (m, v, master).
            let local = at + (start - range.start)..at + (end - range.start);
            // Each copy is counted from before it exists; the download it is made from too,
            // while both live.
            let host = |x: &DeviceSlice<f32>| {
                let _download = dev.ledger.hold(Category::Workspace, 4 * x.len());
                le_bytes(&dev.ledger.download(CHECKPOINT, x))
            };
            let held = dev.ledger.hold(category, 3 * 4 * (end - start));
            let master = match (&state.master, state.sharded_weights()) {
                (Some(m), _) => host(&m[local.clone()]),
                (None, true) => host(&state.weights.view(dev, local.clone())),
                (None, false) => host(&state.weights.view(dev, start..end)),
            };
            out.push(OwnedPiece {
                meta: PieceMeta {
                    param: spec.name.clone(),
                    kind: Kind::Master,
                    global_shape: spec.full_shape.clone(),
                    split: spec.split.into(),
                    tp,
                    tp_rank: if spec.split == ferrotron_model::Split::Replicated {
                        0
                    } else {
                        tp_rank
                    },
                    start: start - p.start,
                    end: end - p.start,
                    rows: (spec.split == ferrotron_model::Split::Rows
                        && spec.shape[0] * tp != spec.full_shape[0])
                        .then_some(spec.shape[0]),
                },
                bytes: [master, host(&state.m[local.clone()]), host(&state.v[local])],
                _held: held,
            });
        }
    }
    out
}

/// Writes `pieces` as one safetensors file (fp32, metadata per tensor), streamed from the
/// pieces' bytes (no second copy of the state), under a temporary name that is fsynced and
/// renamed.
pub fn write_rank_file(path: &Path, pieces: &[OwnedPiece]) -> Result<(), TrainError> {
    let mut views = Vec::new();
    let mut metadata = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    for kind in Kind::ALL {
        for piece in pieces {
            let meta = PieceMeta {
                kind,
                ..piece.meta.clone()
            };
            let bytes = &piece.bytes[kind as usize];
            let shape = if meta.end - meta.start == meta.slice_len() {
                slice_shape(&meta)
            } else {
                vec![bytes.len() / 4]
            };
            let name = meta.tensor_name();
            metadata.insert(
                name.clone(),
                serde_json::to_string(&meta).expect("metadata serialises"),
            );
            let view = TensorView::new(Dtype::F32, shape, bytes)
                .map_err(|e| TrainError::Checkpoint(format!("{}: {name}: {e}", path.display())))?;
            views.push((name, view));
        }
    }
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::serialize_to_file(views, Some(metadata), &tmp)
        .map_err(|e| TrainError::Checkpoint(format!("{}: {e}", path.display())))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(io_err("fsync", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
    Ok(())
}

/// Size and SHA-256 of a file, read in blocks so a large shard is never held in memory.
fn hash_file(path: &Path) -> Result<(u64, String), TrainError> {
    use sha2::Digest;
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(io_err("read", path))?;
    let mut hasher = sha2::Sha256::new();
    let mut block = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut block).map_err(io_err("read", path))?;
        if n == 0 {
            break;
        }
        hasher.update(&block[..n]);
        total += n as u64;
    }
    Ok((total, super::format::hex(&hasher.finalize())))
}

/// The shape of the tensor-parallel slice a piece belongs to.
fn slice_shape(meta: &PieceMeta) -> Vec<usize> {
    let mut shape = meta.global_shape.clone();
    match meta.split {
        super::format::SliceKind::Replicated => {}
        super::format::SliceKind::Rows => shape[0] = meta.rows.unwrap_or(shape[0] / meta.tp),
        super::format::SliceKind::Cols => shape[1] /= meta.tp,
    }
    shape
}

/// Empties (or creates) the folder a save of `step` writes into.
pub fn prepare_partial(root: &Path, step: usize) -> Result<PathBuf, TrainError> {
    let partial = root.join(partial_dir_name(step));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io_err("remove stale", &partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io_err("create directory", &partial))?;
    Ok(partial)
}

/// Makes the save in `partial` a checkpoint: checks that all `ranks` files are there, hashes
/// them, writes the manifest, renames the folder into place, points `latest` at it and
/// deletes older checkpoints beyond the newest `keep` (never newer ones, which a resumed run
/// leaves alone). Until the rename the previous checkpoint stays the latest.
pub fn finalize(
    root: &Path,
    partial: &Path,
    mut manifest: Manifest,
    keep: usize,
    ranks: usize,
) -> Result<PathBuf, TrainError> {
    let mut names: Vec<String> = std::fs::read_dir(partial)
        .map_err(io_err("list", partial))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    names.sort();
    let missing: Vec<String> = (0..ranks)
        .map(super::format::rank_file_name)
        .filter(|n| !names.contains(n))
        .collect();
    if !missing.is_empty() {
        return Err(TrainError::Checkpoint(format!(
            "checkpoint save of step {} in {}: {} rank file(s) are not visible to rank 0 ({}…): checkpoint.dir must be on a filesystem every rank shares",
            manifest.step,
            partial.display(),
            missing.len(),
            missing[0]
        )));
    }
    for name in names {
        let (bytes, sha256) = hash_file(&partial.join(&name))?;
        manifest.files.push(FileEntry {
            name,
            bytes,
            sha256,
        });
    }
    let mut json = serde_json::to_string_pretty(&manifest).expect("manifest serialises");
    json.push('\n');
    write_atomic(&partial.join(MANIFEST), json.as_bytes())?;
    let name = step_dir_name(manifest.step);
    let target = root.join(&name);
    // Saving a step again: the old copy moves aside first, so a complete `step_N` exists
    // at every moment.
    let aside = root.join(format!(".{name}.replaced"));
    if target.exists() {
        let _ = std::fs::remove_dir_all(&aside);
        std::fs::rename(&target, &aside).map_err(io_err("move aside", &target))?;
    }
    std::fs::rename(partial, &target).map_err(io_err("rename into place", &target))?;
    sync_dir(root);
    write_atomic(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    let _ = std::fs::remove_dir_all(&aside);
    // The checkpoint is complete: failing to delete old ones (a file still open or mapped
    // elsewhere) must not fail the run.
    if let Err(e) = prune(root, keep, manifest.step) {
        eprintln!("warning: {e}");
    }
    Ok(target)
}

/// Complete checkpoints under `root`, oldest first.
pub fn list_checkpoints(root: &Path) -> Vec<(usize, PathBuf)> {
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step_")?.parse().ok()?;
            e.path().join(MANIFEST).is_file().then(|| (step, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// Deletes every checkpoint under `root` (a replaced run's): the `latest` pointer first, then
/// each `step_N` folder, complete or not, and any save left partial or moved aside. Returns
/// how many folders went; other entries of `root` are left alone.
pub fn clear_checkpoints(root: &Path) -> Result<usize, TrainError> {
    let latest = root.join(LATEST);
    if latest.is_file() {
        std::fs::remove_file(&latest).map_err(io_err("delete", &latest))?;
    }
    let ours = |name: &str| {
        let step = |s: &str| {
            s.strip_prefix("step_")
                .is_some_and(|n| n.parse::<usize>().is_ok())
        };
        step(name)
            || [".partial", ".replaced"].iter().any(|tail| {
                name.strip_prefix('.')
                    .and_then(|n| n.strip_suffix(tail))
                    .is_some_and(step)
            })
    };
    let mut removed = 0;
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() && ours(&entry.file_name().to_string_lossy()) {
            std::fs::remove_dir_all(&path).map_err(io_err("delete checkpoint", &path))?;
            removed += 1;
        }
    }
    Ok(removed)
}

fn prune(root: &Path, keep: usize, newest: usize) -> Result<(), TrainError> {
    let found: Vec<_> = list_checkpoints(root)
        .into_iter()
        .filter(|(step, _)| *step <= newest)
        .collect();
    for (_, path) in found.iter().take(found.len().saturating_sub(keep)) {
        std::fs::remove_dir_all(path).map_err(io_err("delete old checkpoint", path))?;
    }
    Ok(())
}

/// Makes a rename inside `dir` durable; best effort where directories cannot be synced.
fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}
