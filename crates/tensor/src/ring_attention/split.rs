//! Which global positions each rank holds under a context-parallel split, and how much
//! attention work one (query block, key/value block) pair costs.

/// Why a sequence cannot be split across context-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// The sequence does not cut into the split's equal chunks.
    #[error("seq_len {seq_len} does not cut into {chunks} equal chunks (cp = {cp})")]
    Uneven {
        /// Tokens per sequence.
        seq_len: usize,
        /// Context-parallel ranks.
        cp: usize,
        /// Chunks the split needs: `2·cp` for zig-zag, `cp` for contiguous.
        chunks: usize,
    },
    /// The rank is not one of the `cp` ranks (or `cp` is 0).
    #[error("rank {rank} is not below cp = {cp}")]
    Rank {
        /// The rank asked for.
        rank: usize,
        /// Context-parallel ranks.
        cp: usize,
    },
}

fn chunk_len(seq: usize, cp: usize, rank: usize, chunks: usize) -> Result<usize, SplitError> {
    if rank >= cp {
        return Err(SplitError::Rank { rank, cp });
    }
    if !seq.is_multiple_of(chunks) {
        return Err(SplitError::Uneven {
            seq_len: seq,
            cp,
            chunks,
        });
    }
    Ok(seq / chunks)
}

/// Global positions held by `rank` of `cp` under the zig-zag split: the sequence is cut into
/// `2·cp` equal chunks and rank `i` holds chunks `i` and `2·cp − 1 − i`, in that order.
///
/// Pairing an early chunk with a late one gives every rank the same number of visible causal
/// pairs, where a contiguous split leaves the last rank most of the work.
///
/// # Errors
/// [`SplitError::Uneven`] unless `seq % (2·cp) == 0`; [`SplitError::Rank`] unless
/// `rank < cp`.
pub fn zigzag_positions(seq: usize, cp: usize, rank: usize) -> Result<Vec<usize>, SplitError> {
    let len = chunk_len(seq, cp, rank, 2 * cp)?;
    let (first, second) = (rank * len, (2 * cp - 1 - rank) * len);
    Ok((first..first + len).chain(second..second + len).collect())
}

/// Global positions held by `rank` of `cp` under the contiguous split: chunk `rank` of `cp`
/// equal chunks. The baseline zig-zag is compared against.
///
/// # Errors
/// [`SplitError::Uneven`] unless `seq % cp == 0`; [`SplitError::Rank`] unless `rank < cp`.
pub fn contiguous_positions(seq: usize, cp: usize, rank: usize) -> Result<Vec<usize>, SplitError> {
    let len = chunk_len(seq, cp, rank, cp)?;
    Ok((rank * len..(rank + 1) * len).collect())
}

/// Forward matmul FLOPs of the visible (query, key) pairs of one block pair: each pair costs
/// `2·d` for `Q·Kᵀ` and `2·d` for `P·V`, per query head. Counts exact pairs, so it is the
/// work an ideal mask-aware kernel does; tiled kernels also pay for the masked part of
/// diagonal tiles.
pub fn block_flops(q_pos: &[usize], kv_pos: &[usize], heads: usize, head_dim: usize) -> u64 {
    let mut kv = kv_pos.to_vec();
    kv.sort_unstable();
    let pairs: u64 = q_pos
        .iter()
        .map(|&qp| kv.partition_point(|&kp| kp <= qp) as u64)
        .sum();
    pairs * 4 * head_dim as u64 * heads as u64
}
