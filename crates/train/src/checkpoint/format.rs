//! What a checkpoint directory holds, as types: the manifest, the metadata of every stored
//! piece, and the names of files and tensors.
//!
//! ```text
//! <checkpoint.dir>/
//!   latest                      "step_00000010\n", rewritten atomically after each save
//!   step_00000010/
//!     manifest.json             Manifest: step, data position, config, every file + sha256
//!     rank_00000.safetensors    what world rank 0 owns (see below)
//!     rank_00001.safetensors
//!   .step_00000020.partial/     a save in progress (or interrupted): never read
//! ```
//!
//! Each rank writes only what it owns, so no element is stored twice: its ZeRO shard of the
//! fp32 master weights and both Adam moments (data-parallel rank 0 under ZeRO-0), of its
//! tensor-parallel slice (replicated norm weights by tensor-parallel rank 0 only), of its
//! pipeline stage's parameters. A stored tensor is named `<kind>/<parameter>` (with
//! `@<start>-<end>` appended when it holds part of the slice); its safetensors metadata entry
//! of the same name is a JSON [`PieceMeta`] naming the parameter, its global shape, the
//! tensor-parallel slice and the flat element range of that slice the tensor holds. That is
//! enough to reassemble every parameter under any other layout.
//!
//! Storage-dtype weights are not stored: bf16 weights are the fp32 master rounded once,
//! so they are rebuilt exactly. Data order is a function of (seed, sample index), so the
//! data position is the number of samples consumed; no random stream advances during
//! training, so the seed is the whole RNG state.

use serde::{Deserialize, Serialize};

use ferrotron_config::Config;
use ferrotron_model::Split;

/// The `format` field of every manifest.
pub const FORMAT: &str = "ferrotron-checkpoint-1";
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// The pointer file naming the newest complete checkpoint.
pub const LATEST: &str = "latest";

/// The folder name of the checkpoint after `step` steps.
pub fn step_dir_name(step: usize) -> String {
    format!("step_{step:08}")
}

/// The folder a save of `step` writes into before it is renamed into place.
pub fn partial_dir_name(step: usize) -> String {
    format!(".step_{step:08}.partial")
}

/// The file world rank `rank` writes.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank_{rank:05}.safetensors")
}

/// Which per-parameter state a stored piece holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// fp32 master weights (the weights themselves in f32 training).
    Master,
    /// Adam first moment.
    ExpAvg,
    /// Adam second moment.
    ExpAvgSq,
}

impl Kind {
    /// Every kind, in file order.
    pub const ALL: [Kind; 3] = [Kind::Master, Kind::ExpAvg, Kind::ExpAvgSq];

    /// The tensor-name prefix (PyTorch's optimizer-state names for the moments).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Master => "master",
            Kind::ExpAvg => "exp_avg",
            Kind::ExpAvgSq => "exp_avg_sq",
        }
    }
}

/// How the saving run divided a parameter over tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SliceKind {
    /// Whole on every rank.
    Replicated,
    /// Contiguous blocks of rows.
    Rows,
    /// Contiguous blocks of columns.
    Cols,
}

impl From<Split> for SliceKind {
    fn from(s: Split) -> Self {
        match s {
            Split::Replicated => SliceKind::Replicated,
            Split::Rows => SliceKind::Rows,
            Split::Cols => SliceKind::Cols,
        }
    }
}

impl From<SliceKind> for Split {
    fn from(s: SliceKind) -> Self {
        match s {
            SliceKind::Replicated => Split::Replicated,
            SliceKind::Rows => Split::Rows,
            SliceKind::Cols => Split::Cols,
        }
    }
}

/// Where a stored tensor belongs: the metadata entry of every tensor of a rank file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceMeta {
    /// Hugging Face parameter name.
    pub param: String,
    /// Which state.
    pub kind: Kind,
    /// The parameter's global (unsharded) shape.
    pub global_shape: Vec<usize>,
    /// How the saving run sliced it over tensor parallelism.
    pub split: SliceKind,
    /// Tensor-parallel degree of the saving run.
    pub tp: usize,
    /// The tensor-parallel slice held (0 for replicated parameters).
    pub tp_rank: usize,
    /// First element held, in the slice's row-major order.
    pub start: usize,
    /// One past the last element held.
    pub end: usize,
    /// Rows of each tensor-parallel slice where the saving run padded the parameter (the
    /// vocabulary under TP: `rows × tp` ≥ the global rows, the rows past them zero);
    /// absent: the global rows divided by `tp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<usize>,
}

impl PieceMeta {
    /// Elements of the tensor-parallel slice the piece is part of.
    pub fn slice_len(&self) -> usize {
        let n: usize = self.global_shape.iter().product();
        match (self.split, self.rows) {
            (SliceKind::Replicated, _) => n,
            (SliceKind::Rows, Some(rows)) => {
                rows.saturating_mul(n / self.global_shape.first().copied().unwrap_or(1).max(1))
            }
            _ => n / self.tp,
        }
    }

    /// The stored tensor's name.
    pub fn tensor_name(&self) -> String {
        let base = format!("{}/{}", self.kind.name(), self.param);
        if self.start == 0 && self.end == self.slice_len() {
            base
        } else {
            format!("{base}@{}-{}", self.start, self.end)
        }
    }
}

/// One file of a checkpoint, as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint folder.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, lowercase hex (`sha256sum` prints the same).
    pub sha256: String,
}

/// `manifest.json`: everything about a checkpoint except the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Optimizer steps taken; the LR schedule and Adam's bias correction continue from it.
    pub step: usize,
    /// Training samples consumed (the data position): the next step starts at this index.
    pub samples_done: u64,
    /// The run's seed: with the sample index it determines the data; it is the whole RNG
    /// state.
    pub seed: u64,
    /// The configuration of the saving run (its layout describes how the files are sliced).
    pub config: Config,
    /// Every file with its size and checksum.
    pub files: Vec<FileEntry>,
    /// The tokens the run consumed (absent in checkpoints written before it was recorded):
    /// a resume on other data is refused ([`super::Checkpoint::check_data`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<ferrotron_data::DataFingerprint>,
    /// Aux-loss-free balancing's per-expert biases of the mixture-of-experts blocks, in
    /// block order (`model.moe_balance = "bias"`; the same on every rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_bias: Option<Vec<Vec<f32>>>,
    /// The dynamic loss scale of an fp16 run (`train.dtype = "fp16"`): a resume under fp16
    /// goes on from it, one under another dtype ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::loss_scale::LossScale>,
    /// FP8 delayed scaling's amax histories (`train.fp8_amax_history`), by weight name, six
    /// operand roles each (the same on every rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_amax_history: Option<std::collections::BTreeMap<String, Vec<Vec<f32>>>>,
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}

/// Lowercase hex of a digest, as `sha256sum` prints it.
pub(crate) fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}
