//! Causal attention of this rank's queries, forward and backward: flash attention over whole
//! sequences, or the context-parallel strategy's ring ([`ContextParallel`]).

use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::{AttnGrads, Category, DeviceSlice, KvBlock, RingBlock};

use crate::ctx::BlockCall;
use crate::strategy::{AttnOut, ContextParallel, QkvGrads, RingSaved};
use crate::{HookError, Llama};

/// Local widths: (query width, key/value width, MLP width, query heads, kv heads).
pub(crate) fn widths(m: &Llama) -> (usize, usize, usize, usize, usize) {
    let c = &m.cfg;
    let t = m.layout.tp;
    let (heads, kv) = (c.heads / t, c.kv_heads / t);
    (
        heads * c.head_dim(),
        kv * c.head_dim(),
        c.ffn / t,
        heads,
        kv,
    )
}

impl Llama {
    fn attn_shape(&self, batch: usize) -> AttnShape {
        let (_, _, _, heads, kv_heads) = widths(self);
        AttnShape {
            batch,
            seq: self.cfg.seq_len,
            heads,
            kv_heads,
            head_dim: self.cfg.head_dim(),
        }
    }

    /// One ring step's shape: this rank's `n = seq_len/cp` queries against a block of as many
    /// keys, in each of `batch` sequences.
    fn ring_shape(&self, n: usize, batch: usize) -> BlockShape {
        let (_, _, _, heads, kv_heads) = widths(self);
        BlockShape {
            batch,
            q_len: n,
            kv_len: n,
            heads,
            kv_heads,
            head_dim: self.cfg.head_dim(),
        }
    }

    /// Causal attention of this rank's queries `q` over the keys `k` and values `v`: flash
    /// attention over whole sequences, or the ring over the context-parallel group; under
    /// document masking each query sees only its own document's keys.
    pub(crate) fn attention(
        &self,
        call: &BlockCall<'_, '_>,
        out: AttnOut<'_>,
        (q, k, v): (&DeviceSlice<f32>, &DeviceSlice<f32>, &DeviceSlice<f32>),
    ) -> Result<(), HookError> {
        let (ctx, batch) = (call.ctx, call.batch);
        match (ctx.cp(), call.starts) {
            (None, None) => {
                ctx.backend
                    .attention_forward(out.out, out.lse, q, k, v, self.attn_shape(batch))
            }
            (None, Some(starts)) => {
                let pos: Vec<usize> = (0..self.cfg.seq_len).collect();
                let block = self.document_block(&pos, starts, batch);
                ctx.backend
                    .attention_block_forward(out.out, out.lse, q, k, v, block)
            }
            (Some(cp), _) => {
                let sh = self.ring_shape(cp.positions().len(), batch);
                cp.attention_forward(ctx.device(), out, (q, k, v), sh, call.window_starts)?
            }
        }
        Ok(())
    }

    /// Whole sequences under document masking: one ring block with positions `0..seq` on both
    /// sides and the queries' document starts.
    fn document_block<'p>(
        &self,
        pos: &'p [usize],
        starts: &'p [usize],
        batch: usize,
    ) -> KvBlock<'p> {
        KvBlock {
            q_pos: pos,
            kv_pos: pos,
            q_start: Some(starts),
            shape: self.ring_shape(pos.len(), batch),
        }
    }

    /// Backward of [`Llama::attention`]: overwrites the query, key and value gradients from
    /// `dout`.
    pub(crate) fn attention_backward(
        &self,
        call: &BlockCall<'_, '_>,
        grads: QkvGrads<'_>,
        dout: &DeviceSlice<f32>,
        saved: RingSaved<'_>,
    ) -> Result<(), HookError> {
        let (ctx, batch) = (call.ctx, call.batch);
        if let Some(cp) = ctx.cp() {
            let sh = self.ring_shape(cp.positions().len(), batch);
            return cp.attention_backward(ctx.device(), grads, dout, saved, sh, call.window_starts);
        }
        let be = ctx.backend;
        let mut delta = ctx
            .ledger
            .zeros::<f32>(Category::Workspace, saved.lse.len());
        let QkvGrads { dq, dk, dv } = grads;
        let grads = AttnGrads { dq, dk, dv };
        match call.starts {
            None => {
                let flash = AttnSaved {
                    q: saved.q,
                    k: saved.k,
                    v: saved.v,
                    out: saved.out,
                    lse: saved.lse,
                };
                be.attention_backward(grads, &mut delta, dout, flash, self.attn_shape(batch));
            }
            Some(starts) => {
                let pos: Vec<usize> = (0..self.cfg.seq_len).collect();
                let block = self.document_block(&pos, starts, batch);
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
        Ok(())
    }
}

/// Global position within its sequence of each of `t` flattened tokens (`[t / n, n]` rows of
/// `n` tokens): this rank's zig-zag positions under context parallelism, else `0..seq_len`.
pub fn token_positions(cp: Option<&dyn ContextParallel>, seq_len: usize, t: usize) -> Vec<usize> {
    match cp {
        Some(cp) => {
            let pos = cp.positions();
            (0..t).map(|i| pos[i % pos.len()]).collect()
        }
        None => (0..t).map(|i| i % seq_len).collect(),
    }
}
