//! What one member computes once it can read every member's contribution.
//!
//! Pure functions over the members' buffers in group order. Every reduction adds the
//! members' values in group-index order in f32 (`((x₀ + x₁) + x₂) + …`) and rounds to the
//! output dtype once, so every member that computes an element gets the same bits.

use ferrotron_tensor::{Category, Ledger};

use crate::buf::{Builder, CommBuf, DType};
use crate::op::ReduceOp;

/// `[start, end)` of member `index`'s share when `len` elements are split evenly over `n`
/// members (the first members get the shorter shares when `len % n != 0`).
pub(crate) fn even_range(len: usize, n: usize, index: usize) -> (usize, usize) {
    let at = |i: usize| (i as u128 * len as u128 / n.max(1) as u128) as usize;
    (at(index), at(index + 1))
}

/// Σ over members of elements `[start, start + len)`, in group-index order, in f32.
pub(crate) fn sum_range(inputs: &[&CommBuf], start: usize, len: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; len];
    if let Some((first, rest)) = inputs.split_first() {
        first.read_into(start, &mut acc);
        for b in rest {
            b.add_into(start, &mut acc);
        }
    }
    acc
}

/// All-reduce, first half: member `index` reduces its even share of the elements. The
/// share stays in f32 (counted under communication) so that bf16 is rounded only once.
pub(crate) fn all_reduce_share(
    ledger: &Ledger,
    inputs: &[&CommBuf],
    index: usize,
    op: ReduceOp,
) -> CommBuf {
    let len = inputs.first().map_or(0, |b| b.len());
    let (start, end) = even_range(len, inputs.len(), index);
    let held = ledger.hold(Category::Communication, 4 * (end - start));
    let mut share = sum_range(inputs, start, end - start);
    if op == ReduceOp::Mean {
        let n = inputs.len() as f32;
        share.iter_mut().for_each(|x| *x /= n);
    }
    drop(held);
    CommBuf::F32(ledger.from_vec(Category::Communication, share))
}

/// All-reduce, second half: the members' f32 shares concatenated and rounded to `dtype`.
pub(crate) fn all_reduce_assemble(ledger: &Ledger, dtype: DType, shares: &[&CommBuf]) -> CommBuf {
    let total: usize = shares.iter().map(|b| b.len()).sum();
    let held = ledger.hold(Category::Communication, 4 * total);
    let mut out = vec![0.0f32; total];
    let mut at = 0;
    for s in shares {
        s.read_into(0, &mut out[at..at + s.len()]);
        at += s.len();
    }
    drop(held);
    Builder { ledger, dtype }.rounded(out)
}

/// Reduce-scatter: member `index` gets the sum of its `counts[index]` elements.
pub(crate) fn reduce_scatter(
    ledger: &Ledger,
    dtype: DType,
    inputs: &[&CommBuf],
    counts: &[usize],
    index: usize,
) -> CommBuf {
    let start: usize = counts[..index].iter().sum();
    let held = ledger.hold(Category::Communication, 4 * counts[index]);
    let sum = sum_range(inputs, start, counts[index]);
    drop(held);
    Builder { ledger, dtype }.rounded(sum)
}

/// All-gather: every member's input, concatenated in group order.
pub(crate) fn all_gather(ledger: &Ledger, dtype: DType, inputs: &[&CommBuf]) -> CommBuf {
    let parts: Vec<_> = inputs.iter().map(|&b| (b, 0, b.len())).collect();
    Builder { ledger, dtype }.concat(&parts)
}

/// Broadcast: a copy of the root's buffer.
pub(crate) fn broadcast(
    ledger: &Ledger,
    dtype: DType,
    inputs: &[&CommBuf],
    root: usize,
) -> CommBuf {
    let b = inputs[root];
    Builder { ledger, dtype }.concat(&[(b, 0, b.len())])
}

/// All-to-all: from each member `j`, the `send_counts_j[index]` elements it addressed to
/// member `index`, concatenated in group order. `send_counts[j]` is member `j`'s vector.
pub(crate) fn all_to_all(
    ledger: &Ledger,
    dtype: DType,
    inputs: &[&CommBuf],
    send_counts: &[&[usize]],
    index: usize,
) -> CommBuf {
    let parts: Vec<_> = inputs
        .iter()
        .zip(send_counts)
        .map(|(&b, counts)| {
            let start: usize = counts[..index].iter().sum();
            (b, start, start + counts[index])
        })
        .collect();
    Builder { ledger, dtype }.concat(&parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_ranges_cover_everything() {
        let ranges: Vec<_> = (0..3).map(|i| even_range(10, 3, i)).collect();
        assert_eq!(ranges, vec![(0, 3), (3, 6), (6, 10)]);
        assert_eq!(even_range(2, 4, 0), (0, 0));
        assert_eq!(even_range(2, 4, 3), (1, 2));
    }

    #[test]
    fn sums_in_group_order() {
        let ledger = Ledger::new();
        // 1e8 + 1 - 1e8 in f32: (1e8 + 1) rounds to 1e8, so the order shows in the result.
        let a = CommBuf::from_f32_slice(&ledger, &[1e8, 2.0]);
        let b = CommBuf::from_f32_slice(&ledger, &[1.0, 3.0]);
        let c = CommBuf::from_f32_slice(&ledger, &[-1e8, 4.0]);
        assert_eq!(sum_range(&[&a, &b, &c], 0, 2), vec![0.0, 9.0]);
        assert_eq!(sum_range(&[&a, &c, &b], 0, 2), vec![1.0, 9.0]);
        assert_eq!(sum_range(&[&b, &c], 1, 1), vec![7.0]);
    }
}
