//! Causal attention of this rank's queries, forward and backward: flash attention over whole
//! sequences, or the context-parallel strategy's ring ([`ContextParallel`]).

use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::sequences::{whole_backward, whole_forward};
use ferrotron_tensor::{AttnGrads, DeviceSlice};

use crate::ctx::BlockCall;
use crate::strategy::{AttnOut, ContextParallel, Qkv, QkvGrads, RingSaved};
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
        qkv: Qkv<'_>,
    ) -> Result<(), HookError> {
        let (ctx, batch) = (call.ctx, call.batch);
        match ctx.cp() {
            None => {
                let sh = self.attn_shape(batch);
                whole_forward(ctx.device(), (out.out, out.lse), qkv, sh, call.starts)
            }
            Some(cp) => {
                let sh = self.ring_shape(cp.positions().len(), batch);
                cp.attention_forward(ctx.device(), out, qkv, sh, call.window_starts)?
            }
        }
        Ok(())
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
        let QkvGrads { dq, dk, dv } = grads;
        let flash = AttnSaved {
            q: saved.q,
            k: saved.k,
            v: saved.v,
            out: saved.out,
            lse: saved.lse,
        };
        let shape = (self.attn_shape(batch), call.starts);
        whole_backward(ctx.device(), AttnGrads { dq, dk, dv }, dout, flash, shape);
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
