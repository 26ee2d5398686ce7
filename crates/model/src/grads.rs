//! Where backward puts weight gradients.

use std::ops::Range;

use ferrotron_tensor::{Buf, Category, Device, DeviceSlice, Ledger, Store, StoreDType};

/// The buffer the optimizer reads, borrowed mutably.
pub enum OptimizerGrads<'a> {
    /// f32 gradients (or the fp32 accumulation buffer).
    F32(&'a mut DeviceSlice<f32>),
    /// bf16 gradients.
    Bf16(&'a mut DeviceSlice<ferrotron_tensor::bf16>),
}

/// The flat gradient buffer of one rank, in one of the playbook §3 regimes:
/// - f32: kernels accumulate straight into the f32 buffer;
/// - bf16: each micro-batch's gradient is computed in f32 workspace and added into the bf16
///   buffer (rounding at every micro-batch);
/// - bf16 + fp32 accumulation: the micro-batch gradient is stored in the bf16 buffer, then
///   added into an fp32 accumulation buffer, which the optimizer reads;
/// - fp16: always so, the micro-batch gradient rounded to fp16 (where a loss scale too large
///   overflows, and a loss scale too small lets small gradients underflow) and accumulated
///   in fp32.
#[derive(Debug)]
pub struct Grads {
    /// Gradients in the storage dtype.
    pub store: Store,
    /// The fp32 accumulation buffer (bf16 + `fp32_grad_accum`, and fp16).
    pub accum: Option<Buf<f32>>,
}

impl Grads {
    /// Zeroed gradients for `len` parameters.
    pub fn new(ledger: &Ledger, dtype: StoreDType, fp32_accum: bool, len: usize) -> Self {
        Self::counted_as(ledger, Category::Gradients, dtype, fp32_accum, len)
    }

    /// Zeroed gradients counted under `cat` (e.g. a communication bucket).
    pub fn counted_as(
        ledger: &Ledger,
        cat: Category,
        dtype: StoreDType,
        fp32_accum: bool,
        len: usize,
    ) -> Self {
        let store = Store::zeros(ledger, cat, dtype, len);
        let accum = match dtype {
            StoreDType::F32 => false,
            StoreDType::Bf16 => fp32_accum,
            StoreDType::F16 => true,
        }
        .then(|| ledger.zeros(cat, len));
        Grads { store, accum }
    }

    /// Number of gradients.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }

    /// The buffer the optimizer reads, mutably: the fp32 accumulation buffer if present, else
    /// the store. Reductions write their results here.
    pub fn optimizer_store(&mut self) -> OptimizerGrads<'_> {
        match &mut self.accum {
            Some(acc) => OptimizerGrads::F32(acc),
            None => match &mut self.store {
                Store::F32(b) => OptimizerGrads::F32(b),
                Store::Bf16(b) => OptimizerGrads::Bf16(b),
                Store::F16(_) => unreachable!("fp16 gradients always accumulate in fp32"),
            },
        }
    }

    /// Runs `f` on an f32 slice that `f` adds the gradient of `range` into.
    pub fn accumulate<R>(
        &mut self,
        dev: Device<'_>,
        range: Range<usize>,
        f: impl FnOnce(&mut DeviceSlice<f32>) -> R,
    ) -> R {
        match (&mut self.store, &mut self.accum) {
            (Store::F32(g), _) => f(&mut g[range]),
            (store, accum) => {
                let mut scratch = dev.ledger.zeros::<f32>(Category::Workspace, range.len());
                let out = f(&mut scratch);
                match accum {
                    None => store.add(dev.backend, range, &scratch),
                    Some(acc) => {
                        store.write(dev.backend, range.clone(), &scratch);
                        let rounded = store.view(dev, range.clone());
                        dev.backend.add_assign(&mut acc[range], &rounded);
                    }
                }
                out
            }
        }
    }

    /// Adds `values`, a gradient already summed over ranks (a ZeRO-2/3 piece): under fp16
    /// straight into the fp32 accumulation buffer, since its terms were rounded to fp16 where
    /// they were computed (as one rank's micro-batches are); else as [`Grads::accumulate`].
    pub fn add_reduced(&mut self, dev: Device<'_>, at: usize, values: &DeviceSlice<f32>) {
        let range = at..at + values.len();
        match (&self.store, &mut self.accum) {
            (Store::F16(_), Some(acc)) => dev.backend.add_assign(&mut acc[range], values),
            _ => self.accumulate(dev, range, |g| dev.backend.add_assign(g, values)),
        }
    }

    /// The gradient the optimizer reads, as f32 (the fp32 accumulation buffer if present).
    pub fn optimizer_view(
        &self,
        dev: Device<'_>,
        range: Range<usize>,
    ) -> ferrotron_tensor::View<'_> {
        match &self.accum {
            Some(acc) => ferrotron_tensor::View::Borrowed(&acc[range]),
            None => self.store.view(dev, range),
        }
    }

    /// The gradient the optimizer reads, as stored (the fp32 accumulation buffer if present):
    /// every element, for a kernel that reads f32 or bf16.
    pub fn optimizer_operand(&self) -> ferrotron_tensor::Operand<'_> {
        match &self.accum {
            Some(acc) => ferrotron_tensor::Operand::F32(acc),
            None => self
                .store
                .operand()
                .expect("fp16 gradients always accumulate in fp32"),
        }
    }

    /// Zeroes every gradient (after the optimizer step).
    pub fn zero(&mut self, dev: Device<'_>) {
        self.store.fill_zero(dev.backend);
        if let Some(acc) = &mut self.accum {
            dev.backend.fill(acc, 0.0);
        }
    }
}
