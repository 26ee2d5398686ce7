//! The weight files of a model directory. A model is stored either as one `model.safetensors`,
//! or, above the shard size, as `model-0000k-of-0000n.safetensors` files with a
//! `model.safetensors.index.json` whose `weight_map` says which file holds each tensor. Both
//! are written as transformers writes them; its default shard size is 50 GB.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use ferrotron_data::token_file::write_atomic;
use safetensors::tensor::TensorView;
use safetensors::Dtype as StDtype;
use serde::{Deserialize, Serialize};

use super::model_err;
use crate::{io_err, TrainError};

/// The single-file name.
pub const WEIGHTS: &str = "model.safetensors";
/// The index of a sharded model.
pub const INDEX: &str = "model.safetensors.index.json";
/// transformers 5's default `max_shard_size` ("50GB"), in bytes.
pub const DEFAULT_MAX_SHARD: u64 = 50_000_000_000;

/// A size as transformers' `max_shard_size` takes it: bytes, or a number with KB/MB/GB
/// (powers of 1000) or KiB/MiB/GiB (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use B, KB, MB, GB, KiB, MiB or GiB)"
            ))
        }
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 5GB or 500MB"))?;
    if !(n > 0.0 && n.is_finite()) {
        return Err(format!("{text:?}: a shard size must be positive"));
    }
    Ok((n * scale as f64) as u64)
}

/// Tensors of `sizes` bytes, in order, grouped into shards of at most `max` bytes (a tensor
/// larger than `max` gets a shard of its own), as transformers groups them.
pub fn plan(sizes: &[usize], max: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes + s as u64 > max {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += s as u64;
    }
    if start < sizes.len() || sizes.is_empty() {
        shards.push(start..sizes.len());
    }
    shards
}

/// The file name of shard `k` (from 0) of `n`.
fn shard_name(k: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
}

#[derive(Serialize, Deserialize)]
struct Index {
    metadata: BTreeMap<String, serde_json::Value>,
    weight_map: BTreeMap<String, String>,
}

/// Writes `tensors` (name, shape, little-endian bytes of `dtype`) into `dir`: one file, or
/// shards and their index when they pass `max_shard` bytes. Each file is written atomically,
/// the index last; weight files of an earlier save that this one does not use are removed.
pub fn write(
    dir: &Path,
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    dtype: StDtype,
    max_shard: u64,
) -> Result<(), TrainError> {
    let sizes: Vec<usize> = tensors.iter().map(|t| t.2.len()).collect();
    let shards = plan(&sizes, max_shard);
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut written = Vec::new();
    for (k, range) in shards.iter().enumerate() {
        let name = if n == 1 {
            WEIGHTS.to_string()
        } else {
            shard_name(k, n)
        };
        let views = tensors[range.clone()]
            .iter()
            .map(|(t, shape, data)| {
                let view = TensorView::new(dtype, shape.clone(), data)
                    .map_err(|e| model_err(dir, format!("{t}: {e}")))?;
                weight_map.insert(t.clone(), name.clone());
                Ok((t.clone(), view))
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        let blob = safetensors::serialize(views, Some(metadata))
            .map_err(|e| model_err(dir, e.to_string()))?;
        write_atomic(&dir.join(&name), &blob)?;
        written.push(name);
    }
    if n > 1 {
        let total: u64 = sizes.iter().map(|&s| s as u64).sum();
        let index = Index {
            metadata: BTreeMap::from([("total_size".to_string(), total.into())]),
            weight_map,
        };
        let mut json = serde_json::to_string_pretty(&index).expect("index serialises");
        json.push('\n');
        write_atomic(&dir.join(INDEX), json.as_bytes())?;
        written.push(INDEX.to_string());
    }
    remove_stale(dir, &written)
}

/// Removes weight files of an earlier save (single file, index, shards) not in `keep`.
fn remove_stale(dir: &Path, keep: &[String]) -> Result<(), TrainError> {
    let entries = std::fs::read_dir(dir).map_err(io_err("list", dir))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let ours = name == WEIGHTS
            || name == INDEX
            || (name.starts_with("model-")
                && name.contains("-of-")
                && name.ends_with(".safetensors"));
        if ours && !keep.contains(&name) {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(io_err("remove", &path))?;
        }
    }
    Ok(())
}

/// The weight files of `dir` and, when sharded, which file holds each tensor.
pub struct Files {
    /// Each file, memory-mapped.
    pub maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name → index into `maps` (empty for a single file).
    pub weight_map: HashMap<String, usize>,
}

/// Opens `dir`'s weights: its index and every shard it names, or `model.safetensors`.
pub fn open(dir: &Path) -> Result<Files, TrainError> {
    let map_file = |path: PathBuf| -> Result<(PathBuf, memmap2::Mmap), TrainError> {
        let file = std::fs::File::open(&path).map_err(io_err("open", &path))?;
        // SAFETY: the file is opened read-only and not modified while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err("memory-map", &path))?;
        Ok((path, map))
    };
    let index_path = dir.join(INDEX);
    if !index_path.exists() {
        return Ok(Files {
            maps: vec![map_file(dir.join(WEIGHTS))?],
            weight_map: HashMap::new(),
        });
    }
    let text = std::fs::read_to_string(&index_path).map_err(io_err("read", &index_path))?;
    let index: Index =
        serde_json::from_str(&text).map_err(|e| model_err(dir, format!("{INDEX}: {e}")))?;
    let mut files: Vec<String> = index.weight_map.values().cloned().collect();
    files.sort();
    files.dedup();
    for f in &files {
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(model_err(
                dir,
                format!("{INDEX} names the file {f:?}, outside the directory"),
            ));
        }
    }
    let maps = files
        .iter()
        .map(|f| map_file(dir.join(f)))
        .collect::<Result<Vec<_>, _>>()?;
    let weight_map = index
        .weight_map
        .iter()
        .map(|(t, f)| {
            (
                t.clone(),
                files.iter().position(|x| x == f).expect("listed"),
            )
        })
        .collect();
    Ok(Files { maps, weight_map })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_transformers_reads_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5kb"), Ok(1500));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("5XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("big").is_err());
    }

    #[test]
    fn shards_close_before_passing_the_limit_and_big_tensors_stand_alone() {
        assert_eq!(plan(&[4, 4, 4], 8), vec![0..2, 2..3]);
        assert_eq!(plan(&[4, 20, 4], 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(plan(&[4, 4], 100), vec![0..2]);
        assert_eq!(plan(&[], 100), vec![0..0]);
    }
}
