//! Muon's step on one rank (`train.optimizer = "muon"`), for the blocks' projection matrices
//! ([`ferrotron_model::ParamLayout::muon_matrices`]); AdamW steps the rest (`optim.rs`).
//!
//! Per matrix: `m ← β·m + (1 − β)·g` (the gradient already clipped with every other),
//! the update `(1 − β)·g + β·m` (Nesterov) or `m`, orthogonalised by the quintic
//! Newton–Schulz iteration, scaled by the matrix's shape (`train.muon.scale`), then
//! `w ← w·(1 − lr·wd) − lr·scale·O`, with `lr` this step's rate times `muon.lr / train.lr`.
//! The momentum lives in the first-moment buffer; the second stays zero for these elements.
//!
//! Each matrix is orthogonalised whole, by every rank holding part of it:
//! - under ZeRO, the updates of a bucket's pieces are all-gathered over the bucket's group
//!   (data × context parallel, or expert-data for experts), in f32;
//! - under tensor parallelism, each split matrix's slices are all-gathered over the TP group.
//!
//! Every such rank then runs the same iteration on the same bits and keeps its own part.
//! The iteration's FLOPs ([`ferrotron_tensor::muon::newton_schulz_flops`]) are thus spent
//! once per rank holding the matrix — the replication of the iteration, not of the
//! weights — in exchange for no second communication round back from an owner.

use ferrotron_comm::{CommBuf, CommError};
use ferrotron_model::{ParamSpec, Split};
use ferrotron_parallel::data_parallel::{comm_f32, GroupComm};
use ferrotron_tensor::muon::{newton_schulz, MuonMomentum};
use ferrotron_tensor::{Buf, Category, Device, DeviceSlice};

use super::{master_part, overlap, Piece, RankGroups, StepHyper};
use crate::state::TrainState;

/// The label of Muon's all-gathers (ZeRO pieces and tensor-parallel slices).
pub const MUON_GATHER: &str = "muon all-gather";

/// Steps every Muon matrix (`matrices`, indices of the layout's parameters) inside this
/// rank's `pieces`, with gradients scaled by `clip`.
pub(crate) fn muon_pieces(
    state: &mut TrainState,
    (pieces, matrices): (&[Piece], &[usize]),
    groups: RankGroups<'_>,
    dev: Device<'_>,
    hyper: StepHyper<'_>,
    clip: f32,
) -> Result<(), CommError> {
    let muon = &hyper.train.muon;
    let lr = hyper.lr * muon.lr / hyper.train.lr;
    for piece in pieces {
        let bucket = state.plan.buckets[piece.0].range.clone();
        let inside: Vec<usize> = matrices
            .iter()
            .copied()
            .filter(|&i| {
                let r = state.layout.params[i].range();
                bucket.start <= r.start && r.end <= bucket.end
            })
            .collect();
        if inside.is_empty() {
            continue;
        }
        let update = bucket_update(state, piece, &inside, groups, dev, hyper, clip)?;
        for &i in &inside {
            let spec = state.layout.params[i].clone();
            let slice = &update[spec.range().start - bucket.start..spec.range().end - bucket.start];
            let (rows, cols) = (spec.full_shape[0], spec.full_shape[1]);
            let tp = groups.tp.filter(|_| spec.split != Split::Replicated);
            let mut whole = whole_matrix(&spec, slice, tp, dev)?;
            newton_schulz(dev, &mut whole, rows, cols, muon.ns_steps);
            let mut mine = own_slice(&spec, whole, tp, dev);
            let step = Step {
                lr,
                scale: muon.shape_scale(rows, cols),
                decay: 1.0 - lr * muon.weight_decay,
            };
            apply(state, (&spec, piece), &mut mine, dev, step);
        }
    }
    Ok(())
}

/// Bucket `piece.0`'s Muon updates in full: the momentum of this rank's piece (other
/// elements zero), all-gathered over the bucket's group when ZeRO shards it.
fn bucket_update(
    state: &mut TrainState,
    piece: &Piece,
    inside: &[usize],
    groups: RankGroups<'_>,
    dev: Device<'_>,
    hyper: StepHyper<'_>,
    clip: f32,
) -> Result<Buf<f32>, CommError> {
    let (k, range, at) = piece;
    let muon = &hyper.train.muon;
    let momentum = MuonMomentum {
        beta: muon.momentum as f32,
        nesterov: muon.nesterov,
    };
    let full_grads = !state.sharded_grads();
    let mut u = dev
        .ledger
        .zeros::<f32>(Category::Communication, range.len());
    let TrainState {
        layout, grads, m, ..
    } = state;
    for &i in inside {
        let Some((flat, local)) = overlap(&layout.params[i], range, *at) else {
            continue;
        };
        let g = grads.optimizer_view(dev, if full_grads { flat } else { local.clone() });
        let out = &mut u[local.start - at..local.end - at];
        dev.backend
            .muon_momentum(out, &mut m[local], &g, clip, momentum);
    }
    let group = groups
        .reduce()
        .of(&state.plan, *k)
        .filter(|_| state.plan.sharded);
    let Some(dp) = group else {
        return Ok(u);
    };
    let h = dp
        .comm
        .all_gather(&dp.group, CommBuf::F32(u), state.plan.counts(*k));
    match dp.comm.wait(h, MUON_GATHER)? {
        CommBuf::F32(full) => Ok(full),
        CommBuf::Bf16(_) => unreachable!("an f32 all-gather returns f32"),
    }
}

/// The whole `[rows, cols]` matrix of `spec` from this rank's `slice`: a copy, or under
/// tensor parallelism (`tp`) its slices all-gathered and put in place.
fn whole_matrix(
    spec: &ParamSpec,
    slice: &DeviceSlice<f32>,
    tp: Option<&GroupComm>,
    dev: Device<'_>,
) -> Result<Buf<f32>, CommError> {
    let (rows, cols) = (spec.full_shape[0], spec.full_shape[1]);
    let mut out = dev.ledger.zeros::<f32>(Category::Workspace, rows * cols);
    let Some(tp) = tp else {
        dev.backend.copy(&mut out, slice);
        return Ok(out);
    };
    let t = tp.group.size();
    let h = tp
        .comm
        .all_gather(&tp.group, comm_f32(dev, slice), vec![slice.len(); t]);
    let CommBuf::F32(all) = tp.comm.wait(h, MUON_GATHER)? else {
        unreachable!("an f32 all-gather returns f32")
    };
    match spec.split {
        Split::Cols => {
            // Rank r's slice is `[rows, cols/t]`: its row i goes to columns r·c.. of row i.
            let c = cols / t;
            for r in 0..t {
                for i in 0..rows {
                    let from = r * rows * c + i * c;
                    let to = i * cols + r * c;
                    dev.backend.copy(&mut out[to..to + c], &all[from..from + c]);
                }
            }
        }
        _ => dev.backend.copy(&mut out, &all),
    }
    Ok(out)
}

/// This rank's tensor-parallel slice of the whole orthogonalised matrix.
fn own_slice(
    spec: &ParamSpec,
    whole: Buf<f32>,
    tp: Option<&GroupComm>,
    dev: Device<'_>,
) -> Buf<f32> {
    let Some(tp) = tp else {
        return whole;
    };
    let (t, r) = (tp.group.size(), tp.group.index);
    let n = spec.numel();
    let mut out = dev.ledger.zeros::<f32>(Category::Workspace, n);
    match spec.split {
        Split::Cols => {
            let (rows, cols) = (spec.full_shape[0], spec.full_shape[1]);
            let c = cols / t;
            for i in 0..rows {
                let from = i * cols + r * c;
                dev.backend
                    .copy(&mut out[i * c..(i + 1) * c], &whole[from..from + c]);
            }
        }
        _ => dev.backend.copy(&mut out, &whole[r * n..(r + 1) * n]),
    }
    out
}

/// One matrix's step: learning rate, shape scale and decay factor `1 − lr·wd`.
#[derive(Clone, Copy)]
struct Step {
    lr: f64,
    scale: f64,
    decay: f64,
}

/// `w ← w·decay − lr·scale·O` on the part of `spec` inside this rank's piece (the fp32
/// master in mixed precision); `o` is this rank's tensor-parallel slice of O.
fn apply(
    state: &mut TrainState,
    (spec, piece): (&ParamSpec, &Piece),
    o: &mut DeviceSlice<f32>,
    dev: Device<'_>,
    step: Step,
) {
    let (_, range, at) = piece;
    let Some((flat, local)) = overlap(spec, range, *at) else {
        return;
    };
    let full_weights = !state.sharded_weights();
    let o = &mut o[flat.start - spec.offset..flat.end - spec.offset];
    let param = master_part(
        state.master.as_mut(),
        &mut state.weights,
        full_weights,
        (flat, local),
    );
    if step.decay != 1.0 {
        dev.backend.scale(param, step.decay as f32);
    }
    dev.backend.scale(o, (-step.lr * step.scale) as f32);
    dev.backend.add_assign(param, o);
}
