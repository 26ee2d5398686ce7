//! The routing tables of expert parallelism: which token rows of a mixture-of-experts block
//! go to which member of the expert-parallel group and come back, over the
//! [`ExpertParallel`] strategy's all-to-all (implemented in `parallel/src/expert_parallel.rs`).
//!
//! The `ep` ranks of an expert-parallel group each hold `L = E/ep` consecutive experts
//! (member `j`: experts `[j·L, (j+1)·L)`). A rank's routed rows are grouped by expert
//! ([`Dispatch`](ferrotron_tensor::moe::Dispatch)), so the rows for member `j` are one
//! contiguous block and a forward dispatch is:
//!
//! 1. an all-to-all of the per-expert counts (`L` numbers to each member), so every rank
//!    learns how many rows it receives from each member for each of its experts;
//! 2. an all-to-all of the rows with those uneven counts; they arrive source-major
//!    (member, then expert) and are regrouped expert-major so that each held expert sees one
//!    contiguous block (member, then token order inside it: deterministic);
//! 3. after the experts ran, the inverse regrouping and the mirrored all-to-all return every
//!    row to its origin, in the origin's grouped order.
//!
//! Backward mirrors this: the gradient of the combined output travels like the tokens (step
//! 2), the experts' input gradient like their output (step 3). With `ep = 1` (no group) the
//! exchange is the identity.

use ferrotron_tensor::{Buf, Category, Device, DeviceSlice};

use crate::ctx::ROUTING;
use crate::strategy::ExpertParallel;
use crate::HookError;

/// The expert-parallel strategy of a step, if any.
type Ep<'a> = Option<&'a dyn ExpertParallel>;

/// Who sends how many rows to whom for one block and one micro-batch.
#[derive(Debug, Clone)]
pub struct Exchange {
    members: usize,
    local: usize,
    /// Rows this rank sends to each member.
    send: Vec<usize>,
    /// Rows received from member `i` for held expert `e`, at `[i·local + e]`.
    recv: Vec<usize>,
}

impl Exchange {
    /// Bytes of its row tables on the heap.
    pub fn heap_bytes(&self) -> usize {
        (self.send.len() + self.recv.len()) * std::mem::size_of::<usize>()
    }

    /// The exchange of a rank whose grouped rows per expert are `counts` (`[E]`), holding
    /// `local = E/ep` experts. Collective over the group (the counts all-to-all).
    pub fn plan(
        ep: Ep<'_>,
        dev: Device<'_>,
        counts: &[usize],
        local: usize,
    ) -> Result<Exchange, HookError> {
        let members = counts.len() / local;
        let send: Vec<usize> = counts.chunks(local).map(|c| c.iter().sum()).collect();
        let recv = match ep {
            None => counts.to_vec(),
            Some(ep) => {
                // Counts are at most t·k, exact in f32 below 2²⁴ rows.
                let c: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
                let c = dev.ledger.upload(Category::Workspace, ROUTING, &c);
                let got = ep.all_to_all(dev, &c, vec![local; members], vec![local; members])?;
                let got = dev.ledger.download(ROUTING, &got);
                got.iter().map(|&c| c as usize).collect()
            }
        };
        Ok(Exchange {
            members,
            local,
            send,
            recv,
        })
    }

    /// Rows each held expert receives (from all members together), `[local]`.
    pub fn expert_rows(&self) -> Vec<usize> {
        (0..self.local)
            .map(|e| {
                (0..self.members)
                    .map(|i| self.recv[i * self.local + e])
                    .sum()
            })
            .collect()
    }

    /// Total rows received.
    pub fn received(&self) -> usize {
        self.recv.iter().sum()
    }

    /// (source-major start, expert-major start, rows) of every (member, expert) block.
    fn blocks(&self) -> Vec<(usize, usize, usize)> {
        let per_expert = self.expert_rows();
        let mut expert_start: Vec<usize> = per_expert
            .iter()
            .scan(0, |acc, n| {
                let s = *acc;
                *acc += n;
                Some(s)
            })
            .collect();
        let mut out = Vec::with_capacity(self.recv.len());
        let mut src = 0;
        for i in 0..self.members {
            for (e, start) in expert_start.iter_mut().enumerate() {
                let n = self.recv[i * self.local + e];
                out.push((src, *start, n));
                src += n;
                *start += n;
            }
        }
        out
    }

    fn regroup(
        &self,
        dev: Device<'_>,
        rows: &DeviceSlice<f32>,
        width: usize,
        to_experts: bool,
    ) -> Buf<f32> {
        let mut out = dev.ledger.zeros::<f32>(Category::Workspace, rows.len());
        for (src, dst, n) in self.blocks() {
            let (from, to) = if to_experts { (src, dst) } else { (dst, src) };
            dev.backend.copy(
                &mut out[to * width..(to + n) * width],
                &rows[from * width..(from + n) * width],
            );
        }
        out
    }

    /// Sends grouped rows (`[t·k, width]`, by expert) to their experts' ranks; returns the
    /// rows this rank's experts process, expert-major (`[received, width]`). Without expert
    /// parallelism they are already that, and come back as they are.
    pub fn dispatch(
        &self,
        ep: Ep<'_>,
        dev: Device<'_>,
        rows: Buf<f32>,
        width: usize,
    ) -> Result<Buf<f32>, HookError> {
        let Some(ep) = ep else {
            return Ok(rows);
        };
        let send = self.send.iter().map(|n| n * width).collect();
        let recv = self.per_member(width);
        let arrived = ep.all_to_all(dev, &rows, send, recv)?;
        drop(rows);
        Ok(self.regroup(dev, &arrived, width, true))
    }

    /// The inverse of [`Exchange::dispatch`]: rows of this rank's experts (expert-major) go
    /// back to where they came from; returns this rank's grouped rows (`[t·k, width]`).
    pub fn combine(
        &self,
        ep: Ep<'_>,
        dev: Device<'_>,
        rows: Buf<f32>,
        width: usize,
    ) -> Result<Buf<f32>, HookError> {
        let Some(ep) = ep else {
            return Ok(rows);
        };
        let source_major = self.regroup(dev, &rows, width, false);
        drop(rows);
        let send = self.per_member(width);
        let recv = self.send.iter().map(|n| n * width).collect();
        ep.all_to_all(dev, &source_major, send, recv)
    }

    /// Elements received from each member, `width` per row.
    fn per_member(&self, width: usize) -> Vec<usize> {
        self.recv
            .chunks(self.local)
            .map(|c| c.iter().sum::<usize>() * width)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regrouping_is_a_permutation_and_its_inverse() {
        // 2 members × 2 held experts; rows received: member 0 → (1, 2), member 1 → (3, 0).
        let x = Exchange {
            members: 2,
            local: 2,
            send: vec![0, 0],
            recv: vec![1, 2, 3, 0],
        };
        assert_eq!(x.expert_rows(), vec![4, 2]);
        let ledger = ferrotron_tensor::Ledger::new();
        let dev = Device {
            ledger: &ledger,
            backend: &ferrotron_tensor::CpuBackend::default(),
        };
        let rows: Vec<f32> = (0..6).map(|r| r as f32).collect();
        let rows = ledger.upload(Category::Workspace, "test", &rows);
        let experts = x.regroup(dev, &rows, 1, true);
        // Expert 0: member 0's row 0, member 1's rows 3..6; expert 1: member 0's rows 1, 2.
        assert_eq!(
            ledger.download("test", &experts),
            [0.0, 3.0, 4.0, 5.0, 1.0, 2.0]
        );
        let back = x.regroup(dev, &experts, 1, false);
        assert_eq!(
            ledger.download("test", &back),
            (0..6).map(|r| r as f32).collect::<Vec<_>>()
        );
    }
}
