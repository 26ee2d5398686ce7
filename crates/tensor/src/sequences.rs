//! Attention over whole sequences through a [`Backend`](crate::Backend), plain causal or
//! document-masked: what a single rank runs, and what Ulysses runs on the heads it gathers.
//! Plain causal attention is the backend's flash attention; under document masking each
//! sequence is one ring block with positions `0..seq` on both sides and the queries'
//! document starts ([`KvBlock::q_start`]).

use crate::attention::{AttnSaved, AttnShape};
use crate::backend::{AttnGrads, Device, KvBlock, RingBlock};
use crate::{Category, DeviceSlice};

/// Queries, keys and values, in that order.
pub type Qkv<'a> = (
    &'a DeviceSlice<f32>,
    &'a DeviceSlice<f32>,
    &'a DeviceSlice<f32>,
);

/// Whole sequences of `sh` as one ring block with the document starts `starts`
/// (`[batch, seq]`), positions `pos = 0..seq`.
fn document_block<'p>(sh: AttnShape, pos: &'p [usize], starts: &'p [usize]) -> KvBlock<'p> {
    KvBlock {
        q_pos: pos,
        kv_pos: pos,
        q_start: Some(starts),
        shape: sh.block(),
    }
}

/// Forward: writes `out` and `lse` (`[batch, heads, seq]`); with `starts` (`[batch, seq]`)
/// each query sees only its own document's keys.
pub fn whole_forward(
    dev: Device<'_>,
    (out, lse): (&mut DeviceSlice<f32>, &mut DeviceSlice<f32>),
    (q, k, v): Qkv<'_>,
    sh: AttnShape,
    starts: Option<&[usize]>,
) {
    match starts {
        None => dev.backend.attention_forward(out, lse, q, k, v, sh),
        Some(starts) => {
            let pos: Vec<usize> = (0..sh.seq).collect();
            let block = document_block(sh, &pos, starts);
            dev.backend
                .attention_block_forward(out, lse, q, k, v, block);
        }
    }
}

/// Backward of [`whole_forward`]: overwrites the gradients from `dout`.
pub fn whole_backward(
    dev: Device<'_>,
    grads: AttnGrads<'_>,
    dout: &DeviceSlice<f32>,
    saved: AttnSaved<'_, DeviceSlice<f32>>,
    (sh, starts): (AttnShape, Option<&[usize]>),
) {
    let be = dev.backend;
    let mut delta = dev
        .ledger
        .zeros::<f32>(Category::Workspace, saved.lse.len());
    match starts {
        None => be.attention_backward(grads, &mut delta, dout, saved, sh),
        Some(starts) => {
            let pos: Vec<usize> = (0..sh.seq).collect();
            let block = document_block(sh, &pos, starts);
            be.attention_delta(&mut delta, dout, saved.out, block.shape);
            be.fill(grads.dq, 0.0);
            let ring = RingBlock {
                q: saved.q,
                k: saved.k,
                v: saved.v,
                lse: saved.lse,
                delta: &delta,
            };
            be.attention_block_backward(grads, dout, ring, block);
        }
    }
}
