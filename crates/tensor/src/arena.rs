//! The test suite's second backend: the CPU kernels over an [`Arena`] of device memory.
//!
//! Every buffer of a rank that runs on it is a block of its arena (its ledger allocates from
//! it, [`crate::Ledger::on`]), and every kernel checks that each slice it is given lies in
//! the arena: a host vector, a buffer of another ledger or host memory passed off as device
//! memory ([`DeviceSlice::from_host`]) is refused with a panic naming the kernel. With the
//! engine's explicit transfers counted on the ledger, a step that runs on this backend and
//! matches the CPU backend shows that the step reaches memory only through the backend.

use std::ops::Range;
use std::sync::Arc;

use crate::adamw::AdamW;
use crate::attention::{AttnSaved, AttnShape};
use crate::backend::{AttnGrads, AuxLoss, HeadShape, KvBlock, LinearShape, NormSaved, Operand};
use crate::backend::{RouteShape, Routed};
use crate::fp8::Fp8Quant;
use crate::kernels::*;
use crate::linear::HostMatmul;
use crate::memory::{Arena, DeviceMemory};
use crate::moe::{AuxStats, Dispatch, Routing};
use crate::muon::MuonMomentum;
use crate::ring_attention::BlockShape;
use crate::rope::RopeTable;
use crate::xent::XentGrads;
use crate::{bf16, f16, CpuBackend, DeviceSlice, Ledger, RingBlock};

/// The CPU kernels over an arena of device memory, refusing any other memory.
pub struct ArenaBackend {
    arena: Arc<Arena>,
    inner: CpuBackend,
}

impl ArenaBackend {
    /// A backend whose device memory is `capacity` bytes.
    pub fn new(capacity: usize) -> ArenaBackend {
        ArenaBackend {
            arena: Arc::new(Arena::new(capacity)),
            inner: CpuBackend::default(),
        }
    }

    /// A backend whose device memory is `capacity` bytes that the host may not access
    /// ([`Arena::opaque`]): collectives stage through host copies, as on a GPU.
    pub fn opaque(capacity: usize) -> ArenaBackend {
        ArenaBackend {
            arena: Arc::new(Arena::opaque(capacity)),
            inner: CpuBackend::default(),
        }
    }

    /// This backend with the linear layers' products on `matmul` (the bf16 products read
    /// bf16 operands as stored, as a GPU's do).
    pub fn with_matmul(self, matmul: HostMatmul) -> ArenaBackend {
        ArenaBackend {
            inner: CpuBackend::new(matmul),
            ..self
        }
    }

    /// Panics unless every device slice in `arg` lies in the arena.
    fn check(&self, kernel: &str, arg: &dyn InArena) {
        if let Err(len) = arg.in_arena(&self.arena) {
            panic!("{kernel}: a {len}-element argument is not in this backend's device memory");
        }
    }
}

/// An argument of a kernel, as the arena backend checks it.
trait InArena {
    /// `Err(len)` when a device slice (of `len` elements) lies outside `arena`.
    fn in_arena(&self, arena: &Arena) -> Result<(), usize>;
}

fn slice_in<T>(s: &DeviceSlice<T>, arena: &Arena) -> Result<(), usize> {
    let bytes = std::mem::size_of_val(s.host());
    if bytes == 0 || arena.holds(s.host().as_ptr().cast(), bytes) {
        Ok(())
    } else {
        Err(s.len())
    }
}

impl<T> InArena for &DeviceSlice<T> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        slice_in(self, arena)
    }
}

impl<T> InArena for &mut DeviceSlice<T> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        slice_in(self, arena)
    }
}

impl InArena for AttnSaved<'_, DeviceSlice<f32>> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        [self.q, self.k, self.v, self.out, self.lse]
            .iter()
            .try_for_each(|s| slice_in(s, arena))
    }
}

impl InArena for RingBlock<'_> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        [self.q, self.k, self.v, self.lse, self.delta]
            .iter()
            .try_for_each(|s| slice_in(s, arena))
    }
}

impl InArena for Operand<'_> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        match self {
            Operand::F32(s) => slice_in(s, arena),
            Operand::Bf16(s) => slice_in(s, arena),
        }
    }
}

impl InArena for NormSaved<'_> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        [self.x, self.rstd, self.w]
            .iter()
            .try_for_each(|s| slice_in(s, arena))
    }
}

impl InArena for AttnGrads<'_> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        [&*self.dq, &*self.dk, &*self.dv]
            .iter()
            .try_for_each(|s| slice_in(s, arena))
    }
}

impl InArena for Option<XentGrads<'_, DeviceSlice<f32>>> {
    fn in_arena(&self, arena: &Arena) -> Result<(), usize> {
        match self {
            Some(g) => slice_in(g.dx, arena).and_then(|_| slice_in(g.dw, arena)),
            None => Ok(()),
        }
    }
}

/// Arguments that are not device memory: shapes, scalars, host tables.
macro_rules! not_device_memory {
    ($($t:ty),*) => {
        $(impl InArena for $t {
            fn in_arena(&self, _: &Arena) -> Result<(), usize> {
                Ok(())
            }
        })*
    };
}

not_device_memory!(
    usize,
    f32,
    f64,
    bool,
    bf16,
    f16,
    (usize, usize),
    AdamW,
    MuonMomentum,
    Fp8Quant,
    AttnShape,
    BlockShape,
    &[usize],
    Option<&[f32]>,
    &RopeTable,
    &Routing,
    &Dispatch,
    &AuxStats,
    &Ledger,
    &[Range<usize>],
    LinearShape,
    KvBlock<'_>,
    RouteShape,
    AuxLoss<'_>,
    Routed<'_>,
    HeadShape
);

/// Each kernel: every argument checked, then the CPU backend's kernel.
macro_rules! checked_kernels {
    ($family:ident { $(fn $name:ident(&self, $($a:ident: $t:ty),*) $(-> $r:ty)?;)* }) => {
        impl $family for ArenaBackend {
            $(fn $name(&self, $($a: $t),*) $(-> $r)? {
                $(self.check(stringify!($name), &$a);)*
                self.inner.$name($($a),*)
            })*
        }
    };
}

impl Backend for ArenaBackend {
    fn memory(&self) -> Option<Arc<dyn DeviceMemory>> {
        Some(self.arena.clone())
    }
}

#[rustfmt::skip]
checked_kernels!(Products {
    fn reads_bf16(&self,) -> bool;
    fn best_product_rate(&self,) -> Option<f64>;
    fn linear_forward(&self, y: &mut DeviceSlice<f32>, x: Operand<'_>, w: Operand<'_>, sh: LinearShape);
    fn linear_backward_input(&self, dx: &mut DeviceSlice<f32>, dy: Operand<'_>, w: Operand<'_>, sh: LinearShape, accumulate: bool);
    fn linear_backward_weight(&self, dw: &mut DeviceSlice<f32>, dy: Operand<'_>, x: Operand<'_>, sh: LinearShape);
    fn bias_forward(&self, y: &mut DeviceSlice<f32>, b: &DeviceSlice<f32>);
    fn bias_backward(&self, db: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>);
});

#[rustfmt::skip]
checked_kernels!(Norms {
    fn rmsnorm_forward(&self, y: &mut DeviceSlice<f32>, rstd: &mut DeviceSlice<f32>, x: &DeviceSlice<f32>, w: &DeviceSlice<f32>, h: usize, eps: f32);
    fn rmsnorm_backward(&self, dx: &mut DeviceSlice<f32>, dw: &mut DeviceSlice<f32>, dy: &DeviceSlice<f32>, saved: NormSaved<'_>, accumulate: bool);
    fn rmsnorm_apply(&self, y: &mut DeviceSlice<f32>, saved: NormSaved<'_>);
});

#[rustfmt::skip]
checked_kernels!(AttentionKernels {
    fn rope(&self, x: &mut DeviceSlice<f32>, positions: &[usize], heads: usize, table: &RopeTable, inverse: bool);
    fn attention_forward(&self, out: &mut DeviceSlice<f32>, lse: &mut DeviceSlice<f32>, q: &DeviceSlice<f32>, k: &DeviceSlice<f32>, v: &DeviceSlice<f32>, shape: AttnShape);
    fn attention_backward(&self, grads: AttnGrads<'_>, delta: &mut DeviceSlice<f32>, dout: &DeviceSlice<f32>, saved: AttnSaved<'_, DeviceSlice<f32>>, shape: AttnShape);
    fn attention_block_forward(&self, out: &mut DeviceSlice<f32>, lse: &mut DeviceSlice<f32>, q: &DeviceSlice<f32>, k: &DeviceSlice<f32>, v: &DeviceSlice<f32>, block: KvBlock<'_>);
    fn attention_merge(&self, out: &mut DeviceSlice<f32>, lse: &mut DeviceSlice<f32>, part_out: &DeviceSlice<f32>, part_lse: &DeviceSlice<f32>, sh: BlockShape);
    fn attention_delta(&self, delta: &mut DeviceSlice<f32>, dout: &DeviceSlice<f32>, out: &DeviceSlice<f32>, sh: BlockShape);
    fn attention_block_backward(&self, grads: AttnGrads<'_>, dout: &DeviceSlice<f32>, saved: RingBlock<'_>, block: KvBlock<'_>);
});

#[rustfmt::skip]
checked_kernels!(MoeKernels {
    fn moe_route(&self, ledger: &Ledger, logits: &DeviceSlice<f32>, bias: Option<&[f32]>, sh: RouteShape) -> Routing;
    fn moe_route_backward(&self, d_logits: &mut DeviceSlice<f32>, d_gates: &DeviceSlice<f32>, routing: &Routing, sh: RouteShape);
    fn moe_aux_stats(&self, routing: &Routing, sh: RouteShape) -> AuxStats;
    fn moe_aux_loss_backward(&self, d_logits: &mut DeviceSlice<f32>, aux: AuxLoss<'_>, routing: &Routing, sh: RouteShape);
    fn moe_gather_rows(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, h: usize, dispatch: &Dispatch);
    fn moe_scatter_add_rows(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, h: usize, dispatch: &Dispatch);
    fn moe_combine_forward(&self, out: &mut DeviceSlice<f32>, expert_out: &DeviceSlice<f32>, h: usize, routed: Routed<'_>);
    fn moe_combine_backward(&self, d_expert_out: &mut DeviceSlice<f32>, d_gates: &mut DeviceSlice<f32>, d_out: &DeviceSlice<f32>, expert_out: &DeviceSlice<f32>, h: usize, routed: Routed<'_>);
});

#[rustfmt::skip]
checked_kernels!(LossKernels {
    fn lm_head_xent(&self, ledger: &Ledger, xn: &DeviceSlice<f32>, w: Operand<'_>, targets: &DeviceSlice<u32>, sh: HeadShape, grads: Option<XentGrads<'_, DeviceSlice<f32>>>) -> f64;
    fn logits_row_max(&self, out: &mut DeviceSlice<f32>, lg: &DeviceSlice<f32>, vl: usize);
    fn max_over_ranks(&self, out: &mut DeviceSlice<f32>, gathered: &DeviceSlice<f32>, ranks: usize);
    fn logits_exp_stats(&self, out: &mut DeviceSlice<f32>, lg: &DeviceSlice<f32>, targets: &DeviceSlice<u32>, row_max: &DeviceSlice<f32>, slice: (usize, usize));
    fn vocab_lse(&self, ledger: &Ledger, lse: &mut DeviceSlice<f64>, row_max: &DeviceSlice<f32>, stats: &DeviceSlice<f32>) -> f64;
    fn vocab_softmax_grad(&self, lg: &mut DeviceSlice<f32>, targets: &DeviceSlice<u32>, lse: &DeviceSlice<f64>, slice: (usize, usize), scale: f32);
});

#[rustfmt::skip]
checked_kernels!(Elementwise {
    fn swiglu_forward(&self, act: &mut DeviceSlice<f32>, gate: &DeviceSlice<f32>, up: &DeviceSlice<f32>);
    fn swiglu_backward(&self, dgate: &mut DeviceSlice<f32>, dup: &mut DeviceSlice<f32>, dact: &DeviceSlice<f32>, gate: &DeviceSlice<f32>, up: &DeviceSlice<f32>);
    fn embedding_forward(&self, x: &mut DeviceSlice<f32>, table: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize);
    fn embedding_backward(&self, dtable: &mut DeviceSlice<f32>, dx: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize);
    fn embedding_forward_slice(&self, x: &mut DeviceSlice<f32>, table: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize, v0: usize);
    fn embedding_backward_slice(&self, dtable: &mut DeviceSlice<f32>, dx: &DeviceSlice<f32>, tokens: &DeviceSlice<u32>, h: usize, v0: usize);
    fn add(&self, out: &mut DeviceSlice<f32>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>);
    fn copy(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>);
    fn copy_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<bf16>);
    fn fill(&self, dst: &mut DeviceSlice<f32>, value: f32);
    fn fill_bf16(&self, dst: &mut DeviceSlice<bf16>, value: bf16);
    fn add_assign(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>);
    fn add_assign_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>);
    fn scale(&self, dst: &mut DeviceSlice<f32>, s: f32);
    fn round_bf16(&self, dst: &mut DeviceSlice<bf16>, src: &DeviceSlice<f32>);
    fn widen_bf16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<bf16>);
    fn fill_f16(&self, dst: &mut DeviceSlice<f16>, value: f16);
    fn add_assign_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>);
    fn round_f16(&self, dst: &mut DeviceSlice<f16>, src: &DeviceSlice<f32>);
    fn widen_f16(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f16>);
    fn fp8_amax(&self, out: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, q: Fp8Quant);
    fn fp8_apply(&self, dst: &mut DeviceSlice<f32>, src: &DeviceSlice<f32>, amax: &DeviceSlice<f32>, q: Fp8Quant);
});

#[rustfmt::skip]
checked_kernels!(OptimizerKernels {
    fn adamw(&self, param: &mut DeviceSlice<f32>, grad: &DeviceSlice<f32>, m: &mut DeviceSlice<f32>, v: &mut DeviceSlice<f32>, grad_scale: f32, hyper: AdamW);
    fn muon_momentum(&self, u: &mut DeviceSlice<f32>, m: &mut DeviceSlice<f32>, grad: &DeviceSlice<f32>, grad_scale: f32, hyper: MuonMomentum);
    fn sum_squares(&self, ledger: &Ledger, x: &DeviceSlice<f32>) -> f64;
    fn sum_squares_ranges(&self, ledger: &Ledger, x: Operand<'_>, ranges: &[Range<usize>]) -> Vec<f64>;
});

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Category;

    #[test]
    fn kernels_run_on_arena_buffers_and_refuse_other_memory() {
        let be = ArenaBackend::new(1 << 20);
        let ledger = Ledger::on(be.memory().unwrap());
        let a = ledger.upload(Category::Workspace, "test", &[1.0f32, 2.0, 3.0]);
        let b = ledger.upload(Category::Workspace, "test", &[0.5f32, 0.25, 0.125]);
        let mut out = ledger.zeros::<f32>(Category::Workspace, 3);
        be.add(&mut out, &a, &b);
        assert_eq!(ledger.download("test", &out), [1.5, 2.25, 3.125]);
        let host = [0.0f32; 3];
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            be.add(&mut out, &a, DeviceSlice::from_host(&host))
        }));
        assert!(
            refused.is_err(),
            "host memory passed as device memory is refused"
        );
        let other = Ledger::new().zeros::<f32>(Category::Workspace, 3);
        let refused =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.copy(&mut out, &other)));
        assert!(refused.is_err(), "a host ledger's buffer is refused");
        let t = ledger.transfers()["test"];
        assert_eq!(
            (t.to_device, t.to_device_bytes, t.to_host, t.to_host_bytes),
            (2, 24, 1, 12)
        );
        drop((a, b, out));
        assert_eq!(be.memory().unwrap().in_use(), 0);
    }
}
