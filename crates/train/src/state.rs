//! The flat training state of one rank: weights, gradients, optimizer states — each a
//! contiguous buffer counted in the ledger; parameters are named views ([`ParamLayout`]),
//! a ZeRO shard is this rank's pieces of every bucket ([`BucketPlan`]).
//!
//! Bytes per parameter (Ψ = all parameters, Ψ_r = this rank's shard, ≈ Ψ/N_d):
//!
//! | regime | weights | gradients | optimizer |
//! |---|---|---|---|
//! | f32, ZeRO-0 | 4Ψ | 4Ψ | 8Ψ (m, v) |
//! | f32, ZeRO-1 | 4Ψ | 4Ψ | 8Ψ_r |
//! | f32, ZeRO-2 | 4Ψ | 4Ψ_r | 8Ψ_r |
//! | f32, ZeRO-3 | 4Ψ_r | 4Ψ_r | 8Ψ_r |
//! | bf16 | 2 × the same | 2 × the same (+4 with fp32_grad_accum) | 12 (fp32 master, m, v) × the same |
//!
//! In f32 the weights are their own master copy. Transient buffers of the reductions and the
//! ZeRO-3 gathered units are counted under communication.

use ferrotron_config::{DType, TrainConfig};
use std::ops::Range;

use ferrotron_model::{init_range, Grads, ParamLayout};
use ferrotron_tensor::{Buf, Category, Device, DeviceSlice, Store, StoreDType};

use ferrotron_parallel::buckets::BucketPlan;

/// Elements of the scratch through which initial weights are written (64 KiB of f32); the
/// estimator counts it as workspace (`ferrotron_plan::INIT_SCRATCH_ELEMS`, the same number).
pub const INIT_CHUNK: usize = 1 << 14;

/// Storage dtype of a config's dtype.
pub fn store_dtype(d: DType) -> StoreDType {
    match d {
        DType::F32 => StoreDType::F32,
        DType::Bf16 => StoreDType::Bf16,
        DType::F16 => StoreDType::F16,
    }
}

/// The dtype of a rank's gradient buffer: its storage dtype, except under fp16 with ZeRO-2/3,
/// whose shard receives gradients already reduced in fp32 from fp16 pieces and keeps them in
/// fp32 alone (an fp16 copy would never be written).
fn grad_dtype(dtype: StoreDType, zero: u8) -> StoreDType {
    match dtype {
        StoreDType::F16 if zero >= 2 => StoreDType::F32,
        d => d,
    }
}

/// Weights, gradients and optimizer states of one rank.
pub struct TrainState {
    /// Parameter layout of the full model.
    pub layout: ParamLayout,
    /// Buckets and shards.
    pub plan: BucketPlan,
    /// This rank's data-parallel index.
    pub dp_rank: usize,
    /// ZeRO stage.
    pub zero: u8,
    /// Weights used by forward and backward: the full model (ZeRO < 3) or this rank's shard.
    pub weights: Store,
    /// fp32 master weights of the shard (mixed precision only; in f32 the weights are the
    /// master).
    pub master: Option<Buf<f32>>,
    /// Gradients: the full model (ZeRO < 2) or this rank's shard.
    pub grads: Grads,
    /// Adam first moments of the shard.
    pub m: Buf<f32>,
    /// Adam second moments of the shard.
    pub v: Buf<f32>,
}

/// The label of the transfers that bring a fresh run's initial weights to the device.
pub const INITIAL_WEIGHTS: &str = "initial weights";

impl TrainState {
    /// State for `layout` with full weights `init`, holding what rank `dp_rank` of `plan`
    /// owns under ZeRO stage `zero`.
    pub fn new(
        dev: Device<'_>,
        layout: ParamLayout,
        plan: BucketPlan,
        dp_rank: usize,
        zero: u8,
        init: &[f32],
        train: &TrainConfig,
    ) -> Self {
        let fill = |range: Range<usize>, dst: &mut [f32]| dst.copy_from_slice(&init[range]);
        Self::filled(dev, layout, plan, dp_rank, zero, &fill, train)
    }

    /// State whose initial weights `fill(range, dst)` writes, range by range of the flat
    /// buffer: only what this rank holds is ever drawn (in bf16 twice: once for the weights,
    /// once for the fp32 master shard), through a scratch of at most [`INIT_CHUNK`] elements.
    fn filled(
        dev: Device<'_>,
        layout: ParamLayout,
        plan: BucketPlan,
        dp_rank: usize,
        zero: u8,
        fill: &dyn Fn(Range<usize>, &mut [f32]),
        train: &TrainConfig,
    ) -> Self {
        let dtype = store_dtype(train.dtype);
        let (ledger, backend) = (dev.ledger, dev.backend);
        let n = layout.total;
        let shard = plan.shard_len(dp_rank);
        let pieces = plan.pieces(dp_rank);
        let gather_shard = |dst: &mut DeviceSlice<f32>| {
            let mut host = vec![0.0f32; INIT_CHUNK];
            for (_, range, at) in &pieces {
                for start in range.clone().step_by(INIT_CHUNK) {
                    let end = (start + INIT_CHUNK).min(range.end);
                    let part = &mut host[..end - start];
                    fill(start..end, part);
                    let to = at + start - range.start;
                    ledger.upload_into(INITIAL_WEIGHTS, &mut dst[to..to + part.len()], part);
                }
            }
        };
        // (flat range, offset in the weights) of what this rank's weights hold.
        let segments: Vec<(Range<usize>, usize)> = if zero >= 3 {
            pieces.iter().map(|(_, r, at)| (r.clone(), *at)).collect()
        } else {
            vec![(0..n, 0)]
        };
        let len = if zero >= 3 { shard } else { n };
        let mut weights = Store::zeros(ledger, Category::Weights, dtype, len);
        let mut scratch = ledger.zeros::<f32>(Category::Workspace, INIT_CHUNK.min(len));
        let mut host = vec![0.0f32; INIT_CHUNK.min(len)];
        for (range, at) in segments {
            for start in range.clone().step_by(INIT_CHUNK) {
                let end = (start + INIT_CHUNK).min(range.end);
                let (part, dev_part) = (&mut host[..end - start], &mut scratch[..end - start]);
                fill(start..end, part);
                ledger.upload_into(INITIAL_WEIGHTS, dev_part, part);
                let to = at + start - range.start;
                weights.write(backend, to..to + part.len(), dev_part);
            }
        }
        drop(scratch);
        let master = (dtype != StoreDType::F32).then(|| {
            let mut m = ledger.zeros::<f32>(Category::Optimizer, shard);
            gather_shard(&mut m);
            m
        });
        let grad_len = if zero >= 2 { shard } else { n };
        // Adam states are allocated up front, so the first step's peak is the steady state.
        TrainState {
            weights,
            master,
            grads: Grads::new(
                ledger,
                grad_dtype(dtype, zero),
                train.fp32_grad_accum,
                grad_len,
            ),
            m: ledger.zeros(Category::Optimizer, shard),
            v: ledger.zeros(Category::Optimizer, shard),
            layout,
            plan,
            dp_rank,
            zero,
        }
    }

    /// State drawn from the layout-independent initialisation.
    pub fn initialised(
        dev: Device<'_>,
        layout: ParamLayout,
        plan: BucketPlan,
        dp_rank: usize,
        zero: u8,
        train: &TrainConfig,
    ) -> Self {
        let draw = layout.clone();
        let fill = |range: Range<usize>, dst: &mut [f32]| init_range(&draw, train.seed, range, dst);
        Self::filled(dev, layout, plan, dp_rank, zero, &fill, train)
    }

    /// Whether weights are sharded (ZeRO-3).
    pub fn sharded_weights(&self) -> bool {
        self.zero >= 3
    }

    /// Whether gradients are sharded (ZeRO-2/3).
    pub fn sharded_grads(&self) -> bool {
        self.zero >= 2
    }
}
