//! The optimizer step of one rank: global-norm clipping over the gradient shards of every
//! rank, AdamW on the pieces this rank owns (fp32 master weights) — with
//! `train.optimizer = "muon"`, Muon on the blocks' matrices among them (`optim/muon.rs`) and AdamW
//! on the rest — then, under ZeRO-1/2, the updated weights all-gathered so every rank holds
//! the full model again.

use ferrotron_comm::{CommBuf, CommError, ReduceOp};
use ferrotron_config::{Optimizer, TrainConfig};
use ferrotron_model::Split;
use ferrotron_tensor::adamw::AdamW;
use ferrotron_tensor::{Backend, Buf, Category, Device, DeviceSlice, Ledger, Store};

use crate::state::TrainState;

mod muon;

use ferrotron_parallel::data_parallel::{
    comm_f32, comm_of_store, write_store, GroupComm, ReduceGroups,
};
use ferrotron_parallel::zero;
pub use ferrotron_parallel::RankGroups;
pub use muon::MUON_GATHER;

/// A piece of this rank's ZeRO shard: (bucket, flat range, offset in the shard).
type Piece = (usize, std::ops::Range<usize>, usize);

/// Flat or local index range of this rank's piece `(range, at)` in a buffer that is full
/// (`full = true`) or a shard.
fn place(range: &std::ops::Range<usize>, at: usize, full: bool) -> std::ops::Range<usize> {
    if full {
        range.clone()
    } else {
        at..at + range.len()
    }
}

/// Sum of `x` over the data-parallel group, carried as an f32 pair so the f64 survives.
///
/// The scalar is a host value (a loss or a squared norm a kernel returned): it goes to the
/// device and back as transfers counted under `what`.
pub fn all_reduce_f64(
    dp: &GroupComm,
    ledger: &Ledger,
    x: f64,
    what: &'static str,
) -> Result<f64, CommError> {
    let hi = x as f32;
    let lo = (x - hi as f64) as f32;
    let pair = ledger.upload(Category::Communication, what, &[hi, lo]);
    let handle = dp
        .comm
        .all_reduce(&dp.group, CommBuf::F32(pair), ReduceOp::Sum);
    let out = dp.comm.wait(handle, what)?;
    match out {
        CommBuf::F32(b) => {
            let b = ledger.download(what, &b);
            Ok(b[0] as f64 + b[1] as f64)
        }
        CommBuf::Bf16(_) => unreachable!("an f32 reduction returns f32"),
    }
}

/// The label of the transfers that carry the gradient norm's pieces.
pub const GRAD_NORM: &str = "grad norm";

/// The label of the transfers that bring weights and optimizer states to the host to be
/// saved or evaluated.
pub const CHECKPOINT: &str = "checkpoint";

/// What one optimizer step applies: the hyper-parameters, this step's learning rate and its
/// 1-based number (Adam's bias correction).
#[derive(Clone, Copy)]
pub struct StepHyper<'a> {
    /// The training section (betas, eps, weight decay, clipping).
    pub train: &'a TrainConfig,
    /// Learning rate of this step.
    pub lr: f64,
    /// 1-based step number.
    pub step: u64,
    /// What the gradients are multiplied by before clipping: `1 / loss scale` under fp16,
    /// else 1.
    pub unscale: f64,
}

/// Unscales (fp16), clips, steps AdamW on this rank's pieces, refreshes weights, zeroes
/// gradients. Returns the global norm of the unscaled gradients before clipping; when it is
/// not finite, nothing is applied and the weights and gradients stay as they are (every
/// rank sees the same reduced norm).
pub fn optimizer_step(
    state: &mut TrainState,
    groups: RankGroups<'_>,
    ledger: &Ledger,
    backend: &dyn Backend,
    hyper: StepHyper<'_>,
) -> Result<f64, CommError> {
    let pieces = state.plan.pieces(state.dp_rank);
    let norm =
        global_grad_norm(state, groups, Device { ledger, backend }, &pieces)? * hyper.unscale;
    if !norm.is_finite() {
        // Every rank holds the same reduced norm: every rank leaves its weights as they are.
        return Ok(norm);
    }
    let clip = hyper.train.grad_clip;
    let clip_factor = if clip > 0.0 && norm > clip {
        clip / (norm + 1e-6)
    } else {
        1.0
    };
    // The gradients' one multiplier: the clipping factor, and the loss scale undone.
    let scale = (clip_factor * hyper.unscale) as f32;
    // Which parameters Muon steps (none under AdamW); AdamW steps the rest.
    let matrices = match hyper.train.optimizer {
        Optimizer::Muon => state.layout.muon_matrices(),
        Optimizer::AdamW => Vec::new(),
    };
    let mut muon = vec![false; state.layout.params.len()];
    matrices.iter().for_each(|&i| muon[i] = true);
    adamw_pieces(
        state,
        (&pieces, &muon),
        Device { ledger, backend },
        hyper,
        scale,
    );
    if !matrices.is_empty() {
        let dev = Device { ledger, backend };
        muon::muon_pieces(state, (&pieces, &matrices), groups, dev, hyper, scale)?;
    }
    let full_weights = !state.sharded_weights();
    let TrainState {
        weights, master, ..
    } = state;
    if let Some(master) = master {
        for (_, range, at) in &pieces {
            weights.write(
                backend,
                place(range, *at, full_weights),
                &master[*at..*at + range.len()],
            );
        }
    }
    let dev = Device { ledger, backend };
    if state.plan.sharded && full_weights {
        let reduce = groups.reduce();
        zero::gather_updated_weights(&mut state.weights, &state.plan, &pieces, reduce, dev)?;
    }
    state.grads.zero(dev);
    Ok(norm)
}

/// The global gradient norm: squared norms of this rank's pieces, summed over every group
/// that holds distinct shards. Tensor-parallel shards add over the TP group; replicated
/// parameters (norm weights) are the same on every TP rank and count once. Experts are
/// replicated over TP too, and each is held by exactly one member of the expert-parallel
/// group; pipeline stages hold disjoint parameters.
fn global_grad_norm(
    state: &TrainState,
    groups: RankGroups<'_>,
    dev: Device<'_>,
    pieces: &[(usize, std::ops::Range<usize>, usize)],
) -> Result<f64, CommError> {
    let full_grads = !state.sharded_grads();
    // Each parameter's part of the pieces, and whether it is split (0), replicated (1) or an
    // expert's (2); their squared norms come back together, in one transfer.
    let mut parts: Vec<(std::ops::Range<usize>, usize)> = Vec::new();
    for (k, range, at) in pieces {
        let experts = state.plan.buckets[*k].experts;
        for spec in &state.layout.params {
            let Some((flat, local)) = overlap(spec, range, *at) else {
                continue;
            };
            let class = match spec.split {
                _ if experts => 2,
                Split::Replicated => 1,
                _ => 0,
            };
            parts.push((if full_grads { flat } else { local }, class));
        }
    }
    let ranges: Vec<_> = parts.iter().map(|(r, _)| r.clone()).collect();
    let grads = state.grads.optimizer_operand();
    let squares = dev.backend.sum_squares_ranges(dev.ledger, grads, &ranges);
    let mut by_class = [0.0f64; 3];
    for ((_, class), sq) in parts.iter().zip(squares) {
        by_class[*class] += sq;
    }
    let [mut sq_split, mut sq_replicated, mut sq_experts] = by_class;
    let sum = |g: Option<&GroupComm>, x: f64| match g {
        Some(g) => all_reduce_f64(g, dev.ledger, x, GRAD_NORM),
        None => Ok(x),
    };
    let sharded = state.plan.sharded;
    if sharded {
        sq_split = sum(groups.dp, sq_split)?;
        sq_replicated = sum(groups.dp, sq_replicated)?;
    }
    // A dense model has no expert buckets and issues no collective for them.
    if state.plan.buckets.iter().any(|b| b.experts) {
        if sharded {
            sq_experts = sum(groups.edp, sq_experts)?;
        }
        sq_experts = sum(groups.ep, sq_experts)?;
    }
    sq_split = sum(groups.tp, sq_split)?;
    let sq = sum(groups.pp, sq_split + sq_replicated + sq_experts)?;
    Ok(sq.sqrt())
}

/// The part of parameter `spec` inside this rank's piece `range` (stored at `at` of the
/// shard): its (flat, local) index ranges, if any.
pub(crate) fn overlap(
    spec: &ferrotron_model::ParamSpec,
    range: &std::ops::Range<usize>,
    at: usize,
) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let (lo, hi) = (
        spec.offset.max(range.start),
        (spec.offset + spec.numel()).min(range.end),
    );
    (lo < hi).then(|| (lo..hi, at + (lo - range.start)..at + (hi - range.start)))
}

/// The parts of the parameters inside this rank's piece `range` (stored at `at`) that AdamW
/// steps (all but those `muon` marks), as (flat, local, decayed) ranges, neighbours with the
/// same weight decay joined: AdamW is element by element, so one call over a run gives the
/// bits of one call per parameter, with fewer parallel regions (tiny's 39 tensors make 19
/// runs).
fn decay_runs(
    layout: &ferrotron_model::ParamLayout,
    range: &std::ops::Range<usize>,
    at: usize,
    muon: &[bool],
) -> Vec<(std::ops::Range<usize>, std::ops::Range<usize>, bool)> {
    let mut runs: Vec<(std::ops::Range<usize>, std::ops::Range<usize>, bool)> = Vec::new();
    for (spec, _) in layout.params.iter().zip(muon).filter(|(_, m)| !**m) {
        let Some((flat, local)) = overlap(spec, range, at) else {
            continue;
        };
        match runs.last_mut() {
            Some((f, l, d)) if *d == spec.decay && f.end == flat.start && l.end == local.start => {
                (f.end, l.end) = (flat.end, local.end);
            }
            _ => runs.push((flat, local, spec.decay)),
        }
    }
    runs
}

/// The fp32 values a step updates of the part of a parameter at `flat` (stored at `local`
/// of the shard): the master in mixed precision, else the f32 weights (full or sharded).
fn master_part<'a>(
    master: Option<&'a mut Buf<f32>>,
    weights: &'a mut Store,
    full_weights: bool,
    (flat, local): (std::ops::Range<usize>, std::ops::Range<usize>),
) -> &'a mut DeviceSlice<f32> {
    if let Some(master) = master {
        return &mut master[local];
    }
    match weights {
        Store::F32(w) => &mut w[if full_weights { flat } else { local }],
        Store::Bf16(_) | Store::F16(_) => unreachable!("half weights always have an fp32 master"),
    }
}

/// AdamW on every parameter's part of this rank's pieces except those `muon` marks (fp32
/// master weights in mixed precision), with the gradients multiplied by the clipping `scale`.
fn adamw_pieces(
    state: &mut TrainState,
    (pieces, muon): (&[Piece], &[bool]),
    dev: Device<'_>,
    hyper: StepHyper<'_>,
    scale: f32,
) {
    let (full_grads, full_weights) = (!state.sharded_grads(), !state.sharded_weights());
    let TrainState {
        layout,
        weights,
        master,
        grads,
        m,
        v,
        ..
    } = state;
    let t = hyper.train;
    for (_, range, at) in pieces {
        for (flat, local, decay) in decay_runs(layout, range, *at, muon) {
            let part = (flat.clone(), local.clone());
            let param = master_part(master.as_mut(), weights, full_weights, part);
            let adam = AdamW {
                lr: hyper.lr as f32,
                beta1: t.beta1 as f32,
                beta2: t.beta2 as f32,
                eps: t.eps as f32,
                weight_decay: if decay { t.weight_decay as f32 } else { 0.0 },
                step: hyper.step,
            };
            let g = grads.optimizer_view(dev, if full_grads { flat } else { local.clone() });
            let (m, v) = (&mut m[local.clone()], &mut v[local]);
            dev.backend.adamw(param, &g, m, v, scale, adam);
        }
    }
}

/// The full fp32 values of every parameter (master in mixed precision), gathered from the
/// shards when sharded, brought to the host (transfers counted as [`CHECKPOINT`]).
/// Collective over the data-parallel group when sharded.
pub fn full_master(
    state: &TrainState,
    groups: ReduceGroups<'_>,
    dev: Device<'_>,
) -> Result<Vec<f32>, CommError> {
    if state.master.is_none() && !state.sharded_weights() {
        // f32 below ZeRO-3: the weights are the master and every rank holds all of them.
        return Ok(dev
            .ledger
            .download(CHECKPOINT, &state.weights.view_all(dev)));
    }
    let be = dev.backend;
    let mut out = dev
        .ledger
        .zeros::<f32>(Category::Workspace, state.layout.total);
    let mine = |range: &std::ops::Range<usize>, at: usize| match &state.master {
        Some(m) => comm_f32(dev, &m[at..at + range.len()]),
        None => comm_f32(dev, &state.weights.view(dev, at..at + range.len())),
    };
    zero::gather_buckets(&state.plan, state.dp_rank, groups, mine, |start, full| {
        write_f32(be, &mut out, start, full)
    })?;
    Ok(dev.ledger.download(CHECKPOINT, &out))
}

/// Copies an f32 communication buffer into `out` at `at`.
fn write_f32(be: &dyn Backend, out: &mut DeviceSlice<f32>, at: usize, buf: &CommBuf) {
    if let CommBuf::F32(b) = buf {
        be.copy(&mut out[at..at + b.len()], b);
    }
}

/// The full weights in their storage dtype (gathered under ZeRO-3), e.g. to save a model.
pub fn full_weights(
    state: &TrainState,
    groups: ReduceGroups<'_>,
    dev: Device<'_>,
) -> Result<Store, CommError> {
    let n = state.layout.total;
    let mut out = Store::zeros(dev.ledger, Category::Workspace, state.weights.dtype(), n);
    let be = dev.backend;
    if !state.sharded_weights() {
        match (&mut out, &state.weights) {
            (Store::F32(d), Store::F32(s)) => be.copy(d, s),
            (Store::Bf16(d), Store::Bf16(s)) => be.copy_bf16(d, s),
            (out, s) => out.write(be, 0..n, &s.view_all(dev)),
        }
        return Ok(out);
    }
    let mine = |range: &std::ops::Range<usize>, at: usize| {
        comm_of_store(dev, &state.weights, at..at + range.len())
    };
    zero::gather_buckets(&state.plan, state.dp_rank, groups, mine, |start, full| {
        write_store(be, &mut out, start, full)
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs cover every element of a piece once, in order, each with its parameter's
    /// weight decay, and no two neighbours share it (they would have been joined): on the
    /// whole buffer and on a piece cut inside parameters at both ends.
    #[test]
    fn decay_runs_cover_a_piece_once_and_join_neighbours() {
        let layout = ferrotron_model::ParamLayout::new(&ferrotron_config::ModelConfig::default());
        let n = layout.total;
        let adamw = vec![false; layout.params.len()];
        for (range, at) in [(0..n, 0), (100..n - 77, 5)] {
            let runs = decay_runs(&layout, &range, at, &adamw);
            let mut next = range.start;
            for (i, (flat, local, decay)) in runs.iter().enumerate() {
                assert_eq!(flat.start, next, "runs are contiguous");
                assert_eq!(local.start, at + flat.start - range.start);
                assert_eq!(local.len(), flat.len());
                next = flat.end;
                for spec in &layout.params {
                    let (lo, hi) = (spec.offset, spec.offset + spec.numel());
                    if lo < flat.end && flat.start < hi {
                        assert_eq!(
                            spec.decay, *decay,
                            "{} in a run of decay {decay}",
                            spec.name
                        );
                    }
                }
                if i > 0 {
                    assert_ne!(
                        runs[i - 1].2,
                        *decay,
                        "neighbours of equal decay not joined"
                    );
                }
            }
            assert_eq!(next, range.end, "the piece is covered");
            assert!(runs.len() < layout.params.len(), "{} runs", runs.len());
        }
    }
}
