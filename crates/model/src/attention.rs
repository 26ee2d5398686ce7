//! Causal attention of this rank's queries, forward and backward: flash attention over whole
//! sequences, or the context-parallel strategy's ring ([`ContextParallel`]).

use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::{AttnGrads, Category, DeviceSlice};

use crate::llama::StepCtx;
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
    /// attention over whole sequences, or the ring over the context-parallel group.
    pub(crate) fn attention(
        &self,
        ctx: &StepCtx<'_>,
        out: AttnOut<'_>,
        (q, k, v): (&DeviceSlice<f32>, &DeviceSlice<f32>, &DeviceSlice<f32>),
        batch: usize,
    ) -> Result<(), HookError> {
        match ctx.cp() {
            None => {
                ctx.backend
                    .attention_forward(out.out, out.lse, q, k, v, self.attn_shape(batch))
            }
            Some(cp) => {
                let sh = self.ring_shape(cp.positions().len(), batch);
                cp.attention_forward(ctx.device(), out, q, k, v, sh)?
            }
        }
        Ok(())
    }

    /// Backward of [`Llama::attention`]: overwrites the query, key and value gradients from
    /// `dout`.
    pub(crate) fn attention_backward(
        &self,
        ctx: &StepCtx<'_>,
        grads: QkvGrads<'_>,
        dout: &DeviceSlice<f32>,
        saved: RingSaved<'_>,
        batch: usize,
    ) -> Result<(), HookError> {
        match ctx.cp() {
            None => {
                let flash = AttnSaved {
                    q: saved.q,
                    k: saved.k,
                    v: saved.v,
                    out: saved.out,
                    lse: saved.lse,
                };
                let mut delta = ctx
                    .ledger
                    .zeros::<f32>(Category::Workspace, saved.lse.len());
                let sh = self.attn_shape(batch);
                let QkvGrads { dq, dk, dv } = grads;
                ctx.backend.attention_backward(
                    AttnGrads { dq, dk, dv },
                    &mut delta,
                    dout,
                    flash,
                    sh,
                );
            }
            Some(cp) => {
                let sh = self.ring_shape(cp.positions().len(), batch);
                cp.attention_backward(ctx.device(), grads, dout, saved, sh)?;
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
