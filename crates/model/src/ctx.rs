//! What one forward/backward needs besides weights and gradients: the step's context.

use crate::documents::Documents;
use crate::layout::LayerParams;
use crate::moe::step::MoeStep;
use crate::strategy::{ContextParallel, TensorParallel};
use crate::{GradSink, HookError, WeightSource};
use ferrotron_config::Recompute;
use ferrotron_tensor::trace::{traced, Tracer, Track};
use ferrotron_tensor::{Backend, Buf, Category, DeviceSlice, Ledger, Store, StoreDType};
use std::sync::atomic::{AtomicUsize, Ordering};

/// What one forward/backward needs besides weights and gradients.
pub struct StepCtx<'a> {
    /// The ledger every buffer is counted in.
    pub ledger: &'a Ledger,
    /// The kernels.
    pub backend: &'a dyn Backend,
    /// Storage dtype of saved activations.
    pub act_dtype: StoreDType,
    /// Tokens per LM-head/cross-entropy chunk.
    pub loss_chunk: usize,
    /// The tensor-parallel group (None on one rank).
    pub tp: Option<&'a dyn TensorParallel>,
    /// The context-parallel ring (None without context parallelism): the tokens given to
    /// the model are this rank's zig-zag share of every sequence.
    pub cp: Option<&'a dyn ContextParallel>,
    /// Where layer spans are recorded (None: not tracing).
    pub trace: Option<&'a Tracer>,
    /// The micro-batch being computed, for the trace.
    pub micro_batch: AtomicUsize,
    /// What the forward keeps and the backward recomputes.
    pub recompute: Recompute,
    /// Mixture-of-experts state of the step (inert for a dense model).
    pub moe: MoeStep<'a>,
    /// Document masking: each micro-batch's document starts (None: plain causal attention
    /// over whole windows).
    pub documents: Option<&'a Documents>,
    /// FP8 operands for the blocks' linear layers (`train.fp8`).
    pub fp8: ferrotron_config::Fp8,
    /// FP8 delayed scaling's amax history (`train.fp8_amax_history`; None: each operand is
    /// scaled by its own magnitude).
    pub fp8_history: Option<&'a crate::fp8_history::Fp8History>,
}

impl StepCtx<'_> {
    /// The device this step runs on: its ledger and kernels.
    pub fn device(&self) -> ferrotron_tensor::Device<'_> {
        ferrotron_tensor::Device {
            ledger: self.ledger,
            backend: self.backend,
        }
    }

    /// Runs `f` as a span on the compute track named `what` (`forward`/`backward` …).
    pub(crate) fn span<R>(
        &self,
        cat: &'static str,
        name: impl FnOnce() -> String,
        f: impl FnOnce() -> R,
    ) -> R {
        let mb = || {
            vec![(
                "micro_batch",
                self.micro_batch.load(Ordering::Relaxed).to_string(),
            )]
        };
        match self.trace {
            None => f(),
            Some(t) => {
                t.sample_memory(self.ledger);
                let out = traced(Some(t), Track::Compute, cat, name, mb(), f);
                t.sample_memory(self.ledger);
                out
            }
        }
    }

    /// An f32 buffer that becomes a saved activation: counted as activations in f32 mode
    /// (kept as is), as workspace in bf16 and fp16 modes (rounded into a half copy, then freed).
    pub(crate) fn act_buf(&self, len: usize) -> Buf<f32> {
        self.ledger.zeros(self.act_category(), len)
    }
    /// As [`StepCtx::act_buf`], for an output its kernel overwrites whole: recycled memory
    /// where the ledger keeps some ([`ferrotron_tensor::Ledger::overwritten`]).
    pub(crate) fn act_out(&self, len: usize) -> Buf<f32> {
        self.ledger.overwritten(self.act_category(), len)
    }
    fn act_category(&self) -> Category {
        match self.act_dtype {
            StoreDType::F32 => Category::Activations,
            StoreDType::Bf16 | StoreDType::F16 => Category::Workspace,
        }
    }
    pub(crate) fn keep(&self, data: Buf<f32>) -> Store {
        Store::keep(self.device(), Category::Activations, self.act_dtype, data)
    }
    pub(crate) fn work(&self, len: usize) -> Buf<f32> {
        self.ledger.zeros(Category::Workspace, len)
    }
    /// Workspace for an output its kernel overwrites whole (see [`StepCtx::act_out`]).
    pub(crate) fn work_out(&self, len: usize) -> Buf<f32> {
        self.ledger.overwritten(Category::Workspace, len)
    }
    pub(crate) fn stats(&self, len: usize) -> Buf<f32> {
        self.ledger.zeros(Category::Activations, len)
    }
    /// The current micro-batch's document starts (None without document masking).
    pub(crate) fn document_starts(&self) -> Option<std::sync::Arc<Vec<usize>>> {
        let docs = self.documents?;
        let mb = self.micro_batch.load(Ordering::Relaxed);
        let starts = docs.get(mb);
        assert!(starts.is_some(), "micro-batch {mb} has no document starts");
        starts
    }
    /// Micro-batch `mb`'s backward is done: its routing statistics and document starts go.
    pub fn end_micro_batch(&self, mb: usize) {
        self.moe.end_micro_batch(mb);
        if let Some(docs) = self.documents {
            docs.end(mb);
        }
    }
    pub(crate) fn tp(&self) -> Option<&dyn TensorParallel> {
        self.tp
    }
    pub(crate) fn cp(&self) -> Option<&dyn ContextParallel> {
        self.cp
    }
    /// Tokens of each sequence on this rank: `seq_len`, or `seq_len / cp` under context
    /// parallelism.
    pub fn local_seq(&self, seq_len: usize) -> usize {
        self.cp.map_or(seq_len, |cp| cp.positions().len())
    }
    /// Rows of the residual stream on this rank for `t` tokens: all of them, or this rank's
    /// piece under sequence parallelism.
    pub fn local_rows(&self, t: usize) -> usize {
        self.local_tokens(t)
    }

    pub(crate) fn local_tokens(&self, t: usize) -> usize {
        match self.tp {
            Some(tp) if tp.sequence_parallel() => t / tp.size(),
            _ => t,
        }
    }
    /// Accumulates a norm weight's gradient, which `f` computes over this rank's tokens: under
    /// sequence parallelism each rank saw different tokens, so the partial sums are
    /// all-reduced over the group first.
    pub(crate) fn norm_grad(
        &self,
        grads: &mut dyn GradSink,
        range: std::ops::Range<usize>,
        f: &mut dyn FnMut(&mut DeviceSlice<f32>),
    ) -> Result<(), HookError> {
        match self.tp {
            Some(tp) if tp.sequence_parallel() => {
                let mut partial = self.work(range.len());
                f(&mut partial);
                let total = tp.all_reduce(self.device(), &partial)?;
                grads.accumulate(self.device(), range, &mut |dw| {
                    self.backend.add_assign(dw, &total)
                });
            }
            _ => grads.accumulate(self.device(), range, f),
        }
        Ok(())
    }
}

/// The label of the transfer that brings a micro-batch's token ids (inputs and targets) to
/// the device.
pub const TOKEN_IDS: &str = "token ids";

/// The label of the transfers that carry a mixture of experts' routing tables and
/// statistics between host and device.
pub const ROUTING: &str = "expert routing";

/// What one block's forward or backward is called with besides its activations.
pub(crate) struct BlockCall<'c, 'a> {
    pub(crate) ctx: &'c StepCtx<'a>,
    pub(crate) weights: &'c dyn WeightSource,
    pub(crate) lp: &'c LayerParams,
    /// RoPE positions of this rank's tokens: their global positions within their sequences,
    /// or within their documents under document masking.
    pub(crate) positions: &'c [usize],
    /// Document masking: the global position of each of this rank's tokens' document start.
    pub(crate) starts: Option<&'c [usize]>,
    /// Document masking: the document starts of every token of the windows, `[b, seq_len]`
    /// (context parallelism's strategies take these).
    pub(crate) window_starts: Option<&'c [usize]>,
    /// Sequences in the micro-batch.
    pub(crate) batch: usize,
}

impl StepCtx<'_> {
    /// Micro-batch `mb` (`t` tokens on this rank) has passed every mixture-of-experts block:
    /// its routing statistics become the total its backward uses and its load-balancing loss
    /// is recorded (no-op for a dense model). Under context parallelism each rank routed its
    /// share of every sequence, so the statistics are summed over the ring first.
    pub fn finish_moe_forward(&self, mb: usize, t: usize) -> Result<(), HookError> {
        let Some(sum) = self.moe.take_sum(mb) else {
            return Ok(());
        };
        let Some(cp) = self.cp() else {
            self.moe.set_total(mb, sum, t);
            return Ok(());
        };
        let mut msg = vec![0.0f32; 3 * sum.counts.len()];
        crate::moe::step::encode(&sum, &mut msg);
        let msg = self.ledger.upload(Category::Workspace, ROUTING, &msg);
        let reduced = cp.all_reduce(self.device(), &msg)?;
        let reduced = self.ledger.download(ROUTING, &reduced);
        self.moe
            .set_total(mb, crate::moe::step::decode(&reduced), t * cp.size());
        Ok(())
    }
}
