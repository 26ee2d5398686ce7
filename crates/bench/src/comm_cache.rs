//! This machine's collective bandwidth as `ferrotron bench-comm` measured it on the threads
//! backend, cached beside the matmul peak, so that `ferrotron plan --hardware cpu-local`
//! predicts this machine from measurements rather than from a guess.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::peak::{cache_dir, cache_key};

/// Messages at least this large measure a collective's sustained bandwidth rather than its
/// latency; smaller sweeps are not cached.
pub const MIN_BANDWIDTH_BYTES: usize = 16 << 20;

/// Bus bandwidths (nccl-tests definition, GB/s) of each collective at one message size of a
/// sweep, and the latency at its smallest message, for one group size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MeasuredComm {
    /// Ranks (threads) in the group.
    pub ranks: usize,
    /// Message size of the bandwidths, bytes.
    pub bytes: usize,
    /// All-reduce bus bandwidth.
    pub all_reduce_gbps: f64,
    /// All-gather bus bandwidth.
    pub all_gather_gbps: f64,
    /// Reduce-scatter bus bandwidth.
    pub reduce_scatter_gbps: f64,
    /// All-to-all bus bandwidth.
    pub all_to_all_gbps: f64,
    /// Broadcast bus bandwidth (one copy per receiver: the rate of a point-to-point send).
    pub broadcast_gbps: f64,
    /// Median time of an all-reduce of the sweep's smallest message, microseconds.
    pub latency_us: f64,
}

/// `collectives.json` in the cache directory.
pub fn cache_path() -> Option<PathBuf> {
    Some(cache_dir()?.join("collectives.json"))
}

fn load() -> BTreeMap<String, MeasuredComm> {
    cache_path()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

/// The cached measurement for groups of `ranks` threads on this CPU, if any.
pub fn cached(ranks: usize) -> Option<MeasuredComm> {
    load().get(&cache_key(ranks)).copied()
}

/// Stores `m` for this CPU and `m.ranks`, atomically (written whole or not at all); the
/// file written, or `None` when neither `XDG_CACHE_HOME` nor `HOME` names a cache directory.
pub fn store(m: &MeasuredComm) -> Result<Option<PathBuf>, ferrotron_train::TrainError> {
    let Some(path) = cache_path() else {
        return Ok(None);
    };
    let mut map = load();
    map.insert(cache_key(m.ranks), *m);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ferrotron_train::TrainError::Io {
            action: "creating",
            path: dir.to_path_buf(),
            source,
        })?;
    }
    ferrotron_train::metrics::write_json(&path, &map)?;
    Ok(Some(path))
}
