//! Ulysses context parallelism (DeepSpeed-Ulysses; torchtitan's and Megatron's all-to-all
//! context parallelism): `parallel.cp_kind = "ulysses"`.
//!
//! Outside attention a rank holds its zig-zag share of every sequence, as under the ring
//! ([`super`]). Around attention an all-to-all swaps the sequence shards for
//! head shards: member `j` of `c` receives query heads `[j·a/c, (j+1)·a/c)` (and key/value heads
//! `[j·a_kv/c, (j+1)·a_kv/c)`) of every member's tokens, placed in position order, and runs
//! attention over whole sequences on them — the same kernels a single rank runs, document
//! masking included. A second all-to-all brings the outputs (and log-sum-exps) back to the
//! tokens' owners.
//!
//! Cost per block: forward, the queries, keys and values out and the output and log-sum-exp
//! back (each rank sends `(c−1)/c` of its `q, k, v, out`); backward, the queries, keys,
//! values, output, its gradient and the log-sum-exp out again (nothing is kept between the
//! passes) and the three gradients back. Memory: head-sharded copies of those tensors while
//! attention runs, each as large as the rank's own. It needs each tensor-parallel rank's
//! heads divisible by `c`, and its key/value heads divisible by `c` or dividing it: with fewer
//! key/value heads than ranks (grouped-query attention over many ranks), each key/value head
//! goes to every rank whose query heads read it, and their gradients are summed on the way
//! back (checked by the configuration).
//!
//! Every reordering is a row gather ([`Dispatch::permutation`]) on the device, so the
//! exchange runs on any backend.

use ferrotron_comm::{CommBuf, CommError};
use ferrotron_model::strategy::{AttnOut, Qkv, QkvGrads, RingSaved};
use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::moe::Dispatch;
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::{AttnGrads, Buf, Category, Device, DeviceSlice, KvBlock, RingBlock};

use super::CpComm;

/// One attention call's shards: `b` sequences, `n` tokens of each per member, `c` members,
/// `heads` and `kv_heads` per member after the exchange, head dimension `d`. With fewer
/// key/value heads than members (`kv_local < c`), each key/value head goes to the `share`
/// members whose query heads read it, and their gradients are summed on the way back.
struct Shards<'c, 'a> {
    cp: &'c CpComm<'a>,
    b: usize,
    n: usize,
    c: usize,
    heads: usize,
    kv_heads: usize,
    /// Members sharing one key/value head (1: each has heads of its own).
    share: usize,
    /// Key/value heads of this rank's tokens before the exchange.
    kv_local: usize,
    d: usize,
    /// For every position of a sequence, (member, index among its tokens).
    owner: Vec<(usize, usize)>,
}

/// The flattened index order of a three-level loop: `f(x, y, z)` for `x < dims[0]`, then `y`,
/// then `z`.
fn order<T>(dims: [usize; 3], f: impl Fn(usize, usize, usize) -> T) -> Vec<T> {
    let mut out = Vec::with_capacity(dims.iter().product());
    for x in 0..dims[0] {
        for y in 0..dims[1] {
            for z in 0..dims[2] {
                out.push(f(x, y, z));
            }
        }
    }
    out
}

impl<'c, 'a> Shards<'c, 'a> {
    fn new(cp: &'c CpComm<'a>, sh: BlockShape) -> Self {
        let c = cp.size();
        let kv = sh.kv_heads;
        assert!(
            sh.heads.is_multiple_of(c) && (kv.is_multiple_of(c) || c.is_multiple_of(kv)),
            "Ulysses deals {} heads and {kv} key/value heads over {c} ranks",
            sh.heads,
        );
        let n = sh.q_len;
        let mut owner = vec![(0, 0); c * n];
        for j in 0..c {
            for (i, &p) in cp.member_positions(j).iter().enumerate() {
                owner[p] = (j, i);
            }
        }
        Shards {
            cp,
            b: sh.batch,
            n,
            c,
            heads: sh.heads / c,
            kv_heads: (kv / c).max(1),
            share: (c / kv).max(1),
            kv_local: kv,
            d: sh.head_dim,
            owner,
        }
    }

    /// Tokens per sequence.
    fn seq(&self) -> usize {
        self.c * self.n
    }

    /// Rows of `x` (`w` wide) grouped by `send` ([`gather_rows`](ferrotron_tensor::moe::gather_rows)
    /// into `c` equal parts of `len` floats in all) go out, part `j` to member `j`; returns what
    /// the members sent here, in member order.
    fn send(
        &self,
        dev: Device<'_>,
        (x, w): (&DeviceSlice<f32>, usize),
        send: &Dispatch,
        len: usize,
    ) -> Result<Buf<f32>, CommError> {
        let mut out = dev.ledger.zeros::<f32>(Category::Communication, len);
        dev.backend.moe_gather_rows(&mut out, x, w, send);
        let counts = vec![len / self.c; self.c];
        let got = self
            .cp
            .comm
            .all_to_all(self.cp.group, CommBuf::F32(out), counts.clone(), counts)
            .wait_in(self.cp.trace, "context-parallel")?;
        got.into_f32().map_err(|_| CommError::Backend {
            op: "all_to_all",
            rank: self.cp.comm.rank(),
            message: "Ulysses exchanges f32 rows".into(),
        })
    }

    /// Rows of `x` (`w` wide) in the order `send` go out in `c` equal parts, part `j` to
    /// member `j`; the parts received, in member order, are gathered in the order `recv`.
    fn exchange(
        &self,
        dev: Device<'_>,
        x: &DeviceSlice<f32>,
        w: usize,
        (send, recv): (Vec<usize>, Vec<usize>),
    ) -> Result<Buf<f32>, CommError> {
        let got = self.send(dev, (x, w), &Dispatch::permutation(send), x.len())?;
        let mut y = dev.ledger.zeros::<f32>(Category::Workspace, x.len());
        dev.backend
            .moe_gather_rows(&mut y, &got, w, &Dispatch::permutation(recv));
        Ok(y)
    }

    /// Where each (token, key/value head) row of this rank goes when its `share` members each
    /// get a copy: slot `s` of head `h` to member `h·share + s`, in member order.
    fn shared_rows(&self) -> Dispatch {
        let (rows, r) = (self.b * self.n, self.share);
        let row = order([rows, self.kv_local, r], |t, h, s| (h * r + s) * rows + t);
        Dispatch::from_rows(row, r)
    }

    /// The key or value heads `x` (`[b·n, kv_local·d]`) to this rank's shared head of every
    /// token, `[b·s, d]` in position order (`kv_local < c`).
    fn shared_to_heads(
        &self,
        dev: Device<'_>,
        x: &DeviceSlice<f32>,
    ) -> Result<Buf<f32>, CommError> {
        let (b, n, d) = (self.b, self.n, self.d);
        let got = self.send(dev, (x, d), &self.shared_rows(), x.len() * self.share)?;
        let recv = order([b, self.seq(), 1], |bi, p, _| {
            let (j, i) = self.owner[p];
            j * b * n + bi * n + i
        });
        let mut y = dev.ledger.zeros::<f32>(Category::Workspace, got.len());
        dev.backend
            .moe_gather_rows(&mut y, &got, d, &Dispatch::permutation(recv));
        Ok(y)
    }

    /// The adjoint of [`Shards::shared_to_heads`]: every member's gradient of its shared head
    /// back to the tokens' owners, the `share` members' gradients of one head summed.
    fn shared_to_tokens(
        &self,
        dev: Device<'_>,
        y: &DeviceSlice<f32>,
    ) -> Result<Buf<f32>, CommError> {
        let (b, n, c, s, d) = (self.b, self.n, self.c, self.seq(), self.d);
        let send = order([c, b, n], |j, bi, i| {
            bi * s + self.cp.member_positions(j)[i]
        });
        let got = self.send(dev, (y, d), &Dispatch::permutation(send), y.len())?;
        let mut x = dev
            .ledger
            .zeros::<f32>(Category::Workspace, y.len() / self.share);
        dev.backend
            .moe_scatter_add_rows(&mut x, &got, d, &self.shared_rows());
        Ok(x)
    }

    /// Keys or values to this rank's heads: dealt out, or shared by `share` members.
    fn kv_to_heads(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        match self.share {
            1 => self.to_heads(dev, x, self.kv_heads * self.d),
            _ => self.shared_to_heads(dev, x),
        }
    }

    /// Key or value gradients back to the tokens' owners.
    fn kv_to_tokens(&self, dev: Device<'_>, y: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        match self.share {
            1 => self.to_tokens(dev, y, self.kv_heads * self.d),
            _ => self.shared_to_tokens(dev, y),
        }
    }

    /// `[b·n, c·w]` (this rank's tokens, every head group of `w` features) to `[b·s, w]`
    /// (this rank's head group of every token, in position order).
    fn to_heads(
        &self,
        dev: Device<'_>,
        x: &DeviceSlice<f32>,
        w: usize,
    ) -> Result<Buf<f32>, CommError> {
        let (b, n, c) = (self.b, self.n, self.c);
        let send = order([c, b, n], |j, bi, i| (bi * n + i) * c + j);
        let recv = order([b, self.seq(), 1], |bi, p, _| {
            let (j, i) = self.owner[p];
            j * b * n + bi * n + i
        });
        self.exchange(dev, x, w, (send, recv))
    }

    /// The inverse of [`Shards::to_heads`].
    fn to_tokens(
        &self,
        dev: Device<'_>,
        y: &DeviceSlice<f32>,
        w: usize,
    ) -> Result<Buf<f32>, CommError> {
        let (b, n, c, s) = (self.b, self.n, self.c, self.seq());
        let send = order([c, b, n], |j, bi, i| {
            bi * s + self.cp.member_positions(j)[i]
        });
        let recv = order([b, n, c], |bi, i, g| g * b * n + bi * n + i);
        self.exchange(dev, y, w, (send, recv))
    }

    /// Log-sum-exps `[b, heads, s]` of this rank's head group to `[b, c·heads, n]` of its
    /// tokens.
    fn lse_to_tokens(
        &self,
        dev: Device<'_>,
        lse: &DeviceSlice<f32>,
    ) -> Result<Buf<f32>, CommError> {
        let (b, n, c, h, s) = (self.b, self.n, self.c, self.heads, self.seq());
        let send: Vec<usize> = order([c, b, h], |j, bi, hh| (j, bi, hh))
            .into_iter()
            .flat_map(|(j, bi, hh)| {
                let row = (bi * h + hh) * s;
                self.cp.member_positions(j).iter().map(move |&p| row + p)
            })
            .collect();
        let recv = order([b, c, h * n], |bi, g, e| (g * b + bi) * h * n + e);
        self.exchange(dev, lse, 1, (send, recv))
    }

    /// The inverse of [`Shards::lse_to_tokens`].
    fn lse_to_heads(&self, dev: Device<'_>, lse: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        let (b, n, c, h) = (self.b, self.n, self.c, self.heads);
        let send = order([c, b, h * n], |j, bi, e| (bi * c + j) * h * n + e);
        let recv = order([b, h, self.seq()], |bi, hh, p| {
            let (j, i) = self.owner[p];
            ((j * b + bi) * h + hh) * n + i
        });
        self.exchange(dev, lse, 1, (send, recv))
    }

    /// Whole sequences of this rank's head group, as one rank attends them.
    fn shape(&self) -> AttnShape {
        AttnShape {
            batch: self.b,
            seq: self.seq(),
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.d,
        }
    }

    /// The same under document masking: one block of positions `0..s` with the windows'
    /// document starts.
    fn document_block<'p>(&self, pos: &'p [usize], starts: &'p [usize]) -> KvBlock<'p> {
        let s = self.seq();
        KvBlock {
            q_pos: pos,
            kv_pos: pos,
            q_start: Some(starts),
            shape: BlockShape {
                batch: self.b,
                q_len: s,
                kv_len: s,
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_dim: self.d,
            },
        }
    }
}

/// Ulysses' attention forward: `out` and `lse` of this rank's tokens (as
/// [`super::ring_forward`] gives them), with `starts` the windows' document
/// starts under document masking (`[b, seq_len]`).
pub fn ulysses_forward(
    cp: &CpComm<'_>,
    dev: Device<'_>,
    attn: AttnOut<'_>,
    (q, k, v): Qkv<'_>,
    (sh, starts): (BlockShape, Option<&[usize]>),
) -> Result<(), CommError> {
    let u = Shards::new(cp, sh);
    let qw = u.heads * u.d;
    let (qh, kh, vh) = (
        u.to_heads(dev, q, qw)?,
        u.kv_to_heads(dev, k)?,
        u.kv_to_heads(dev, v)?,
    );
    let (be, ledger) = (dev.backend, dev.ledger);
    let mut out = ledger.zeros::<f32>(Category::Workspace, qh.len());
    let mut lse = ledger.zeros::<f32>(Category::Workspace, u.b * u.heads * u.seq());
    match starts {
        None => be.attention_forward(&mut out, &mut lse, &qh, &kh, &vh, u.shape()),
        Some(starts) => {
            let pos: Vec<usize> = (0..u.seq()).collect();
            let block = u.document_block(&pos, starts);
            be.attention_block_forward(&mut out, &mut lse, &qh, &kh, &vh, block);
        }
    }
    drop((qh, kh, vh));
    be.copy(attn.out, &u.to_tokens(dev, &out, qw)?);
    be.copy(attn.lse, &u.lse_to_tokens(dev, &lse)?);
    Ok(())
}

/// Ulysses' attention backward: overwrites `dq`, `dk`, `dv` of this rank's tokens.
pub fn ulysses_backward(
    cp: &CpComm<'_>,
    dev: Device<'_>,
    grads: QkvGrads<'_>,
    dout: &DeviceSlice<f32>,
    saved: RingSaved<'_>,
    (sh, starts): (BlockShape, Option<&[usize]>),
) -> Result<(), CommError> {
    let u = Shards::new(cp, sh);
    let qw = u.heads * u.d;
    let heads = |x: &DeviceSlice<f32>, w: usize| u.to_heads(dev, x, w);
    let (q, k, v) = (
        heads(saved.q, qw)?,
        u.kv_to_heads(dev, saved.k)?,
        u.kv_to_heads(dev, saved.v)?,
    );
    let (out, dout) = (heads(saved.out, qw)?, heads(dout, qw)?);
    let lse = u.lse_to_heads(dev, saved.lse)?;
    let (be, ledger) = (dev.backend, dev.ledger);
    let zeros = |n: usize| ledger.zeros::<f32>(Category::Workspace, n);
    let (mut dq, mut dk, mut dv) = (zeros(q.len()), zeros(k.len()), zeros(v.len()));
    let mut delta = zeros(lse.len());
    let g = AttnGrads {
        dq: &mut dq,
        dk: &mut dk,
        dv: &mut dv,
    };
    match starts {
        None => {
            let saved = AttnSaved {
                q: &*q,
                k: &*k,
                v: &*v,
                out: &*out,
                lse: &*lse,
            };
            be.attention_backward(g, &mut delta, &dout, saved, u.shape());
        }
        Some(starts) => {
            let pos: Vec<usize> = (0..u.seq()).collect();
            let block = u.document_block(&pos, starts);
            be.attention_delta(&mut delta, &dout, &out, block.shape);
            let ring = RingBlock {
                q: &q,
                k: &k,
                v: &v,
                lse: &lse,
                delta: &delta,
            };
            be.attention_block_backward(g, &dout, ring, block);
        }
    }
    drop((q, k, v, out, dout, lse, delta));
    be.copy(grads.dq, &u.to_tokens(dev, &dq, qw)?);
    be.copy(grads.dk, &u.kv_to_tokens(dev, &dk)?);
    be.copy(grads.dv, &u.kv_to_tokens(dev, &dv)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::order;

    #[test]
    fn orders_run_the_last_index_fastest() {
        assert_eq!(
            order([2, 1, 3], |x, _, z| 10 * x + z),
            [0, 1, 2, 10, 11, 12]
        );
    }
}
