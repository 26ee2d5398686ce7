//! Grouping (token, slot) assignments by expert, and the gather / combine that move rows in
//! and out of that grouping.

use std::ops::Range;

use rayon::prelude::*;

use super::{rows_per_task, Routing};

/// The grouped row of an assignment its expert dropped ([`Dispatch::with_capacity`]): it is
/// in no grouped buffer and adds nothing to its token's output.
pub const DROPPED: usize = usize::MAX;

/// Where every (token, slot) assignment of a [`Routing`] goes: the `t·k` assignments (those
/// kept, under a capacity) sorted by expert (ascending), then token (ascending), then slot.
/// Expert `e` owns the contiguous rows `offsets[e]..offsets[e + 1]` of every grouped buffer;
/// `counts` is what an all-to-all sends per expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    top_k: usize,
    counts: Vec<usize>,
    offsets: Vec<usize>,
    /// Token of every grouped row.
    token: Vec<usize>,
    /// Slot of every grouped row.
    slot: Vec<usize>,
    /// Grouped row of every (token, slot), `[t, k]`: the inverse of `token`/`slot`.
    row: Vec<usize>,
}

impl Dispatch {
    /// Bytes of its index tables on the heap.
    pub fn heap_bytes(&self) -> usize {
        let n = self.counts.len() + self.offsets.len() + self.token.len();
        (n + self.slot.len() + self.row.len()) * std::mem::size_of::<usize>()
    }

    /// The plan for `routing` of `t` tokens over `experts` experts with `top_k` slots each.
    pub fn new(routing: &Routing, t: usize, experts: usize, top_k: usize) -> Dispatch {
        Self::with_capacity(routing, (t, experts, top_k), None)
    }

    /// [`Dispatch::new`] with at most `capacity` assignments per expert: an expert routed more
    /// keeps the `capacity` of highest router probability (ties to the earlier token, then
    /// slot: Megatron's "probs" drop policy) and drops the rest, whose row is [`DROPPED`].
    /// `None`: dropless.
    pub fn with_capacity(
        routing: &Routing,
        (t, experts, top_k): (usize, usize, usize),
        capacity: Option<usize>,
    ) -> Dispatch {
        assert_eq!(routing.ids.len(), t * top_k, "routing is not [t, k]");
        if let Some(e) = routing.ids.iter().find(|e| **e >= experts) {
            panic!("expert id {e} out of range (E = {experts})");
        }
        let keep = kept(routing, (experts, top_k), capacity);
        let mut counts = vec![0usize; experts];
        for (&e, _) in routing.ids.iter().zip(&keep).filter(|(_, k)| **k) {
            counts[e] += 1;
        }
        let mut offsets = Vec::with_capacity(experts + 1);
        offsets.push(0);
        for &c in &counts {
            offsets.push(offsets.last().unwrap() + c);
        }
        // Counting sort: visiting assignments in (token, slot) order keeps each expert's rows
        // sorted by token, which makes the plan independent of thread scheduling.
        let mut next = offsets[..experts].to_vec();
        let n = offsets[experts];
        let (mut token, mut slot, mut row) = (vec![0; n], vec![0; n], vec![DROPPED; t * top_k]);
        for (a, &e) in routing.ids.iter().enumerate().filter(|(a, _)| keep[*a]) {
            let r = next[e];
            next[e] += 1;
            token[r] = a / top_k;
            slot[r] = a % top_k;
            row[a] = r;
        }
        Dispatch {
            top_k,
            counts,
            offsets,
            token,
            slot,
            row,
        }
    }

    /// Assignments dropped over capacity.
    pub fn dropped(&self) -> usize {
        self.row.len() - self.token.len()
    }

    /// Tokens routed (`t`).
    pub fn routed_tokens(&self) -> usize {
        self.row.len() / self.top_k
    }

    /// A reordering of a table's rows as one group: [`gather_rows`] with it writes row
    /// `order[r]` of its source to row `r` (Ulysses' exchanges between sequence and head
    /// shards use it).
    ///
    /// # Panics
    ///
    /// When `order` is not a permutation of `0..order.len()`.
    pub fn permutation(order: Vec<usize>) -> Dispatch {
        let n = order.len();
        let mut row = vec![usize::MAX; n];
        for (r, &src) in order.iter().enumerate() {
            assert!(
                src < n && row[src] == usize::MAX,
                "not a permutation of 0..{n}"
            );
            row[src] = r;
        }
        Dispatch {
            top_k: 1,
            counts: vec![n],
            offsets: vec![0, n],
            token: order,
            slot: vec![0; n],
            row,
        }
    }

    /// A grouping of `t` tokens' `k` slots each: `row[token·k + slot]` is the slot's row of
    /// the grouped table. [`gather_rows`] with it copies each token's row to its `k` slots,
    /// [`scatter_add_rows`] sums each token's `k` slots back (Ulysses deals a key/value head
    /// to the `k` ranks that share it so, and sums their gradients).
    ///
    /// # Panics
    ///
    /// When `row` is not a permutation of `0..row.len()`, or `k` does not divide its length.
    pub fn from_rows(row: Vec<usize>, k: usize) -> Dispatch {
        let n = row.len();
        assert!(
            k > 0 && n.is_multiple_of(k),
            "{n} slots are not tokens of {k}"
        );
        let (mut token, mut slot) = (vec![usize::MAX; n], vec![0; n]);
        for (a, &r) in row.iter().enumerate() {
            assert!(
                r < n && token[r] == usize::MAX,
                "not a permutation of 0..{n}"
            );
            (token[r], slot[r]) = (a / k, a % k);
        }
        Dispatch {
            top_k: k,
            counts: vec![n],
            offsets: vec![0, n],
            token,
            slot,
            row,
        }
    }

    /// Slots per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The token of every grouped row, `[t·k]`: the table a device gather kernel reads.
    pub fn token_table(&self) -> &[usize] {
        &self.token
    }

    /// The grouped row of every (token, slot), `[t·k]`: the table a device combine or
    /// scatter kernel reads.
    pub fn row_table(&self) -> &[usize] {
        &self.row
    }

    /// Number of assignments (grouped rows) per expert, `[E]`.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// Start of every expert's block of grouped rows, `[E + 1]`; the last entry is
    /// [`Dispatch::len`] (`t·k` when dropless).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// The grouped rows of expert `e`.
    pub fn rows(&self, e: usize) -> Range<usize> {
        self.offsets[e]..self.offsets[e + 1]
    }

    /// Token of every grouped row, `[t·k]`.
    pub fn tokens(&self) -> &[usize] {
        &self.token
    }

    /// The (token, slot) assignment held by grouped row `r`.
    pub fn assignment(&self, r: usize) -> (usize, usize) {
        (self.token[r], self.slot[r])
    }

    /// The grouped row holding the assignment of `token`'s slot `slot` ([`DROPPED`] if
    /// dropped).
    pub fn row(&self, token: usize, slot: usize) -> usize {
        self.row[token * self.top_k + slot]
    }

    /// Total number of grouped rows: `t·k` less the assignments dropped.
    pub fn len(&self) -> usize {
        self.token.len()
    }

    /// Whether there are no assignments (no tokens).
    pub fn is_empty(&self) -> bool {
        self.token.is_empty()
    }
}

/// Which assignments of `routing` their experts keep under `capacity` (all when None).
fn kept(routing: &Routing, (experts, top_k): (usize, usize), capacity: Option<usize>) -> Vec<bool> {
    let mut keep = vec![true; routing.ids.len()];
    let Some(cap) = capacity else {
        return keep;
    };
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts];
    for (a, &e) in routing.ids.iter().enumerate() {
        by_expert[e].push(a);
    }
    for (e, list) in by_expert.iter_mut().enumerate() {
        if list.len() <= cap {
            continue;
        }
        let p = |a: usize| routing.probs[(a / top_k) * experts + e];
        list.sort_by(|&x, &y| p(y).total_cmp(&p(x)).then(x.cmp(&y)));
        list[cap..].iter().for_each(|&a| keep[a] = false);
    }
    keep
}

/// Copies each assignment's token row of `src` (`[t, h]`) into `dst` (`[t·k, h]`, overwritten)
/// in grouped order.
pub fn gather_rows(dst: &mut [f32], src: &[f32], h: usize, dispatch: &Dispatch) {
    assert_eq!(
        dst.len(),
        dispatch.len() * h,
        "dst must be [grouped rows, h]"
    );
    dst.par_chunks_mut(h)
        .zip(dispatch.token.par_iter())
        .with_min_len(rows_per_task(h))
        .for_each(|(d, &tok)| d.copy_from_slice(&src[tok * h..(tok + 1) * h]));
}

/// The adjoint of [`gather_rows`]: adds every grouped row of `src` (`[t·k, h]`) to the row of
/// its token in `dst` (`[t, h]`, accumulated), summing over the token's `k` slots.
pub fn scatter_add_rows(dst: &mut [f32], src: &[f32], h: usize, dispatch: &Dispatch) {
    let k = dispatch.top_k;
    assert_eq!(
        src.len(),
        dispatch.len() * h,
        "src must be [grouped rows, h]"
    );
    assert_eq!(
        dst.len(),
        dispatch.routed_tokens() * h,
        "dst must be [t, h]"
    );
    // Parallel over tokens, each reading its k rows, so no two tasks write the same row.
    dst.par_chunks_mut(h)
        .zip(dispatch.row.par_chunks(k))
        .with_min_len(rows_per_task(h * k))
        .for_each(|(d, rows)| {
            for &r in rows.iter().filter(|r| **r != DROPPED) {
                for (d, s) in d.iter_mut().zip(&src[r * h..(r + 1) * h]) {
                    *d += s;
                }
            }
        });
}

/// `out[token] = Σ_slot gate[token, slot] · expert_out[row(token, slot)]`, with `out` `[t, h]`
/// (overwritten) and `expert_out` the experts' outputs in grouped order, `[t·k, h]`.
pub fn combine_forward(
    out: &mut [f32],
    expert_out: &[f32],
    h: usize,
    routing: &Routing,
    dispatch: &Dispatch,
) {
    let k = dispatch.top_k;
    assert_eq!(
        expert_out.len(),
        dispatch.len() * h,
        "expert_out must be [grouped rows, h]"
    );
    assert_eq!(
        out.len(),
        dispatch.routed_tokens() * h,
        "out must be [t, h]"
    );
    assert_eq!(
        routing.gates.len(),
        dispatch.row.len(),
        "routing does not match the dispatch"
    );
    out.par_chunks_mut(h)
        .zip(dispatch.row.par_chunks(k))
        .zip(routing.gates.par_chunks(k))
        .with_min_len(rows_per_task(h * k))
        .for_each(|((o, rows), gates)| {
            o.fill(0.0);
            for (&r, &g) in rows.iter().zip(gates).filter(|(r, _)| **r != DROPPED) {
                for (o, y) in o.iter_mut().zip(&expert_out[r * h..(r + 1) * h]) {
                    *o += g * y;
                }
            }
        });
}

/// Backward of [`combine_forward`] given `d_out` (`[t, h]`): writes `d_expert_out[row] =
/// gate · d_out[token]` (`[t·k, h]`, grouped order) and `d_gates[token, slot] =
/// ⟨d_out[token], expert_out[row]⟩` (`[t, k]`), both overwritten.
pub fn combine_backward(
    d_expert_out: &mut [f32],
    d_gates: &mut [f32],
    d_out: &[f32],
    expert_out: &[f32],
    h: usize,
    routing: &Routing,
    dispatch: &Dispatch,
) {
    let k = dispatch.top_k;
    assert_eq!(
        expert_out.len(),
        dispatch.len() * h,
        "expert_out must be [grouped rows, h]"
    );
    assert_eq!(
        d_expert_out.len(),
        expert_out.len(),
        "d_expert_out must be [grouped rows, h]"
    );
    assert_eq!(d_gates.len(), dispatch.row.len(), "d_gates must be [t, k]");
    assert_eq!(
        d_out.len(),
        dispatch.routed_tokens() * h,
        "d_out must be [t, h]"
    );
    assert_eq!(
        routing.gates.len(),
        dispatch.row.len(),
        "routing does not match the dispatch"
    );
    d_expert_out
        .par_chunks_mut(h)
        .enumerate()
        .with_min_len(rows_per_task(h))
        .for_each(|(r, dy)| {
            let (tok, s) = dispatch.assignment(r);
            let g = routing.gates[tok * k + s];
            for (dy, d) in dy.iter_mut().zip(&d_out[tok * h..(tok + 1) * h]) {
                *dy = g * d;
            }
        });
    d_gates
        .par_chunks_mut(k)
        .zip(dispatch.row.par_chunks(k))
        .enumerate()
        .with_min_len(rows_per_task(h * k))
        .for_each(|(tok, (dg, rows))| {
            let d = &d_out[tok * h..(tok + 1) * h];
            for (dg, &r) in dg.iter_mut().zip(rows) {
                if r == DROPPED {
                    // The output does not depend on a dropped slot's gate.
                    *dg = 0.0;
                    continue;
                }
                *dg = d
                    .iter()
                    .zip(&expert_out[r * h..(r + 1) * h])
                    .map(|(a, b)| a * b)
                    .sum();
            }
        });
}
