//! Opening a checkpoint: resolving `latest`, verifying every file against the manifest
//! before anything is trained, and reassembling any parameter's values for any layout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ferrotron_model::{ParamLayout, ParamSpec};
use memmap2::Mmap;
use safetensors::SafeTensors;

use super::format::{sha256_hex, Kind, Manifest, PieceMeta, SliceKind, FORMAT, LATEST, MANIFEST};
use crate::TrainError;

/// A stored piece: which file, and where its bytes are.
struct Located {
    meta: PieceMeta,
    file: usize,
    bytes: std::ops::Range<usize>,
}

/// A verified checkpoint, its files memory-mapped.
pub struct Checkpoint {
    /// The checkpoint's folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    maps: Vec<Mmap>,
    index: HashMap<(Kind, String), Vec<Located>>,
}

fn bad(dir: &Path, message: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint(format!("checkpoint {}: {message}", dir.display()))
}

/// The checkpoint folder `path` names: a `step_N` folder itself, or a checkpoint root whose
/// `latest` file (or, without one, its newest complete checkpoint) is taken.
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(bad(
            path,
            "does not exist; pass a step_N folder, a checkpoint root or `latest`",
        ));
    }
    let pointer = path.join(LATEST);
    if let Ok(name) = std::fs::read_to_string(&pointer) {
        let dir = path.join(name.trim());
        if dir.join(MANIFEST).is_file() {
            return Ok(dir);
        }
    }
    super::save::list_checkpoints(path)
        .pop()
        .map(|(_, dir)| dir)
        .ok_or_else(|| {
            bad(
                path,
                "holds no complete checkpoint (no step_N/manifest.json)",
            )
        })
}

impl Checkpoint {
    /// Opens the checkpoint `path` names (see [`resolve`]), checking that every file the
    /// manifest lists exists with its size and SHA-256, and that every tensor's metadata
    /// parses. Errors name the file.
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        let dir = resolve(path)?;
        let manifest_path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&manifest_path)
            .map_err(|e| bad(&dir, format!("{MANIFEST}: {e}")))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| bad(&dir, format!("{MANIFEST} is not a valid manifest: {e}")))?;
        if manifest.format != FORMAT {
            return Err(bad(
                &dir,
                format!("format `{}`, expected `{FORMAT}`", manifest.format),
            ));
        }
        let mut maps = Vec::new();
        let mut index: HashMap<(Kind, String), Vec<Located>> = HashMap::new();
        for (file, entry) in manifest.files.iter().enumerate() {
            let path = dir.join(&entry.name);
            let handle = std::fs::File::open(&path)
                .map_err(|e| bad(&dir, format!("file {} is missing ({e})", entry.name)))?;
            // SAFETY: opened read-only; a checkpoint is never modified after its rename.
            let map = unsafe { Mmap::map(&handle) }
                .map_err(|e| bad(&dir, format!("{}: {e}", entry.name)))?;
            if map.len() as u64 != entry.bytes {
                return Err(bad(
                    &dir,
                    format!(
                        "file {} has {} bytes but the manifest lists {}: it is truncated or was replaced",
                        entry.name,
                        map.len(),
                        entry.bytes
                    ),
                ));
            }
            if sha256_hex(&map) != entry.sha256 {
                return Err(bad(
                    &dir,
                    format!(
                        "file {} does not match its SHA-256 in the manifest: it was altered or corrupted",
                        entry.name
                    ),
                ));
            }
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| bad(&dir, format!("file {}: {e}", entry.name)))?;
            let notes = meta.metadata().clone().unwrap_or_default();
            for (name, info) in meta.tensors() {
                let piece: PieceMeta = notes
                    .get(&name)
                    .and_then(|json| serde_json::from_str(json).ok())
                    .ok_or_else(|| {
                        bad(
                            &dir,
                            format!("file {}: tensor {name} has no metadata", entry.name),
                        )
                    })?;
                check_piece(&piece, info.dtype, info.data_offsets).map_err(|why| {
                    bad(&dir, format!("file {}: tensor {name}: {why}", entry.name))
                })?;
                let data = 8 + header_len;
                index
                    .entry((piece.kind, piece.param.clone()))
                    .or_default()
                    .push(Located {
                        meta: piece,
                        file,
                        bytes: data + info.data_offsets.0..data + info.data_offsets.1,
                    });
            }
            maps.push(map);
        }
        Ok(Checkpoint {
            dir,
            manifest,
            maps,
            index,
        })
    }

    /// Every piece of `param` agrees on its global shape and slicing, and that shape is
    /// `global_shape`.
    fn check_pieces(
        &self,
        pieces: &[Located],
        param: &str,
        global_shape: &[usize],
    ) -> Result<(), TrainError> {
        let first = &pieces[0].meta;
        if let Some(p) = pieces.iter().find(|p| {
            (&p.meta.global_shape, p.meta.split, p.meta.tp, p.meta.rows)
                != (&first.global_shape, first.split, first.tp, first.rows)
        }) {
            return Err(bad(
                &self.dir,
                format!(
                    "pieces {} and {} disagree on the shape or slicing of `{param}`",
                    first.tensor_name(),
                    p.meta.tensor_name()
                ),
            ));
        }
        if first.global_shape != global_shape {
            return Err(bad(
                &self.dir,
                format!(
                    "`{param}` has shape {:?} but this model's is {global_shape:?}: the model section differs",
                    first.global_shape
                ),
            ));
        }
        Ok(())
    }

    /// The `slices` tensor-parallel slices of `param` (each `slice_len` elements) read from
    /// its pieces, which must cover every element of every slice exactly once.
    fn read_slices(
        &self,
        kind: Kind,
        param: &str,
        pieces: &[Located],
        (slices, slice_len): (usize, usize),
    ) -> Result<Vec<Vec<f32>>, TrainError> {
        let mut parts = vec![vec![0.0f32; slice_len]; slices];
        let mut covered: Vec<Vec<(usize, usize)>> = vec![Vec::new(); slices];
        for p in pieces {
            let m = &p.meta;
            let bytes = &self.maps[p.file][p.bytes.clone()];
            if m.end > slice_len || bytes.len() != 4 * (m.end - m.start) || m.tp_rank >= slices {
                return Err(bad(
                    &self.dir,
                    format!("piece {} is inconsistent", m.tensor_name()),
                ));
            }
            let dst = &mut parts[m.tp_rank][m.start..m.end];
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            covered[m.tp_rank].push((m.start, m.end));
        }
        // Every element exactly once: sorted ranges must tile the slice without gap or overlap.
        let tiles = |ranges: &mut Vec<(usize, usize)>| {
            ranges.sort_unstable();
            let mut at = 0;
            for &(a, b) in ranges.iter() {
                if a != at {
                    return false;
                }
                at = b;
            }
            at == slice_len
        };
        if let Some(r) = covered.iter_mut().position(|c| !tiles(c)) {
            return Err(bad(
                &self.dir,
                format!(
                    "{} of `{param}`: the pieces of slice {r} do not cover its {slice_len} elements exactly once ({:?})",
                    kind.name(),
                    covered[r]
                ),
            ));
        }
        Ok(parts)
    }

    /// The full (unsharded) values of one parameter's state, reassembled from every piece.
    pub fn full(
        &self,
        kind: Kind,
        param: &str,
        global_shape: &[usize],
    ) -> Result<Vec<f32>, TrainError> {
        let pieces = self.index.get(&(kind, param.to_string())).ok_or_else(|| {
            bad(
                &self.dir,
                format!(
                    "has no {} of `{param}`; was it saved from another model?",
                    kind.name()
                ),
            )
        })?;
        let numel: usize = global_shape.iter().product();
        let first = &pieces[0].meta;
        self.check_pieces(pieces, param, global_shape)?;
        let slices = if first.split == SliceKind::Replicated {
            1
        } else {
            first.tp
        };
        let slice_len = first.slice_len();
        let parts = self.read_slices(kind, param, pieces, (slices, slice_len))?;
        let spec = ParamSpec {
            name: param.to_string(),
            shape: global_shape.to_vec(),
            full_shape: global_shape.to_vec(),
            split: first.split.into(),
            offset: 0,
            decay: false,
            init_std: None,
        };
        let mut full = vec![0.0f32; numel];
        for (r, part) in parts.iter().enumerate() {
            ParamLayout::place_slice(&spec, slices, r, part, &mut full);
        }
        Ok(full)
    }

    /// One state of every parameter of `layout` (a rank's stage and tensor-parallel slice),
    /// in the layout's flat order.
    pub fn local(&self, kind: Kind, layout: &ParamLayout) -> Result<Vec<f32>, TrainError> {
        let mut out = vec![0.0f32; layout.total];
        for spec in &layout.params {
            let full = self.full(kind, &spec.name, &spec.full_shape)?;
            layout.slice_into(spec, &full, &mut out[spec.range()]);
        }
        Ok(out)
    }
}

/// Checks what a piece's metadata claims against itself and its stored tensor, so a damaged
/// or foreign file is an error here rather than a panic while reassembling.
fn check_piece(
    p: &PieceMeta,
    dtype: safetensors::Dtype,
    (from, to): (usize, usize),
) -> Result<(), String> {
    if dtype != safetensors::Dtype::F32 {
        return Err(format!("dtype {dtype:?}, checkpoints store F32"));
    }
    if p.tp == 0 || p.tp_rank >= p.tp {
        return Err(format!("tensor-parallel slice {} of {}", p.tp_rank, p.tp));
    }
    // Rows of a matrix or of a vector (a bias); columns of a matrix.
    let shape = &p.global_shape;
    let fits = match (p.split, p.rows) {
        (SliceKind::Replicated, None) => true,
        (SliceKind::Rows, None) => matches!(shape.len(), 1 | 2) && shape[0].is_multiple_of(p.tp),
        (SliceKind::Cols, None) => shape.len() == 2 && shape[1].is_multiple_of(p.tp),
        // A padded slice (the vocabulary under TP): `rows` rows each, together at least the
        // global ones, at most 65,536 of them padding per slice (`model.vocab_multiple`).
        (SliceKind::Rows, Some(rows)) => {
            let padded = rows.saturating_mul(p.tp);
            matches!(shape.len(), 1 | 2) && padded >= shape[0] && padded - shape[0] < 65_536 * p.tp
        }
        (_, Some(_)) => false,
    };
    if !fits {
        return Err(format!(
            "{:?} slicing of shape {:?} into {} parts{}",
            p.split,
            p.global_shape,
            p.tp,
            p.rows.map(|r| format!(" of {r} rows")).unwrap_or_default()
        ));
    }
    if p.start > p.end || p.end > p.slice_len() || to - from != 4 * (p.end - p.start) {
        return Err(format!(
            "elements {}..{} of a slice of {} in {} bytes",
            p.start,
            p.end,
            p.slice_len(),
            to - from
        ));
    }
    Ok(())
}
