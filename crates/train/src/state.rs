//! The flat training state of one rank: weights, gradients, optimizer states — each a
//! contiguous buffer counted in the ledger, parameters as named views ([`ParamLayout`]).
//!
//! | regime | weights | gradients | optimizer |
//! |---|---|---|---|
//! | f32 | f32 (4) | f32 (4) | m, v (8) |
//! | bf16 | bf16 (2) | bf16 (2) | f32 master + m, v (12) |
//! | bf16 + fp32_grad_accum | bf16 (2) | bf16 + f32 (6) | 12 |

use ferrotron_config::{DType, TrainConfig};
use ferrotron_model::{init_params, Grads, ParamLayout};
use ferrotron_tensor::adamw::{adamw_update, sum_squares, AdamW};
use ferrotron_tensor::{Buf, Category, Ledger, Store, StoreDType};

/// Storage dtype of a config's dtype.
pub fn store_dtype(d: DType) -> StoreDType {
    match d {
        DType::F32 => StoreDType::F32,
        DType::Bf16 => StoreDType::Bf16,
    }
}

/// Weights, gradients and optimizer states of one rank.
pub struct TrainState {
    /// Parameter layout.
    pub layout: ParamLayout,
    /// Weights used by forward and backward.
    pub weights: Store,
    /// fp32 master weights (mixed precision only; in f32 the weights are the master).
    pub master: Option<Buf<f32>>,
    /// Gradients.
    pub grads: Grads,
    /// Adam first moments.
    pub m: Buf<f32>,
    /// Adam second moments.
    pub v: Buf<f32>,
    ledger: Ledger,
}

impl TrainState {
    /// State for `layout` with weights `init` (full fp32 values).
    pub fn new(ledger: &Ledger, layout: ParamLayout, init: &[f32], train: &TrainConfig) -> Self {
        let dtype = store_dtype(train.dtype);
        let n = layout.total;
        let (weights, master) = match dtype {
            StoreDType::F32 => {
                let mut w = ledger.zeros::<f32>(Category::Weights, n);
                w.copy_from_slice(init);
                (Store::F32(w), None)
            }
            StoreDType::Bf16 => {
                let mut master = ledger.zeros::<f32>(Category::Optimizer, n);
                master.copy_from_slice(init);
                let mut w = Store::zeros(ledger, Category::Weights, dtype, n);
                w.write(0..n, init);
                (w, Some(master))
            }
        };
        // Adam states are allocated up front, so the first step's peak is the steady state.
        TrainState {
            weights,
            master,
            grads: Grads::new(ledger, dtype, train.fp32_grad_accum, n),
            m: ledger.zeros(Category::Optimizer, n),
            v: ledger.zeros(Category::Optimizer, n),
            layout,
            ledger: ledger.clone(),
        }
    }

    /// State drawn from the layout-independent initialisation.
    pub fn initialised(ledger: &Ledger, layout: ParamLayout, train: &TrainConfig) -> Self {
        let mut init = ledger.zeros::<f32>(Category::Workspace, layout.total);
        init_params(&layout, train.seed, &mut init);
        Self::new(ledger, layout, &init, train)
    }

    /// L2 norm of the whole gradient (as the optimizer reads it).
    pub fn grad_norm(&self) -> f64 {
        let all = self.grads.optimizer_view(0..self.layout.total);
        sum_squares(&all).sqrt()
    }

    /// Clips by global norm (when `clip > 0`), steps AdamW on every parameter, refreshes the
    /// bf16 weights from the master, zeroes the gradients. Returns the pre-clip norm.
    pub fn optimizer_step(&mut self, train: &TrainConfig, lr: f64, step: u64) -> f64 {
        let norm = self.grad_norm();
        let scale = if train.grad_clip > 0.0 && norm > train.grad_clip {
            (train.grad_clip / (norm + 1e-6)) as f32
        } else {
            1.0
        };
        let TrainState {
            layout,
            weights,
            master,
            grads,
            m,
            v,
            ..
        } = self;
        for spec in &layout.params {
            let r = spec.range();
            let param: &mut [f32] = match (master.as_mut(), &mut *weights) {
                (Some(master), _) => &mut master[r.clone()],
                (None, Store::F32(w)) => &mut w[r.clone()],
                (None, Store::Bf16(_)) => unreachable!("bf16 weights always have an fp32 master"),
            };
            let hyper = AdamW {
                lr: lr as f32,
                beta1: train.beta1 as f32,
                beta2: train.beta2 as f32,
                eps: train.eps as f32,
                weight_decay: if spec.decay {
                    train.weight_decay as f32
                } else {
                    0.0
                },
                step,
            };
            let g = grads.optimizer_view(r.clone());
            adamw_update(param, &g, &mut m[r.clone()], &mut v[r], scale, hyper);
        }
        if let Some(master) = master {
            weights.write(0..layout.total, master);
        }
        grads.zero();
        norm
    }

    /// The full-precision values of every parameter (master in mixed precision).
    pub fn full_weights(&self) -> ferrotron_tensor::View<'_> {
        match &self.master {
            Some(m) => ferrotron_tensor::View::Borrowed(m),
            None => self.weights.view_all(&self.ledger),
        }
    }
}
