//! Tensor and sequence parallelism as the model sees it, in Megatron's vocabulary of conjugate
//! operators, written over the [`TensorParallel`] strategy's collectives (implemented in
//! `parallel/src/tensor_parallel.rs`):
//!
//! | operator | forward | backward | where |
//! |---|---|---|---|
//! | `f` | identity | all-reduce | entering a TP region (input replicated) |
//! | `f̄` | all-reduce | identity | leaving a TP region (partial sums) |
//! | `g` | all-gather (tokens) | reduce-scatter (tokens) | entering, with sequence parallelism |
//! | `ḡ` | reduce-scatter (tokens) | all-gather (tokens) | leaving, with sequence parallelism |
//!
//! Outside TP regions (norms, residual adds) sequence parallelism splits the flat token axis
//! `b·s` into `t` contiguous pieces: those operations are per token, so any split of tokens is
//! exact, and a contiguous one makes gather and scatter plain concatenation.
//!
//! The vocabulary-parallel embedding's row selection is a kernel
//! (`Elementwise::embedding_forward_slice`); the loss is the strategy's
//! ([`TensorParallel::vocab_parallel_xent`]).

use ferrotron_tensor::{Buf, Device, DeviceSlice};

use crate::strategy::TensorParallel;
use crate::HookError;

/// The tensor-parallel strategy of a step, if any.
pub type Tp<'a> = Option<&'a dyn TensorParallel>;

/// `f` / `g` forward: the full-token input of a TP region. `None` means "use `x` itself"
/// (no tensor parallelism, or `f`, whose forward is the identity).
pub fn enter(
    tp: Tp<'_>,
    dev: Device<'_>,
    x: &DeviceSlice<f32>,
) -> Result<Option<Buf<f32>>, HookError> {
    match tp {
        Some(tp) if tp.sequence_parallel() => tp.all_gather(dev, x).map(Some),
        _ => Ok(None),
    }
}

/// `f` / `g` backward: the gradient of a region's input from each rank's partial sum.
pub fn enter_backward(tp: Tp<'_>, dev: Device<'_>, dx: Buf<f32>) -> Result<Buf<f32>, HookError> {
    match tp {
        Some(tp) if tp.sequence_parallel() => tp.reduce_scatter(dev, &dx),
        Some(tp) => tp.all_reduce(dev, &dx),
        None => Ok(dx),
    }
}

/// `f̄` / `ḡ` forward: a region's output from each rank's partial sum.
pub fn exit(tp: Tp<'_>, dev: Device<'_>, y: Buf<f32>) -> Result<Buf<f32>, HookError> {
    enter_backward(tp, dev, y)
}

/// `f̄` / `ḡ` backward: the full-token gradient inside the region (`None`: use `dy` itself).
pub fn exit_backward(
    tp: Tp<'_>,
    dev: Device<'_>,
    dy: &DeviceSlice<f32>,
) -> Result<Option<Buf<f32>>, HookError> {
    enter(tp, dev, dy)
}
