//! Tensor and sequence parallelism, in Megatron's vocabulary of conjugate operators:
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
//! Also here: the vocabulary-parallel embedding and the vocabulary-parallel cross-entropy,
//! which reduces the row max (all-gather of `t` maxima per token), the sum of exponentials
//! and the target logit across the group, so full logits never exist on any rank.

use std::sync::atomic::{AtomicU64, Ordering};

use ferrotron_comm::{Comm, CommBuf, CommError, Group, ReduceOp};
use ferrotron_tensor::linear::{linear_backward_input, linear_backward_weight, linear_forward};
use ferrotron_tensor::trace::Tracer;
use ferrotron_tensor::{Buf, Category, Ledger};
use rayon::prelude::*;

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
    fn size(&self) -> usize {
        self.group.size()
    }

    /// Sum over the group.
    pub fn all_reduce(&self, ledger: &Ledger, x: &[f32]) -> Result<Buf<f32>, CommError> {
        self.volume.all_reduce_calls.fetch_add(1, Ordering::Relaxed);
        self.volume
            .all_reduce_bytes
            .fetch_add(4 * x.len() as u64, Ordering::Relaxed);
        let out = self
            .comm
            .all_reduce(
                self.group,
                CommBuf::from_f32_slice(ledger, x),
                ReduceOp::Sum,
            )
            .wait_in(self.trace, "tensor-parallel");
        Ok(f32_out(out?))
    }

    /// Concatenation of every member's `x` (equal sizes).
    pub fn all_gather(&self, ledger: &Ledger, x: &[f32]) -> Result<Buf<f32>, CommError> {
        self.volume.all_gather_calls.fetch_add(1, Ordering::Relaxed);
        self.volume
            .all_gather_bytes
            .fetch_add(4 * (x.len() * self.size()) as u64, Ordering::Relaxed);
        let counts = vec![x.len(); self.size()];
        let out = self
            .comm
            .all_gather(self.group, CommBuf::from_f32_slice(ledger, x), counts)
            .wait_in(self.trace, "tensor-parallel");
        Ok(f32_out(out?))
    }

    /// This member's equal piece of the sum over the group.
    pub fn reduce_scatter(&self, ledger: &Ledger, x: &[f32]) -> Result<Buf<f32>, CommError> {
        self.volume
            .reduce_scatter_calls
            .fetch_add(1, Ordering::Relaxed);
        self.volume
            .reduce_scatter_bytes
            .fetch_add(4 * x.len() as u64, Ordering::Relaxed);
        let counts = vec![x.len() / self.size(); self.size()];
        let out = self
            .comm
            .reduce_scatter(self.group, CommBuf::from_f32_slice(ledger, x), counts)
            .wait_in(self.trace, "tensor-parallel");
        Ok(f32_out(out?))
    }
}

/// `f` / `g` forward: the full-token input of a TP region. `None` means "use `x` itself"
/// (no tensor parallelism, or `f`, whose forward is the identity).
pub fn enter(
    tp: Option<&TpComm<'_>>,
    ledger: &Ledger,
    x: &[f32],
) -> Result<Option<Buf<f32>>, CommError> {
    match tp {
        Some(tp) if tp.sequence_parallel => tp.all_gather(ledger, x).map(Some),
        _ => Ok(None),
    }
}

/// `f` / `g` backward: the gradient of a region's input from each rank's partial sum.
pub fn enter_backward(
    tp: Option<&TpComm<'_>>,
    ledger: &Ledger,
    dx: Buf<f32>,
) -> Result<Buf<f32>, CommError> {
    match tp {
        Some(tp) if tp.sequence_parallel => tp.reduce_scatter(ledger, &dx),
        Some(tp) => tp.all_reduce(ledger, &dx),
        None => Ok(dx),
    }
}

/// `f̄` / `ḡ` forward: a region's output from each rank's partial sum.
pub fn exit(tp: Option<&TpComm<'_>>, ledger: &Ledger, y: Buf<f32>) -> Result<Buf<f32>, CommError> {
    enter_backward(tp, ledger, y)
}

/// `f̄` / `ḡ` backward: the full-token gradient inside the region (`None`: use `dy` itself).
pub fn exit_backward(
    tp: Option<&TpComm<'_>>,
    ledger: &Ledger,
    dy: &[f32],
) -> Result<Option<Buf<f32>>, CommError> {
    enter(tp, ledger, dy)
}

/// Vocabulary-parallel embedding forward: rows of tokens this rank's slice `[v0, v0+vl)`
/// holds, zeros elsewhere (the partial sums `exit` reduces).
pub fn embedding_forward_slice(x: &mut [f32], table: &[f32], tokens: &[u32], h: usize, v0: usize) {
    let vl = table.len() / h;
    x.par_chunks_mut(h)
        .zip(tokens.par_iter())
        .for_each(|(row, &t)| {
            let t = t as usize;
            if (v0..v0 + vl).contains(&t) {
                row.copy_from_slice(&table[(t - v0) * h..(t - v0 + 1) * h]);
            } else {
                row.fill(0.0);
            }
        });
}

/// Vocabulary-parallel embedding backward: accumulates the rows this rank owns.
pub fn embedding_backward_slice(
    dtable: &mut [f32],
    dx: &[f32],
    tokens: &[u32],
    h: usize,
    v0: usize,
) {
    let vl = dtable.len() / h;
    for (row, &t) in dx.chunks(h).zip(tokens) {
        let t = t as usize;
        if (v0..v0 + vl).contains(&t) {
            dtable[(t - v0) * h..(t - v0 + 1) * h]
                .iter_mut()
                .zip(row)
                .for_each(|(d, g)| *d += g);
        }
    }
}

/// Gradients wanted from [`vocab_parallel_xent`].
pub struct VpGrads<'a> {
    /// This rank's partial `d loss / d x`, `[t, h]` (sum over ranks = the gradient).
    pub dx: &'a mut [f32],
    /// `d loss / d W_local`, accumulated.
    pub dw: &'a mut [f32],
    /// Multiplier of every token's loss.
    pub scale: f32,
}

/// Sum over tokens of the cross-entropy of `x · Wᵀ` where this rank holds vocabulary rows
/// `[v0, v0 + vl)` of `W` (`w`: `[vl, h]`). Identical on every member.
#[allow(clippy::too_many_arguments)]
pub fn vocab_parallel_xent(
    tp: &TpComm<'_>,
    ledger: &Ledger,
    x: &[f32],
    w: &[f32],
    targets: &[u32],
    h: usize,
    v0: usize,
    chunk: usize,
    mut grads: Option<VpGrads<'_>>,
) -> Result<f64, CommError> {
    let vl = w.len() / h;
    let t = targets.len();
    let chunk = chunk.max(1).min(t.max(1));
    let ranks = tp.size();
    let mut logits = ledger.zeros::<f32>(Category::Workspace, chunk * vl);
    let mut total = 0.0f64;
    for start in (0..t).step_by(chunk) {
        let n = chunk.min(t - start);
        let xc = &x[start * h..(start + n) * h];
        let tg = &targets[start..start + n];
        let lg = &mut logits[..n * vl];
        linear_forward(lg, xc, w, n, h, vl);
        let local_max: Vec<f32> = lg
            .par_chunks(vl)
            .map(|r| r.iter().cloned().fold(f32::NEG_INFINITY, f32::max))
            .collect();
        let maxes = tp.all_gather(ledger, &local_max)?;
        let row_max: Vec<f32> = (0..n)
            .map(|i| {
                (0..ranks)
                    .map(|r| maxes[r * n + i])
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect();
        // [Σ exp(z − max) over this slice; the target's logit if this slice holds it]
        let mut stats = vec![0.0f32; 2 * n];
        for i in 0..n {
            let row = &lg[i * vl..(i + 1) * vl];
            stats[i] = row
                .iter()
                .map(|&z| ((z - row_max[i]) as f64).exp())
                .sum::<f64>() as f32;
            let target = tg[i] as usize;
            if (v0..v0 + vl).contains(&target) {
                stats[n + i] = row[target - v0];
            }
        }
        let stats = tp.all_reduce(ledger, &stats)?;
        let lse: Vec<f64> = (0..n)
            .map(|i| row_max[i] as f64 + (stats[i] as f64).ln())
            .collect();
        total += (0..n).map(|i| lse[i] - stats[n + i] as f64).sum::<f64>();
        if let Some(g) = grads.as_mut() {
            let scale = g.scale;
            lg.par_chunks_mut(vl)
                .zip(tg.par_iter())
                .zip(lse.par_iter())
                .for_each(|((row, &target), &lse)| {
                    for z in row.iter_mut() {
                        *z = ((*z as f64 - lse).exp() as f32) * scale;
                    }
                    let target = target as usize;
                    if (v0..v0 + vl).contains(&target) {
                        row[target - v0] -= scale;
                    }
                });
            linear_backward_input(
                &mut g.dx[start * h..(start + n) * h],
                lg,
                w,
                n,
                h,
                vl,
                false,
            );
            linear_backward_weight(g.dw, lg, xc, n, h, vl);
        }
    }
    Ok(total)
}
