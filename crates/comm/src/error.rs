//! Typed errors of the topology, of communication and of the rank harness.

use std::time::Duration;

use thiserror::Error;

/// A parallel layout that cannot be built, or a question about a rank it does not have.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TopologyError {
    /// A parallel degree is zero.
    #[error("parallel.{field}=0: must be at least 1")]
    ZeroDegree {
        /// The degree's name: `dp`, `pp`, `cp`, `tp` or `ep`.
        field: &'static str,
    },
    /// Expert parallelism must split the data-parallel ranks evenly.
    #[error(
        "parallel.ep={ep} does not divide parallel.dp={dp}: \
         expert parallelism is folded into data parallelism"
    )]
    EpNotDividing {
        /// Expert-parallel degree.
        ep: usize,
        /// Data-parallel degree.
        dp: usize,
    },
    /// The number of ranks launched differs from the layout's product.
    #[error(
        "world size {world} ≠ dp·pp·cp·tp = {expected} (dp={dp} pp={pp} cp={cp} tp={tp}): \
         launch {expected} ranks or change the layout"
    )]
    WorldMismatch {
        /// Ranks launched.
        world: usize,
        /// Ranks the layout needs.
        expected: usize,
        /// Data-parallel degree.
        dp: usize,
        /// Pipeline-parallel degree.
        pp: usize,
        /// Context-parallel degree.
        cp: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// `dp·pp·cp·tp` does not fit in a `usize`.
    #[error("dp·pp·cp·tp overflows: dp={dp} pp={pp} cp={cp} tp={tp}")]
    TooManyRanks {
        /// Data-parallel degree.
        dp: usize,
        /// Pipeline-parallel degree.
        pp: usize,
        /// Context-parallel degree.
        cp: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// A rank at or beyond the world size.
    #[error("rank {rank} is out of range: the layout has {world} ranks")]
    RankOutOfRange {
        /// The rank asked about.
        rank: usize,
        /// Ranks in the layout.
        world: usize,
    },
    /// A grid coordinate at or beyond its degree.
    #[error("coordinate {field}={value} is out of range: parallel.{field}={degree}")]
    CoordOutOfRange {
        /// The coordinate's name.
        field: &'static str,
        /// The value given.
        value: usize,
        /// The degree of that dimension.
        degree: usize,
    },
}

/// Why a communication operation did not complete.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CommError {
    /// Bad arguments on this rank (detected before anything was exchanged with peers, or
    /// reported to them as a mismatch).
    #[error("{op}: {message}")]
    InvalidArgument {
        /// Operation name, e.g. `all_gather`.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The calling rank is not a member of the group it named.
    #[error("{op}: rank {rank} is not in group {group:?}")]
    NotInGroup {
        /// Operation name.
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// The group it named.
        group: Vec<usize>,
    },
    /// The members of a group called different operations, or the same one with
    /// inconsistent sizes, dtypes or arguments.
    #[error("{op} on group {group:?}: members disagree (ranks {ranks:?}): {detail}")]
    Mismatch {
        /// Operation name as called by this rank.
        op: &'static str,
        /// The group, as world ranks.
        group: Vec<usize>,
        /// The world ranks that disagree with the majority.
        ranks: Vec<usize>,
        /// What each side called.
        detail: String,
    },
    /// Some members never arrived.
    #[error("{op} on group {group:?} timed out after {after:?} waiting for {}", rank_words(.missing))]
    Timeout {
        /// Operation name.
        op: &'static str,
        /// The group, as world ranks (for point-to-point: source and destination).
        group: Vec<usize>,
        /// World ranks that never arrived.
        missing: Vec<usize>,
        /// The configured timeout.
        after: Duration,
    },
    /// Another rank (or this one, earlier) failed; the world no longer communicates.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// The first rank that failed.
        rank: usize,
        /// Why it failed.
        reason: String,
    },
    /// The transport could not do what was asked (a backend failure, not a peer's).
    #[error("{op} on rank {rank}: {message}")]
    Backend {
        /// Operation name.
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// What went wrong.
        message: String,
    },
    /// The communicator's worker thread is gone (it should never be, short of a bug).
    #[error("{op}: the communicator of rank {rank} is closed")]
    Closed {
        /// Operation name.
        op: &'static str,
        /// The rank whose communicator closed.
        rank: usize,
    },
}

/// "rank 3" or "ranks 0, 2".
pub(crate) fn rank_words(ranks: &[usize]) -> String {
    let list = ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if ranks.len() == 1 {
        format!("rank {list}")
    } else {
        format!("ranks {list}")
    }
}

/// The first rank that failed in a [`run_ranks`](crate::run_ranks) world, and why.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("rank {rank} failed: {message}")]
pub struct RankFailure {
    /// The failing rank.
    pub rank: usize,
    /// Its error message, or its panic message prefixed with `panicked: `.
    pub message: String,
}
