//! Activation recomputation (playbook §3): what a block's forward keeps for its backward, and
//! how the backward gets back what was not kept. The policy is `parallel.recompute`:
//!
//! - `none`: every tensor the backward reads is kept.
//! - `selective`: the normed inputs of attention and MLP and the attention output are
//!   dropped, and rebuilt in backward from the kept input, reciprocal RMS and Q, K, V (two
//!   norms and one flash-attention forward per block).
//! - `full`: only the block input is kept; the backward runs the block's forward again.
//!
//! Restored tensors are bit-identical to those the forward would have kept.

use ferrotron_config::Recompute;
use ferrotron_tensor::{Buf, Category, DeviceSlice, NormSaved, Store};

use crate::ctx::{BlockCall, StepCtx};
use crate::moe::MoeSaved;
use crate::strategy::AttnOut;
use crate::{HookError, Llama};

/// Activations one block saves for its backward (opaque outside the model). Residual-stream
/// tensors hold this rank's tokens (all of them without sequence parallelism); the others
/// this rank's heads/columns.
pub struct BlockActs {
    pub(crate) attn: AttnActs,
    pub(crate) mlp: MlpActs,
    /// Full recomputation: only the block input is kept.
    pub(crate) input_only: bool,
}

/// The attention half's saved tensors.
pub(crate) struct AttnActs {
    pub(crate) x_in: Store,
    pub(crate) rstd1: Buf<f32>,
    pub(crate) xn1: Store,
    pub(crate) q: Store,
    pub(crate) k: Store,
    pub(crate) v: Store,
    pub(crate) attn: Store,
    pub(crate) lse: Buf<f32>,
}

/// The MLP half's saved tensors.
pub(crate) struct MlpActs {
    pub(crate) x_mid: Store,
    pub(crate) rstd2: Buf<f32>,
    pub(crate) xn2: Store,
    pub(crate) gate: Store,
    pub(crate) up: Store,
    /// Mixture-of-experts blocks: their activations (instead of `gate` and `up`) and routing
    /// statistics.
    pub(crate) moe: MoeSaved,
}

impl BlockActs {
    /// The routing statistics of a mixture-of-experts block and the assignments it dropped,
    /// taken once after its forward.
    pub(crate) fn take_moe_stats(&mut self) -> Option<(ferrotron_tensor::moe::AuxStats, usize)> {
        let dropped = std::mem::take(&mut self.mlp.moe.dropped);
        self.mlp.moe.stats.take().map(|s| (s, dropped))
    }
}

/// What the attention half of a forward computed (f32, before the policy stores it).
pub(crate) struct AttnHalf {
    pub(crate) rstd1: Buf<f32>,
    pub(crate) xn1: Buf<f32>,
    pub(crate) q: Buf<f32>,
    pub(crate) k: Buf<f32>,
    pub(crate) v: Buf<f32>,
    pub(crate) attn: Buf<f32>,
    pub(crate) lse: Buf<f32>,
    pub(crate) x_mid: Buf<f32>,
}

/// What the MLP half of a forward computed.
pub(crate) struct MlpHalf {
    pub(crate) rstd2: Buf<f32>,
    pub(crate) xn2: Buf<f32>,
    pub(crate) gate: Buf<f32>,
    pub(crate) up: Buf<f32>,
    pub(crate) moe: MoeSaved,
}

/// Everything a block's forward produced besides its output.
pub(crate) struct Saved {
    pub(crate) x_in: Store,
    pub(crate) attn: AttnHalf,
    pub(crate) mlp: MlpHalf,
}

impl Saved {
    /// What the backward keeps under `policy`; the rest is freed here.
    pub(crate) fn keep(self, ctx: &StepCtx<'_>, policy: Recompute) -> BlockActs {
        let Saved {
            x_in,
            attn: a,
            mlp: m,
        } = self;
        let none = || ctx.keep(ctx.ledger.zeros::<f32>(Category::Activations, 0));
        if policy == Recompute::Full {
            drop((m.gate, m.up));
            // Keep only the block's input; backward runs this forward again.
            let empty = || ctx.ledger.zeros::<f32>(Category::Activations, 0);
            return BlockActs {
                attn: AttnActs {
                    x_in,
                    rstd1: empty(),
                    xn1: none(),
                    q: none(),
                    k: none(),
                    v: none(),
                    attn: none(),
                    lse: empty(),
                },
                mlp: MlpActs {
                    x_mid: none(),
                    rstd2: empty(),
                    xn2: none(),
                    gate: none(),
                    up: none(),
                    moe: MoeSaved {
                        acts: None,
                        stats: m.moe.stats,
                        dropped: m.moe.dropped,
                    },
                },
                input_only: true,
            };
        }
        // Selective: the normed inputs and the attention output are recomputed in backward.
        let (xn1, xn2, attn) = if policy == Recompute::Selective {
            drop((a.xn1, m.xn2, a.attn));
            (none(), none(), none())
        } else {
            (ctx.keep(a.xn1), ctx.keep(m.xn2), ctx.keep(a.attn))
        };
        BlockActs {
            attn: AttnActs {
                x_in,
                rstd1: a.rstd1,
                xn1,
                q: ctx.keep(a.q),
                k: ctx.keep(a.k),
                v: ctx.keep(a.v),
                attn,
                lse: a.lse,
            },
            mlp: MlpActs {
                x_mid: ctx.keep(a.x_mid),
                rstd2: m.rstd2,
                xn2,
                gate: ctx.keep(m.gate),
                up: ctx.keep(m.up),
                moe: m.moe,
            },
            input_only: false,
        }
    }
}

impl Llama {
    /// Recomputes what the forward did not keep: the whole block under full recomputation;
    /// the normed inputs (from the kept input and reciprocal RMS) and the attention output
    /// (a flash-attention forward from Q, K, V) under selective recomputation.
    pub(crate) fn restore(
        &self,
        call: &BlockCall<'_, '_>,
        mut a: BlockActs,
    ) -> Result<BlockActs, HookError> {
        if a.input_only {
            let (_, acts) = self.block_forward(call, a.attn.x_in, Recompute::None)?;
            return Ok(acts);
        }
        let (ctx, lp) = (call.ctx, call.lp);
        let (h, l, lay) = (self.cfg.hidden, ctx.device(), &self.layout);
        let norm = |x: &Store, rstd: &DeviceSlice<f32>, w: usize| {
            let (x, w) = (x.view_all(l), call.weights.view(l, lay.range(w)));
            let mut y = ctx.act_buf(x.len());
            let saved = NormSaved {
                x: &x,
                rstd,
                w: &w,
                h,
            };
            ctx.backend.rmsnorm_apply(&mut y, saved);
            ctx.keep(y)
        };
        if a.attn.xn1.is_empty() {
            a.attn.xn1 = norm(&a.attn.x_in, &a.attn.rstd1, lp.attn_norm);
            a.mlp.xn2 = norm(&a.mlp.x_mid, &a.mlp.rstd2, lp.mlp_norm);
        }
        if a.attn.attn.is_empty() {
            let s = &a.attn;
            let (q, k, v) = (s.q.view_all(l), s.k.view_all(l), s.v.view_all(l));
            let mut attn = ctx.act_buf(q.len());
            let mut lse = ctx.work(s.lse.len());
            let out = AttnOut {
                out: &mut attn,
                lse: &mut lse,
            };
            self.attention(call, out, (&q, &k, &v))?;
            drop((q, k, v));
            a.attn.attn = ctx.keep(attn);
        }
        Ok(a)
    }
}
