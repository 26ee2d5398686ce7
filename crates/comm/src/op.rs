//! Operations as data: what a rank asks its transport to do, and the checks every backend
//! applies before and during the exchange.

use std::collections::BTreeMap;

use crate::buf::{CommBuf, DType};
use crate::error::{rank_words, CommError};

/// How [`Op::AllReduce`] combines the members' contributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum, accumulated in f32 in group-index order.
    Sum,
    /// The sum divided by the group size (in f32, before bf16 rounding).
    Mean,
}

/// One operation of one rank. Groups are lists of world ranks in increasing order that
/// contain the calling rank; a member's "index" is its position in that list.
#[derive(Debug)]
pub enum Op {
    /// Every member gets the element-wise reduction of every member's buffer.
    AllReduce {
        /// Members.
        group: Vec<usize>,
        /// This member's contribution; same length and dtype on every member.
        buf: CommBuf,
        /// Sum or mean.
        op: ReduceOp,
    },
    /// Member `i` gets the sum over members of elements `[Σcounts[..i], Σcounts[..=i])`.
    ReduceScatter {
        /// Members.
        group: Vec<usize>,
        /// `Σcounts` elements.
        input: CommBuf,
        /// Elements each member receives (may be uneven; identical on every member).
        counts: Vec<usize>,
    },
    /// Every member gets the concatenation of every member's input, in group order.
    AllGather {
        /// Members.
        group: Vec<usize>,
        /// `counts[index]` elements.
        input: CommBuf,
        /// Elements each member contributes (identical on every member).
        counts: Vec<usize>,
    },
    /// Every member gets the root's buffer.
    Broadcast {
        /// Members.
        group: Vec<usize>,
        /// The root's data; on other members a buffer of the same length and dtype.
        buf: CommBuf,
        /// Group index of the root.
        root: usize,
    },
    /// Member `i` sends `send_counts[j]` consecutive elements to member `j` and receives
    /// the concatenation, in group order, of what every member sent it.
    AllToAll {
        /// Members.
        group: Vec<usize>,
        /// `Σsend_counts` elements.
        input: CommBuf,
        /// Elements sent to each member, in order.
        send_counts: Vec<usize>,
        /// Elements received from each member; must equal what each sends here.
        recv_counts: Vec<usize>,
    },
    /// Completes once every member has reached it.
    Barrier {
        /// Members.
        group: Vec<usize>,
    },
    /// Buffered point-to-point send: completes without waiting for the receiver.
    Send {
        /// Destination world rank.
        dst: usize,
        /// Messages match receives by (source, tag), in order.
        tag: u64,
        /// The message.
        buf: CommBuf,
    },
    /// Receives the oldest message from `src` with `tag`.
    Recv {
        /// Source world rank.
        src: usize,
        /// Tag to match.
        tag: u64,
        /// Expected length; a different one is a mismatch.
        len: usize,
        /// Expected dtype; a different one is a mismatch.
        dtype: DType,
    },
}

/// What an operation produces.
#[derive(Debug)]
pub enum OpOutput {
    /// A buffer on the calling rank's ledger.
    Buf(CommBuf),
    /// Nothing (send, barrier).
    Done,
}

/// What members compare to decide whether they called the same thing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Signature {
    /// Operation, dtype and shared sizes; must be equal on every member.
    pub common: String,
    /// All-to-all send counts (cross-checked against the receivers' counts).
    pub send: Vec<usize>,
    /// All-to-all receive counts.
    pub recv: Vec<usize>,
    /// This member's arguments were invalid, and why: its peers report a mismatch.
    pub invalid: Option<String>,
}

impl Signature {
    /// A signature that only names a step every member takes (nothing to compare).
    pub fn plain(common: &str) -> Signature {
        Signature {
            common: common.to_string(),
            send: vec![],
            recv: vec![],
            invalid: None,
        }
    }
}

impl Op {
    /// The buffer the operation sends, if any.
    pub(crate) fn buf_mut(&mut self) -> Option<&mut CommBuf> {
        match self {
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } | Op::Send { buf, .. } => {
                Some(buf)
            }
            Op::ReduceScatter { input, .. }
            | Op::AllGather { input, .. }
            | Op::AllToAll { input, .. } => Some(input),
            Op::Barrier { .. } | Op::Recv { .. } => None,
        }
    }

    /// The operation's name, as used in errors: `all_reduce`, `reduce_scatter`, ...
    pub fn name(&self) -> &'static str {
        match self {
            Op::AllReduce { .. } => "all_reduce",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllGather { .. } => "all_gather",
            Op::Broadcast { .. } => "broadcast",
            Op::AllToAll { .. } => "all_to_all",
            Op::Barrier { .. } => "barrier",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
        }
    }

    /// Bytes this rank contributes (its input buffer; for a receive, what it expects).
    pub fn payload_bytes(&self) -> usize {
        match self {
            Op::AllReduce { buf, .. } | Op::Broadcast { buf, .. } | Op::Send { buf, .. } => {
                buf.size_bytes()
            }
            Op::ReduceScatter { input, .. }
            | Op::AllGather { input, .. }
            | Op::AllToAll { input, .. } => input.size_bytes(),
            Op::Recv { len, dtype, .. } => len * dtype.size_bytes(),
            Op::Barrier { .. } => 0,
        }
    }

    /// The group of a collective, `None` for send and receive.
    pub fn group(&self) -> Option<&[usize]> {
        match self {
            Op::AllReduce { group, .. }
            | Op::ReduceScatter { group, .. }
            | Op::AllGather { group, .. }
            | Op::Broadcast { group, .. }
            | Op::AllToAll { group, .. }
            | Op::Barrier { group } => Some(group),
            Op::Send { .. } | Op::Recv { .. } => None,
        }
    }

    /// Checks the group (or peer rank) of `rank`'s operation in a world of `world` ranks:
    /// sorted, without repeats, in range and containing `rank`. Returns `rank`'s group
    /// index (0 for point-to-point). Nothing can be exchanged with peers when this fails.
    pub fn check_group(&self, rank: usize, world: usize) -> Result<usize, CommError> {
        let op = self.name();
        let invalid = |message: String| CommError::InvalidArgument { op, message };
        let Some(group) = self.group() else {
            let peer = match self {
                Op::Send { dst, .. } => *dst,
                Op::Recv { src, .. } => *src,
                _ => 0,
            };
            if peer >= world {
                return Err(invalid(format!(
                    "peer rank {peer} is out of range: the world has {world} ranks"
                )));
            }
            return Ok(0);
        };
        if group.windows(2).any(|w| w[0] >= w[1]) {
            return Err(invalid(format!(
                "group {group:?} must list world ranks in increasing order without repeats"
            )));
        }
        if let Some(&r) = group.iter().find(|&&r| r >= world) {
            return Err(invalid(format!(
                "group {group:?} names rank {r} but the world has {world} ranks"
            )));
        }
        group
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| CommError::NotInGroup {
                op,
                rank,
                group: group.to_vec(),
            })
    }

    /// Checks the arguments against the group size, for the member at group `index`.
    pub fn check_args(&self, index: usize) -> Result<(), CommError> {
        self.args_problem(index)
            .map_err(|message| CommError::InvalidArgument {
                op: self.name(),
                message,
            })
    }

    fn args_problem(&self, index: usize) -> Result<(), String> {
        let n = self.group().map_or(1, <[usize]>::len);
        match self {
            Op::ReduceScatter { input, counts, .. } => {
                let total = sum_counts("counts", counts, n)?;
                if input.len() != total {
                    return Err(format!(
                        "input has {} elements but Σcounts = {total}",
                        input.len()
                    ));
                }
            }
            Op::AllGather { input, counts, .. } => {
                sum_counts("counts", counts, n)?;
                let want = counts.get(index).copied().unwrap_or(0);
                if input.len() != want {
                    return Err(format!(
                        "input has {} elements but counts[{index}] = {want}",
                        input.len()
                    ));
                }
            }
            Op::Broadcast { root, .. } if *root >= n => {
                return Err(format!(
                    "root index {root} is out of range for a group of {n}"
                ));
            }
            Op::AllToAll {
                input,
                send_counts,
                recv_counts,
                ..
            } => {
                let total = sum_counts("send_counts", send_counts, n)?;
                if input.len() != total {
                    return Err(format!(
                        "input has {} elements but Σsend_counts = {total}",
                        input.len()
                    ));
                }
                sum_counts("recv_counts", recv_counts, n)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// The signature members compare; `invalid` carries a failed [`Op::check_args`].
    pub(crate) fn signature(&self, invalid: Option<String>) -> Signature {
        let name = self.name();
        let (common, send, recv) = match self {
            Op::AllReduce { buf, op, .. } => {
                let op = if *op == ReduceOp::Sum { "sum" } else { "mean" };
                let common = format!("{name}({} × {}, {op})", buf.len(), buf.dtype());
                (common, vec![], vec![])
            }
            Op::ReduceScatter { input, counts, .. } | Op::AllGather { input, counts, .. } => {
                let common = format!("{name}({}, counts {counts:?})", input.dtype());
                (common, vec![], vec![])
            }
            Op::Broadcast { buf, root, .. } => {
                let common = format!("{name}({} × {}, root {root})", buf.len(), buf.dtype());
                (common, vec![], vec![])
            }
            Op::AllToAll {
                input,
                send_counts,
                recv_counts,
                ..
            } => (
                format!("{name}({})", input.dtype()),
                send_counts.clone(),
                recv_counts.clone(),
            ),
            Op::Barrier { .. } | Op::Send { .. } | Op::Recv { .. } => {
                (name.to_string(), vec![], vec![])
            }
        };
        Signature {
            common,
            send,
            recv,
            invalid,
        }
    }
}

/// The sum of `counts`, checking that it has one entry per member and does not overflow.
fn sum_counts(what: &str, counts: &[usize], n: usize) -> Result<usize, String> {
    if counts.len() != n {
        return Err(format!(
            "{what} has {} entries but the group has {n} members",
            counts.len()
        ));
    }
    counts
        .iter()
        .try_fold(0usize, |acc, &c| acc.checked_add(c))
        .ok_or_else(|| format!("Σ{what} overflows"))
}

/// Checks that every member called the same thing; `sigs[i]` is member `i`'s signature.
/// Every member sees the same signatures, so every member reaches the same verdict.
pub(crate) fn check_agreement(
    op: &'static str,
    group: &[usize],
    sigs: &[&Signature],
) -> Result<(), CommError> {
    let mismatch = |ranks: Vec<usize>, detail: String| CommError::Mismatch {
        op,
        group: group.to_vec(),
        ranks,
        detail,
    };
    let invalid: Vec<(usize, &String)> = sigs
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.invalid.as_ref().map(|m| (group[i], m)))
        .collect();
    if !invalid.is_empty() {
        let detail = invalid
            .iter()
            .map(|(r, m)| format!("rank {r}: {m}"))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(mismatch(invalid.iter().map(|&(r, _)| r).collect(), detail));
    }
    // Members grouped by what they called, in order of first appearance.
    let mut calls: BTreeMap<usize, (&str, Vec<usize>)> = BTreeMap::new();
    for (i, s) in sigs.iter().enumerate() {
        let first = sigs.iter().position(|t| t.common == s.common).unwrap_or(i);
        calls
            .entry(first)
            .or_insert_with(|| (s.common.as_str(), vec![]))
            .1
            .push(group[i]);
    }
    if calls.len() > 1 {
        let majority = calls
            .values()
            .map(|(_, ranks)| ranks.len())
            .max()
            .unwrap_or(0);
        // The first (lowest-ranked) of the largest sets counts as the majority.
        let mut outliers = Vec::new();
        let mut seen_majority = false;
        for (_, ranks) in calls.values() {
            if ranks.len() == majority && !seen_majority {
                seen_majority = true;
            } else {
                outliers.extend_from_slice(ranks);
            }
        }
        outliers.sort_unstable();
        let detail = calls
            .values()
            .map(|(call, ranks)| format!("{} called {call}", rank_words(ranks)))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(mismatch(outliers, detail));
    }
    // All-to-all: what member i sends to j must be what j expects from i.
    for (i, si) in sigs.iter().enumerate() {
        for (j, sj) in sigs.iter().enumerate() {
            if let (Some(&sent), Some(&expected)) = (si.send.get(j), sj.recv.get(i)) {
                if sent != expected {
                    let detail = format!(
                        "rank {} sends {sent} elements to rank {} but rank {} expects {expected}",
                        group[i], group[j], group[j]
                    );
                    let mut ranks = vec![group[i], group[j]];
                    ranks.dedup();
                    return Err(mismatch(ranks, detail));
                }
            }
        }
    }
    Ok(())
}
