//! The five schedules as pure functions of `(kind, p, m, v)`.

use crate::schedule::with_comms;
use crate::shape::check_shape;
use crate::{Action, Schedule, ScheduleError, ScheduleKind};

/// Builds the per-rank action lists of one step's pipeline.
///
/// `p` pipeline stages (ranks), `m` micro-batches per step, `v` model chunks per rank.
/// Refused up front: `p`, `m` or `v` of 0; `p·m·v` over [`crate::MAX_UNITS`]; `v > 1` except with
/// [`ScheduleKind::Interleaved`] and DualPipeV; interleaved with `v = 1` (use 1F1B) or with `m`
/// not a multiple of `p`; DualPipeV with `v ≠ 2` or `m < 2p`. Every `m ≥ 1` works for AFAB,
/// 1F1B and zero bubble, including `m < p`.
///
/// - **AFAB**: all forwards `0..m`, then all backwards `0..m`. With `p = 1` there is nothing
///   to fill, so it degenerates to plain gradient accumulation (forward, backward per
///   micro-batch) and holds one micro-batch, as the memory estimator assumes.
/// - **1F1B**: rank `r` runs `min(p−r−1, m)` warm-up forwards, then alternates one forward
///   and one backward, then drains the remaining backwards.
/// - **Interleaved** (Megatron): forwards walk the chunks in groups of `p` micro-batches
///   (`mb = (k / pv)·p + k mod p`, `chunk = (k / p) mod v`), backwards the same with the
///   chunks reversed; rank `r` warms up with `min(2(p−r−1) + (v−1)p, mv)` forwards, then
///   alternates. Unlike Megatron, `m = p` does not switch to all-forwards-first: the
///   simulated bubble is the same and later ranks hold fewer chunks.
/// - **Zero bubble** (ZB-H1): rank `r` warms up with `min(p−r−1, m)` forwards, then runs `r`
///   forward + `B` pairs whose `W` it defers, then forward + `B` + `W` triples, then `B` +
///   `W` pairs, then the `r` deferred `W`s, which fill the tail bubble. At most `p`
///   micro-batches are alive on any rank.
///
/// - **DualPipeV**: rank `r` holds stages `r` and `2p−1−r` (`v = 2`), and runs the eight
///   phases of `crate::dualpipev` (fill, forwards paired with the other chunk's backwards,
///   drain with split backwards whose `W`s fill the tail). Needs `m ≥ 2p`.
///
/// Every backward (and every `W`) of a chunk runs in ascending micro-batch order, so the
/// gradients accumulate in the same order as on a single rank.
pub fn schedule(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
) -> Result<Schedule, ScheduleError> {
    check_shape(kind, p, m, v)?;
    let ranks = (0..p)
        .map(|rank| {
            with_comms(
                kind.placement(),
                (p, v),
                rank,
                &compute(kind, p, m, v, rank),
            )
        })
        .collect();
    Ok(Schedule::new_unchecked(kind, p, m, v, ranks))
}

/// The compute actions (forwards and backwards, no sends or receives) of pipeline rank
/// `rank`, in the order [`schedule`] runs them: the same list, without building the other
/// ranks or the point-to-point actions (what the memory estimator replays).
pub fn compute_actions(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
    rank: usize,
) -> Result<Vec<Action>, ScheduleError> {
    check_shape(kind, p, m, v)?;
    if rank >= p {
        return Err(ScheduleError::RankOutOfRange { rank, p });
    }
    Ok(compute(kind, p, m, v, rank))
}

fn compute(kind: ScheduleKind, p: usize, m: usize, v: usize, rank: usize) -> Vec<Action> {
    match kind {
        ScheduleKind::Afab => afab(p, m),
        ScheduleKind::OneFOneB => one_f_one_b(p, m, rank),
        ScheduleKind::Interleaved => interleaved(p, m, v, rank),
        ScheduleKind::ZeroBubble => zero_bubble(p, m, rank),
        ScheduleKind::DualPipeV => crate::dualpipev::compute(p, m, rank),
    }
}

fn fwd(mb: usize, chunk: usize) -> Action {
    Action::Forward { mb, chunk }
}

fn bwd(mb: usize, chunk: usize) -> Action {
    Action::Backward { mb, chunk }
}

fn afab(p: usize, m: usize) -> Vec<Action> {
    if p == 1 {
        return (0..m).flat_map(|mb| [fwd(mb, 0), bwd(mb, 0)]).collect();
    }
    (0..m)
        .map(|mb| fwd(mb, 0))
        .chain((0..m).map(|mb| bwd(mb, 0)))
        .collect()
}

fn one_f_one_b(p: usize, m: usize, rank: usize) -> Vec<Action> {
    let warmup = (p - rank - 1).min(m);
    let mut out: Vec<Action> = (0..warmup).map(|mb| fwd(mb, 0)).collect();
    for k in 0..m - warmup {
        out.push(fwd(warmup + k, 0));
        out.push(bwd(k, 0));
    }
    out.extend((m - warmup..m).map(|mb| bwd(mb, 0)));
    out
}

fn interleaved(p: usize, m: usize, v: usize, rank: usize) -> Vec<Action> {
    let total = m * v;
    // The k-th forward (or backward) of the rank: micro-batches advance in groups of p,
    // each group visiting every chunk (reversed for backward).
    let locate = |k: usize| {
        let (group, idx) = (k / (p * v), k % (p * v));
        (group * p + idx % p, idx / p)
    };
    let f = |k: usize| {
        let (mb, chunk) = locate(k);
        fwd(mb, chunk)
    };
    let b = |k: usize| {
        let (mb, chunk) = locate(k);
        bwd(mb, v - 1 - chunk)
    };
    let warmup = (2 * (p - rank - 1) + (v - 1) * p).min(total);
    let mut out: Vec<Action> = (0..warmup).map(f).collect();
    for k in 0..total - warmup {
        out.push(f(warmup + k));
        out.push(b(k));
    }
    out.extend((total - warmup..total).map(b));
    out
}

fn zero_bubble(p: usize, m: usize, rank: usize) -> Vec<Action> {
    let b = |mb| Action::BackwardInput { mb, chunk: 0 };
    let w = |mb| Action::BackwardWeight { mb, chunk: 0 };
    let warmup = (p - rank - 1).min(m);
    let deferred = rank.min(m - warmup);
    let mut out: Vec<Action> = (0..warmup).map(|mb| fwd(mb, 0)).collect();
    let (mut nf, mut nb, mut nw) = (warmup, 0, 0);
    for _ in 0..deferred {
        out.extend([fwd(nf, 0), b(nb)]);
        nf += 1;
        nb += 1;
    }
    while nf < m {
        out.extend([fwd(nf, 0), b(nb), w(nw)]);
        (nf, nb, nw) = (nf + 1, nb + 1, nw + 1);
    }
    while nb < m {
        out.extend([b(nb), w(nw)]);
        (nb, nw) = (nb + 1, nw + 1);
    }
    out.extend((nw..m).map(w));
    out
}
