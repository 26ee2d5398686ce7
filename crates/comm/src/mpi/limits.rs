//! What MPI cannot express, refused up front as [`CommError::InvalidArgument`]: element
//! counts beyond MPI's `int`, and send/receive tags beyond half of the library's
//! `MPI_TAG_UB` (the tag also carries the dtype; see [`MpiWorld::max_tag`]).
//!
//! The threads backend has no such limits, so these are the only arguments the two backends
//! judge differently.

use std::os::raw::c_int;

use super::MpiWorld;
use crate::error::CommError;
use crate::op::Op;

impl MpiWorld {
    /// Sizes MPI cannot express (element counts beyond `int`) and tags beyond the limit.
    pub(super) fn check_limits(&self, op: &Op) -> Result<(), CommError> {
        let too_big = |what: &str, n: usize| {
            (n > c_int::MAX as usize).then(|| CommError::InvalidArgument {
                op: op.name(),
                message: format!(
                    "{what} has {n} elements; MPI counts are limited to {} (use smaller buckets)",
                    c_int::MAX
                ),
            })
        };
        let n = op.group().map_or(1, <[usize]>::len);
        let problem = match op {
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } => {
                too_big("the buffer", buf.len())
            }
            Op::ReduceScatter { input, counts, .. } => {
                too_big("the input", input.len()).or_else(|| {
                    let most = counts.iter().copied().max().unwrap_or(0);
                    too_big("the received chunks", most.saturating_mul(n))
                })
            }
            Op::AllGather { counts, .. } => too_big(
                "the output",
                counts.iter().fold(0usize, |a, &c| a.saturating_add(c)),
            ),
            Op::AllToAll {
                input, recv_counts, ..
            } => too_big("the input", input.len()).or_else(|| {
                too_big(
                    "the output",
                    recv_counts.iter().fold(0usize, |a, &c| a.saturating_add(c)),
                )
            }),
            Op::Send { tag, buf, .. } => {
                too_big("the message", buf.len()).or_else(|| self.tag_problem(op.name(), *tag))
            }
            Op::Recv { tag, len, .. } => {
                too_big("the message", *len).or_else(|| self.tag_problem(op.name(), *tag))
            }
            Op::Barrier { .. } => None,
        };
        problem.map_or(Ok(()), Err)
    }

    fn tag_problem(&self, op: &'static str, tag: u64) -> Option<CommError> {
        (tag > self.max_tag).then(|| CommError::InvalidArgument {
            op,
            message: format!(
                "tag {tag} is beyond what this MPI library supports (at most {})",
                self.max_tag
            ),
        })
    }
}
