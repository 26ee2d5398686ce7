//! Context parallelism (playbook §4): the sequence is split over the context-parallel group in
//! zig-zag order, and attention runs as a ring: the model's [`ContextParallel`] strategy.
//!
//! Every operation outside attention is per token, so a rank simply computes its own tokens.
//! Attention needs every earlier key: each rank keeps its queries and passes its key/value
//! block (after RoPE, `kv_heads` wide — never expanded for grouped-query attention) to the
//! next rank of the ring, merging the partial results with the online softmax
//! ([`Backend::attention_merge`](ferrotron_tensor::kernels::AttentionKernels::attention_merge)). Rank `r` sees the blocks of ranks `r, r−1, r−2, …` in turn.
//!
//! Overlap: the send of the block in hand and the receive of the next one are posted before
//! the block is computed, so the transfer runs on the communication worker meanwhile.
//!
//! Backward runs the same ring. The key/value block travels as in the forward, and right
//! behind it an accumulator of its `dk`/`dv`: each rank adds what its queries contribute to
//! the visiting block and passes the sum on; after `c` steps every accumulator is back with
//! the block's owner, holding the gradient from every rank's queries.
//!
//! Ordering: a receive blocks the rank's communication queue until its message arrives, so
//! every rank issues its ring operations in the same order, and each receive only depends on
//! a send its neighbour issued earlier in that order (see [`ring_backward`]).

use ferrotron_comm::{Comm, CommBuf, CommError, DType, Group, Handle};
use ferrotron_config::CpKind;
use ferrotron_model::strategy::{AttnOut, ContextParallel, Qkv, QkvGrads, RingSaved};
use ferrotron_model::HookError;
use ferrotron_tensor::ring_attention::{zigzag_positions, BlockShape, SplitError};
use ferrotron_tensor::trace::Tracer;
use ferrotron_tensor::{AttnGrads, Buf, Category, Device, DeviceSlice, KvBlock, RingBlock};

pub mod ulysses;

/// Tag of the key/value blocks travelling around the ring (forward and backward).
const KV_TAG: u64 = 7_000;
/// Tag of the `dk`/`dv` accumulators travelling around the ring in backward.
const GRAD_TAG: u64 = 7_001;

/// This rank's context-parallel group, as the model sees it.
pub struct CpComm<'a> {
    /// The communicator.
    pub comm: &'a Comm,
    /// The context-parallel group; the ring follows its order.
    pub group: &'a Group,
    /// Where waits are recorded (None: not tracing).
    pub trace: Option<&'a Tracer>,
    /// Global positions (within a sequence) of every member's tokens, by group index.
    blocks: Vec<Vec<usize>>,
    /// How attention runs over the group: the ring, or Ulysses' all-to-all
    /// ([`ulysses`]).
    kind: CpKind,
}

impl<'a> CpComm<'a> {
    /// The context-parallel group `group` for sequences of `seq_len` tokens, split in zig-zag
    /// order, running attention as `kind` says.
    ///
    /// # Errors
    /// [`SplitError::Uneven`] unless `2 · group size` divides `seq_len`.
    pub fn new(
        comm: &'a Comm,
        group: &'a Group,
        (seq_len, kind): (usize, CpKind),
        trace: Option<&'a Tracer>,
    ) -> Result<Self, SplitError> {
        let c = group.size();
        let blocks = (0..c)
            .map(|r| zigzag_positions(seq_len, c, r))
            .collect::<Result<_, _>>()?;
        Ok(CpComm {
            comm,
            group,
            trace,
            blocks,
            kind,
        })
    }

    /// Ranks in the ring.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// Global positions of this rank's tokens within each sequence.
    pub fn positions(&self) -> &[usize] {
        &self.blocks[self.group.index]
    }

    /// Global positions of member `j`'s tokens within each sequence.
    pub(crate) fn member_positions(&self, j: usize) -> &[usize] {
        &self.blocks[j]
    }

    /// This rank's queries' document starts (`[b, n]`) from those of whole windows
    /// (`[b, seq_len]`).
    fn query_starts(&self, window: &[usize], batch: usize) -> Vec<usize> {
        let s = window.len() / batch.max(1);
        let pos = self.positions();
        (0..batch)
            .flat_map(|bi| pos.iter().map(move |&p| window[bi * s + p]))
            .collect()
    }

    /// World rank of the next member (blocks go there).
    fn next(&self) -> usize {
        self.group.ranks[(self.group.index + 1) % self.size()]
    }

    /// World rank of the previous member (blocks come from there).
    fn prev(&self) -> usize {
        self.group.ranks[(self.group.index + self.size() - 1) % self.size()]
    }

    /// Group index of the member whose block this rank holds at ring step `step`.
    fn block_at(&self, step: usize) -> usize {
        (self.group.index + self.size() - step % self.size()) % self.size()
    }

    fn wait(&self, handle: Handle<CommBuf>) -> Result<Buf<f32>, CommError> {
        let buf = handle.wait_in(self.trace, "context-parallel")?;
        buf.into_f32().map_err(|_| CommError::Backend {
            op: "recv",
            rank: self.comm.rank(),
            message: "the ring sends f32 blocks".into(),
        })
    }

    /// Sends `[a | b]` (a copy, counted as communication) to the next rank and posts the
    /// receive of the previous rank's message of the same size and tag.
    fn pass_on(
        &self,
        dev: Device<'_>,
        tag: u64,
        a: &DeviceSlice<f32>,
        b: &DeviceSlice<f32>,
    ) -> (Handle<()>, Handle<CommBuf>) {
        let sent = self.comm.send(self.next(), tag, pack(dev, a, b));
        let incoming = self
            .comm
            .recv(self.prev(), tag, a.len() + b.len(), DType::F32);
        (sent, incoming)
    }
}

/// `[a | b]` as one communication buffer.
fn pack(dev: Device<'_>, a: &DeviceSlice<f32>, b: &DeviceSlice<f32>) -> CommBuf {
    let mut buf = dev
        .ledger
        .zeros::<f32>(Category::Communication, a.len() + b.len());
    dev.backend.copy(&mut buf[..a.len()], a);
    dev.backend.copy(&mut buf[a.len()..], b);
    CommBuf::F32(buf)
}

/// Ring attention forward: `out` and `lse` of this rank's queries over every rank's keys and
/// values (`q, out: [b·n, heads·d]`, `k, v: [b·n, kv_heads·d]`, `lse: [b, heads, n]`);
/// under document masking `starts` holds the document start of every token of the windows
/// (`[b, seq_len]`), and each query sees only its own document's keys
/// ([`KvBlock::q_start`]).
pub fn ring_forward(
    cp: &CpComm<'_>,
    dev: Device<'_>,
    attn: AttnOut<'_>,
    (q, k, v): Qkv<'_>,
    (sh, starts): (BlockShape, Option<&[usize]>),
) -> Result<(), CommError> {
    let AttnOut { out, lse } = attn;
    let (ledger, be) = (dev.ledger, dev.backend);
    let q_start = starts.map(|w| cp.query_starts(w, sh.batch));
    let c = cp.size();
    let kv = k.len();
    // The block in hand after step 0 (a received buffer): [k | v].
    let mut held: Option<Buf<f32>> = None;
    let mut part_out = ledger.zeros::<f32>(Category::Workspace, out.len());
    let mut part_lse = ledger.zeros::<f32>(Category::Workspace, lse.len());
    for step in 0..c {
        let (kb, vb) = held.as_deref().map_or((k, v), |b| b.split_at(kv));
        let next = (step + 1 < c).then(|| cp.pass_on(dev, KV_TAG, kb, vb));
        let kv_pos = &cp.blocks[cp.block_at(step)];
        let block = KvBlock {
            q_pos: cp.positions(),
            kv_pos,
            q_start: q_start.as_deref(),
            shape: sh,
        };
        if step == 0 {
            be.attention_block_forward(out, lse, q, kb, vb, block);
        } else {
            be.attention_block_forward(&mut part_out, &mut part_lse, q, kb, vb, block);
            be.attention_merge(out, lse, &part_out, &part_lse, sh);
        }
        if let Some((sent, incoming)) = next {
            let block = cp.wait(incoming)?;
            sent.wait()?;
            held = Some(block);
        }
    }
    Ok(())
}

/// Ring attention backward: overwrites `dq` with the gradient of this rank's queries and `dk`,
/// `dv` with the gradient of this rank's keys and values from every rank's queries.
///
/// Per step `s` (block `j = r − s`), each rank issues, in this order: the send of block `j`
/// and the receive of block `j − 1` (not on the last step); the receive of block `j`'s
/// accumulator (not on step 0, where the chain starts); after computing, the send of the
/// accumulator. Each receive waits for a send the previous rank issued earlier in the same
/// sequence, so the ring cannot deadlock; the accumulator's transfer overlaps the compute.
pub fn ring_backward(
    cp: &CpComm<'_>,
    dev: Device<'_>,
    grads: QkvGrads<'_>,
    dout: &DeviceSlice<f32>,
    saved: RingSaved<'_>,
    (sh, starts): (BlockShape, Option<&[usize]>),
) -> Result<(), CommError> {
    let QkvGrads { dq, dk, dv } = grads;
    let (ledger, be) = (dev.ledger, dev.backend);
    let q_start = starts.map(|w| cp.query_starts(w, sh.batch));
    let c = cp.size();
    let RingSaved { q, k, v, out, lse } = saved;
    let kv = k.len();
    let mut delta = ledger.zeros::<f32>(Category::Workspace, lse.len());
    be.attention_delta(&mut delta, dout, out, sh);
    be.fill(dq, 0.0);
    // This rank's share of the visiting block's gradient, before it joins the accumulator.
    let mut part_dk = ledger.zeros::<f32>(Category::Workspace, kv);
    let mut part_dv = ledger.zeros::<f32>(Category::Workspace, kv);
    let mut held: Option<Buf<f32>> = None;
    let mut sends = Vec::with_capacity(2 * c);
    for step in 0..c {
        let (kb, vb) = held.as_deref().map_or((k, v), |b| b.split_at(kv));
        let next = (step + 1 < c).then(|| cp.pass_on(dev, KV_TAG, kb, vb));
        let acc_in = (step > 0).then(|| cp.comm.recv(cp.prev(), GRAD_TAG, 2 * kv, DType::F32));
        let kv_pos = &cp.blocks[cp.block_at(step)];
        let saved = RingBlock {
            q,
            k: kb,
            v: vb,
            lse,
            delta: &delta,
        };
        let block = KvBlock {
            q_pos: cp.positions(),
            kv_pos,
            q_start: q_start.as_deref(),
            shape: sh,
        };
        let grads = AttnGrads {
            dq,
            dk: &mut part_dk,
            dv: &mut part_dv,
        };
        be.attention_block_backward(grads, dout, saved, block);
        let acc = match acc_in {
            None => pack(dev, &part_dk, &part_dv),
            Some(handle) => {
                // [dk | dv] of block j from the ranks before this one, plus this rank's share.
                let mut acc = cp.wait(handle)?;
                let (adk, adv) = acc.split_at_mut(kv);
                be.add_assign(adk, &part_dk);
                be.add_assign(adv, &part_dv);
                CommBuf::F32(acc)
            }
        };
        sends.push(cp.comm.send(cp.next(), GRAD_TAG, acc));
        if let Some((sent, incoming)) = next {
            let block = cp.wait(incoming)?;
            sends.push(sent);
            held = Some(block);
        }
    }
    drop(held);
    // The accumulator of this rank's own block, back from the last rank it visited.
    let home = cp.wait(cp.comm.recv(cp.prev(), GRAD_TAG, 2 * kv, DType::F32))?;
    be.copy(dk, &home[..kv]);
    be.copy(dv, &home[kv..]);
    for sent in sends {
        sent.wait()?;
    }
    Ok(())
}

impl ContextParallel for CpComm<'_> {
    fn size(&self) -> usize {
        self.group.size()
    }
    fn positions(&self) -> &[usize] {
        CpComm::positions(self)
    }
    fn attention_forward(
        &self,
        dev: Device<'_>,
        out: AttnOut<'_>,
        qkv: Qkv<'_>,
        sh: BlockShape,
        starts: Option<&[usize]>,
    ) -> Result<(), HookError> {
        Ok(match self.kind {
            CpKind::Ring => ring_forward(self, dev, out, qkv, (sh, starts)),
            CpKind::Ulysses => ulysses::ulysses_forward(self, dev, out, qkv, (sh, starts)),
        }?)
    }
    fn attention_backward(
        &self,
        dev: Device<'_>,
        grads: QkvGrads<'_>,
        dout: &DeviceSlice<f32>,
        saved: RingSaved<'_>,
        sh: BlockShape,
        starts: Option<&[usize]>,
    ) -> Result<(), HookError> {
        let shape = (sh, starts);
        Ok(match self.kind {
            CpKind::Ring => ring_backward(self, dev, grads, dout, saved, shape),
            CpKind::Ulysses => ulysses::ulysses_backward(self, dev, grads, dout, saved, shape),
        }?)
    }
    fn all_reduce(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, HookError> {
        let reduced = self
            .comm
            .all_reduce(
                self.group,
                CommBuf::copy_of(dev, x),
                ferrotron_comm::ReduceOp::Sum,
            )
            .wait_in(self.trace, "context-parallel")?;
        Ok(reduced
            .into_f32()
            .unwrap_or_else(|_| unreachable!("f32 collectives return f32")))
    }
}
/// Causal attention work per context-parallel rank (one sequence, all layers' heads): the
/// zig-zag split the engine uses against the contiguous split it avoids (`train --dry-run`
/// prints it for a model of `seq_len` tokens over `c` ranks).
pub fn balance_report(
    m: &ferrotron_config::ModelConfig,
    c: usize,
) -> Result<String, ferrotron_tensor::ring_attention::SplitError> {
    use ferrotron_tensor::ring_attention::{block_flops, contiguous_positions, zigzag_positions};
    let s = m.seq_len;
    let mut out =
        String::from("attention FLOPs per context-parallel rank (forward, one sequence):\n");
    for (name, split) in [
        (
            "zig-zag (used)",
            zigzag_positions as fn(usize, usize, usize) -> _,
        ),
        ("contiguous", contiguous_positions),
    ] {
        let ranks = (0..c)
            .map(|r| split(s, c, r))
            .collect::<Result<Vec<_>, _>>()?;
        // Every rank's queries meet every rank's keys once around the ring.
        let work: Vec<f64> = ranks
            .iter()
            .map(|q| {
                let per_head: u64 = ranks
                    .iter()
                    .map(|k| block_flops(q, k, 1, m.head_dim()))
                    .sum();
                (per_head * (m.heads * m.layers) as u64) as f64
            })
            .collect();
        let (lo, hi) = work
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &w| (lo.min(w), hi.max(w)));
        let list: Vec<String> = work.iter().map(|w| format!("{:.3e}", w)).collect();
        out.push_str(&format!(
            "  {name:<15} {}  max/min − 1 = {:.1}%\n",
            list.join(" "),
            100.0 * (hi / lo - 1.0)
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod balance_tests {
    #[test]
    fn the_zigzag_split_balances_causal_attention_and_the_contiguous_one_does_not() {
        let m = ferrotron_config::ModelConfig {
            seq_len: 64,
            ..Default::default()
        };
        let report = super::balance_report(&m, 2).unwrap();
        let line = |name: &str| {
            report
                .lines()
                .find(|l| l.contains(name))
                .unwrap()
                .to_string()
        };
        assert!(line("zig-zag").ends_with("max/min − 1 = 0.0%"), "{report}");
        // Contiguous halves of 32 tokens: the second rank's queries meet 3× the keys
        // (32·(32+1)/2 + 32·32 against 32·(32+1)/2 pairs): max/min − 1 = 193.9%.
        assert!(
            line("contiguous").ends_with("max/min − 1 = 193.9%"),
            "{report}"
        );
    }
}
