//! Tensor and sequence parallelism (playbook §4): the tensor-parallel group as the model's
//! [`TensorParallel`] strategy. The model writes Megatron's conjugate operators over its
//! collectives (`ferrotron_model::tp`):
//!
//! | operator | forward | backward | where |
//! |---|---|---|---|
//! | `f` | identity | all-reduce | entering a TP region (input replicated) |
//! | `f̄` | all-reduce | identity | leaving a TP region (partial sums) |
//! | `g` | all-gather (tokens) | reduce-scatter (tokens) | entering, with sequence parallelism |
//! | `ḡ` | reduce-scatter (tokens) | all-gather (tokens) | leaving, with sequence parallelism |
//!
//! Also here: the vocabulary-parallel cross-entropy, which reduces the row max (all-gather of
//! `t` maxima per token), the sum of exponentials and the target logit across the group, so
//! full logits never exist on any rank.

use std::sync::atomic::{AtomicU64, Ordering};

use ferrotron_comm::{Comm, CommBuf, CommError, Group, ReduceOp};
use ferrotron_model::strategy::{TensorParallel, VocabHead, VpGrads};
use ferrotron_model::HookError;
use ferrotron_tensor::trace::Tracer;
use ferrotron_tensor::{Buf, Category, Device, DeviceSlice, LinearShape};

/// Bytes and calls of each collective kind one rank issued (its payload sizes).
#[derive(Debug, Default)]
pub struct CommVolume {
    /// All-reduce calls.
    pub all_reduce_calls: AtomicU64,
    /// All-reduce bytes (input size).
    pub all_reduce_bytes: AtomicU64,
    /// All-gather calls.
    pub all_gather_calls: AtomicU64,
    /// All-gather bytes (output size).
    pub all_gather_bytes: AtomicU64,
    /// Reduce-scatter calls.
    pub reduce_scatter_calls: AtomicU64,
    /// Reduce-scatter bytes (input size).
    pub reduce_scatter_bytes: AtomicU64,
}

impl CommVolume {
    /// (all-reduce, all-gather, reduce-scatter) call counts.
    pub fn calls(&self) -> (u64, u64, u64) {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        (
            l(&self.all_reduce_calls),
            l(&self.all_gather_calls),
            l(&self.reduce_scatter_calls),
        )
    }
    /// (all-reduce, all-gather, reduce-scatter) bytes.
    pub fn bytes(&self) -> (u64, u64, u64) {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        (
            l(&self.all_reduce_bytes),
            l(&self.all_gather_bytes),
            l(&self.reduce_scatter_bytes),
        )
    }
    /// Sets every counter to zero.
    pub fn reset(&self) {
        for a in [
            &self.all_reduce_calls,
            &self.all_reduce_bytes,
            &self.all_gather_calls,
            &self.all_gather_bytes,
            &self.reduce_scatter_calls,
            &self.reduce_scatter_bytes,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// This rank's tensor-parallel group.
pub struct TpComm<'a> {
    /// The communicator.
    pub comm: &'a Comm,
    /// The tensor-parallel group.
    pub group: &'a Group,
    /// Whether activations outside TP regions are split along tokens.
    pub sequence_parallel: bool,
    /// Counters of what this rank sent.
    pub volume: &'a CommVolume,
    /// Where waits are recorded (None: not tracing).
    pub trace: Option<&'a Tracer>,
}

fn f32_out(buf: CommBuf) -> Buf<f32> {
    buf.into_f32()
        .unwrap_or_else(|_| unreachable!("f32 collectives return f32"))
}

impl TpComm<'_> {
    /// Sum over the group.
    pub fn all_reduce(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        self.volume.all_reduce_calls.fetch_add(1, Ordering::Relaxed);
        self.volume
            .all_reduce_bytes
            .fetch_add(4 * x.len() as u64, Ordering::Relaxed);
        let out = self
            .comm
            .all_reduce(self.group, CommBuf::copy_of(dev, x), ReduceOp::Sum)
            .wait_in(self.trace, "tensor-parallel");
        Ok(f32_out(out?))
    }

    /// Concatenation of every member's `x` (equal sizes).
    pub fn all_gather(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        self.volume.all_gather_calls.fetch_add(1, Ordering::Relaxed);
        self.volume
            .all_gather_bytes
            .fetch_add(4 * (x.len() * self.group.size()) as u64, Ordering::Relaxed);
        let counts = vec![x.len(); self.group.size()];
        let out = self
            .comm
            .all_gather(self.group, CommBuf::copy_of(dev, x), counts)
            .wait_in(self.trace, "tensor-parallel");
        Ok(f32_out(out?))
    }

    /// This member's equal piece of the sum over the group.
    pub fn reduce_scatter(
        &self,
        dev: Device<'_>,
        x: &DeviceSlice<f32>,
    ) -> Result<Buf<f32>, CommError> {
        self.volume
            .reduce_scatter_calls
            .fetch_add(1, Ordering::Relaxed);
        self.volume
            .reduce_scatter_bytes
            .fetch_add(4 * x.len() as u64, Ordering::Relaxed);
        let counts = vec![x.len() / self.group.size(); self.group.size()];
        let out = self
            .comm
            .reduce_scatter(self.group, CommBuf::copy_of(dev, x), counts)
            .wait_in(self.trace, "tensor-parallel");
        Ok(f32_out(out?))
    }
}

impl TensorParallel for TpComm<'_> {
    fn size(&self) -> usize {
        self.group.size()
    }
    fn index(&self) -> usize {
        self.group.index
    }
    fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }
    fn all_reduce(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError> {
        Ok(TpComm::all_reduce(self, dev, x)?)
    }
    fn all_gather(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError> {
        Ok(TpComm::all_gather(self, dev, x)?)
    }
    fn reduce_scatter(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError> {
        Ok(TpComm::reduce_scatter(self, dev, x)?)
    }
    fn vocab_parallel_xent(
        &self,
        dev: Device<'_>,
        head: VocabHead<'_>,
        x: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        grads: Option<VpGrads<'_>>,
    ) -> Result<f64, HookError> {
        Ok(self.vocab_parallel_xent(dev, head, x, targets, grads)?)
    }
}

impl TpComm<'_> {
    /// The vocabulary-parallel cross-entropy (see
    /// [`TensorParallel::vocab_parallel_xent`]): each chunk of `head.chunk` tokens computes
    /// this rank's logits, reduces the row max and the sum of exponentials over the group,
    /// and (with `grads`) the softmax gradient of its vocabulary slice.
    pub fn vocab_parallel_xent(
        &self,
        dev: Device<'_>,
        head: VocabHead<'_>,
        x: &DeviceSlice<f32>,
        targets: &DeviceSlice<u32>,
        mut grads: Option<VpGrads<'_>>,
    ) -> Result<f64, CommError> {
        let VocabHead {
            w,
            hidden: h,
            v0,
            chunk,
        } = head;
        let (ledger, be) = (dev.ledger, dev.backend);
        let vl = w.len() / h;
        let t = targets.len();
        let chunk = chunk.max(1).min(t.max(1));
        if vl == 0 {
            return self.padding_only_xent(dev, (t, chunk), targets, grads);
        }
        let mut logits = ledger.zeros::<f32>(Category::Workspace, chunk * vl);
        let mut total = 0.0f64;
        for start in (0..t).step_by(chunk) {
            let n = chunk.min(t - start);
            let xc = &x[start * h..(start + n) * h];
            let tg = &targets[start..start + n];
            let lg = &mut logits[..n * vl];
            be.linear_forward(lg, xc.operand(), w.operand(), LinearShape::new(n, h, vl));
            let (lse, loss) = self.chunk_lse(dev, Some(lg), tg, (vl, v0))?;
            total += loss;
            if let Some(g) = grads.as_mut() {
                be.vocab_softmax_grad(lg, tg, &lse, (vl, v0), g.scale);
                be.linear_backward_input(
                    &mut g.dx[start * h..(start + n) * h],
                    lg.operand(),
                    w.operand(),
                    LinearShape::new(n, h, vl),
                    false,
                );
                be.linear_backward_weight(
                    g.dw,
                    lg.operand(),
                    xc.operand(),
                    LinearShape::new(n, h, vl),
                );
            }
        }
        Ok(total)
    }

    /// The cross-entropy on a rank whose vocabulary slice holds padding only (a small
    /// vocabulary padded under TP, [`ferrotron_config::ModelConfig::vocab_rows`]): no logits,
    /// but its part in every chunk's collectives, and a zero input gradient. Its loss is the
    /// group's, as on every rank.
    fn padding_only_xent(
        &self,
        dev: Device<'_>,
        (t, chunk): (usize, usize),
        targets: &DeviceSlice<u32>,
        grads: Option<VpGrads<'_>>,
    ) -> Result<f64, CommError> {
        let mut total = 0.0f64;
        for start in (0..t).step_by(chunk) {
            let n = chunk.min(t - start);
            let (_, loss) = self.chunk_lse(dev, None, &targets[start..start + n], (0, 0))?;
            total += loss;
        }
        if let Some(g) = grads {
            dev.backend.fill(g.dx, 0.0);
        }
        Ok(total)
    }

    /// The log-sum-exp of each of a chunk's rows over the whole vocabulary, from this rank's
    /// logits `lg` (`[n, vl]`, vocabulary rows `[v0, v0 + vl)`; None: the slice is padding
    /// only): the row maxima all-gathered, the sums of exponentials and the target logits
    /// all-reduced. Returns it with the sum of the chunk's token losses.
    fn chunk_lse(
        &self,
        dev: Device<'_>,
        lg: Option<&DeviceSlice<f32>>,
        tg: &DeviceSlice<u32>,
        slice: (usize, usize),
    ) -> Result<(Buf<f64>, f64), CommError> {
        let (n, ranks, be) = (tg.len(), self.group.size(), dev.backend);
        let work = |len| dev.ledger.zeros::<f32>(Category::Workspace, len);
        let mut local_max = work(n);
        match lg {
            Some(lg) => be.logits_row_max(&mut local_max, lg, slice.0),
            None => be.fill(&mut local_max, f32::NEG_INFINITY),
        }
        let maxes = TpComm::all_gather(self, dev, &local_max)?;
        let mut row_max = work(n);
        be.max_over_ranks(&mut row_max, &maxes, ranks);
        // [Σ exp(z − max) over this slice; the target's logit if this slice holds it]
        // (zeros for a slice of padding).
        let mut stats = work(2 * n);
        if let Some(lg) = lg {
            be.logits_exp_stats(&mut stats, lg, tg, &row_max, slice);
        }
        let stats = TpComm::all_reduce(self, dev, &stats)?;
        let mut lse = dev.ledger.zeros::<f64>(Category::Workspace, n);
        let loss = be.vocab_lse(dev.ledger, &mut lse, &row_max, &stats);
        Ok((lse, loss))
    }
}
