//! How the model reaches its weights and delivers its gradients, so that data parallelism
//! and ZeRO live outside the model: a [`WeightSource`] can gather a sharded unit before use
//! and free it after; a [`GradSink`] can start a bucket's reduction as soon as the unit's
//! gradients are final.

use std::ops::Range;

use ferrotron_tensor::{Device, DeviceSlice, Operand, Store, View};

use crate::Grads;

/// The error a hook may return (a communication failure, typically); the model passes it on.
pub type HookError = Box<dyn std::error::Error + Send + Sync>;

/// A group of parameters fetched and reduced together, in forward order: the embedding, each
/// block, then the head (final norm + LM head). Each unit is one contiguous flat range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    /// `model.embed_tokens`.
    Embed,
    /// `model.layers.N`: every parameter of the block except a mixture of experts' experts.
    Block(usize),
    /// `model.layers.N.block_sparse_moe.experts`: the experts of block N this rank holds
    /// (mixture-of-experts blocks only), right after the block in forward order.
    Experts(usize),
    /// `model.norm` and `lm_head` (the latter absent when tied).
    Head,
}

/// Whether a unit is entered for its forward or its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Forward pass.
    Forward,
    /// Backward pass.
    Backward,
}

/// Where weights come from.
pub trait WeightSource: Sync {
    /// An f32 view of the flat range `range` (inside one unit that has been entered).
    fn view(&self, dev: Device<'_>, range: Range<usize>) -> View<'_>;
    /// The flat range `range` as stored, where the source holds it in place (a full store),
    /// for kernels that read bf16 without an f32 copy; `None` (the default): use
    /// [`WeightSource::view`].
    fn stored(&self, _range: Range<usize>) -> Option<Operand<'_>> {
        None
    }
    /// Called before `unit` is used in `phase`: a sharded source gathers it here.
    fn enter(&self, _unit: Unit, _phase: Phase) -> Result<(), HookError> {
        Ok(())
    }
    /// Called after `unit` was used in `phase`: a sharded source may free it here.
    fn leave(&self, _unit: Unit, _phase: Phase) -> Result<(), HookError> {
        Ok(())
    }
}

/// Where weight gradients go.
pub trait GradSink {
    /// Runs `f` on device memory into which `f` adds the gradient of the flat `range`.
    fn accumulate(
        &mut self,
        dev: Device<'_>,
        range: Range<usize>,
        f: &mut dyn FnMut(&mut DeviceSlice<f32>),
    );
    /// Every gradient of `unit` for the current micro-batch has been accumulated.
    fn unit_done(&mut self, _unit: Unit) -> Result<(), HookError> {
        Ok(())
    }
}

/// A full flat store is a weight source (single rank, DP, ZeRO-1/2).
impl WeightSource for Store {
    fn view(&self, dev: Device<'_>, range: Range<usize>) -> View<'_> {
        Store::view(self, dev, range)
    }
    fn stored(&self, range: Range<usize>) -> Option<Operand<'_>> {
        Some(self.operand()?.range(range))
    }
}

/// A weight as a product reads it: its bf16 elements where they are stored, for a backend
/// that reads bf16 ([`ferrotron_tensor::kernels::Products::reads_bf16`]), else an f32 view.
pub enum Weight<'a> {
    /// The stored elements.
    Stored(Operand<'a>),
    /// An f32 view (the stored f32 elements, or a widened copy counted as workspace).
    View(View<'a>),
}

impl Weight<'_> {
    /// The product's operand.
    pub fn operand(&self) -> Operand<'_> {
        match self {
            Weight::Stored(o) => *o,
            Weight::View(v) => v.operand(),
        }
    }
}

/// The flat range `range` of `weights` as the products of `dev` read it (see [`Weight`]).
pub fn product_weight<'w>(
    weights: &'w dyn WeightSource,
    dev: Device<'_>,
    range: Range<usize>,
) -> Weight<'w> {
    if dev.backend.reads_bf16() {
        if let Some(stored @ Operand::Bf16(_)) = weights.stored(range.clone()) {
            return Weight::Stored(stored);
        }
    }
    Weight::View(weights.view(dev, range))
}

/// Full gradients are a sink (single rank).
impl GradSink for Grads {
    fn accumulate(
        &mut self,
        dev: Device<'_>,
        range: Range<usize>,
        f: &mut dyn FnMut(&mut DeviceSlice<f32>),
    ) {
        Grads::accumulate(self, dev, range, f)
    }
}
