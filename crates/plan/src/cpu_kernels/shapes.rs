//! The shapes the CPU cost model times: each GEMM, attention call, dense block's
//! element-wise kernels and LM head a unit runs, and the set of them a layout needs.

use serde::{Deserialize, Serialize};

/// Which product of a linear layer `y[t×out] = x[t×in]·Wᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemmForm {
    /// `y = x·Wᵀ`.
    Forward,
    /// `dx = dy·W`.
    BackwardInput,
    /// `dW += dyᵀ·x`.
    BackwardWeight,
}

/// One GEMM of a linear layer of `t` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GemmShape {
    /// Which product.
    pub form: GemmForm,
    /// Tokens.
    pub t: usize,
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
}

impl GemmShape {
    /// `2·t·in·out`.
    pub fn flops(&self) -> f64 {
        2.0 * (self.t * self.d_in * self.d_out) as f64
    }
}

/// One causal attention call over whole sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AttnShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads (this rank's).
    pub heads: usize,
    /// Key/value heads (this rank's).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Context-parallel ranks: above 1, one rank's ring attention (its `seq/cp` queries
    /// against each of the `cp` key/value blocks of the zig-zag split, merged), whose
    /// partly masked tiles cost more than its share of the visible pairs.
    #[serde(default = "one")]
    pub cp: usize,
}

fn one() -> usize {
    1
}

/// The element-wise kernels of one dense block: two RMSNorms over `t_norm` tokens of
/// `hidden`, RoPE on `t` tokens of `heads` and `kv_heads` heads, SwiGLU over `t × ffn`, two
/// residual adds; timed together, forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockElementwise {
    /// Tokens of the norm/residual region (`t/tp` under sequence parallelism).
    pub t_norm: usize,
    /// Tokens of the attention/MLP region.
    pub t: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads (this rank's).
    pub heads: usize,
    /// Key/value heads (this rank's).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// MLP inner size (this rank's).
    pub ffn: usize,
}

/// The LM head with its cross-entropy, forward and backward, over `t` tokens in chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HeadShape {
    /// Tokens.
    pub t: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Vocabulary rows (this rank's).
    pub vocab: usize,
    /// Tokens per chunk.
    pub chunk: usize,
}

/// What a unit's kernels need measured: its GEMM shapes and attention shapes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Needs {
    /// GEMM shapes.
    pub gemm: Vec<GemmShape>,
    /// Attention shapes.
    pub attention: Vec<AttnShape>,
    /// Dense blocks' element-wise kernels.
    pub elementwise: Vec<BlockElementwise>,
    /// LM heads.
    pub head: Vec<HeadShape>,
}

impl Needs {
    /// Adds `other`'s shapes, each kept once.
    pub fn merge(&mut self, other: Needs) {
        self.gemm.extend(other.gemm);
        self.attention.extend(other.attention);
        self.elementwise.extend(other.elementwise);
        self.head.extend(other.head);
        self.dedup();
    }

    /// Each shape once, in order.
    pub(super) fn dedup(&mut self) {
        self.gemm.sort();
        self.gemm.dedup();
        self.attention.sort();
        self.attention.dedup();
        self.elementwise.sort();
        self.elementwise.dedup();
        self.head.sort();
        self.head.dedup();
    }
}
