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
//! Every reordering is a row gather ([`Dispatch::permutation`], [`Dispatch::from_rows`]) on
//! the device, so the exchange runs on any backend. The gathers' tables are built once per
//! attention call and held in the ledger as workspace while it runs.

use ferrotron_comm::{CommBuf, CommError};
use ferrotron_model::strategy::{AttnOut, Qkv, QkvGrads, RingSaved};
use ferrotron_tensor::attention::{AttnSaved, AttnShape};
use ferrotron_tensor::moe::Dispatch;
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::sequences::{whole_backward, whole_forward};
use ferrotron_tensor::{AttnGrads, Buf, Category, Device, DeviceSlice, Held};

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
    d: usize,
    /// For every position of a sequence, (member, index among its tokens).
    owner: Vec<(usize, usize)>,
    /// The row gathers every activation exchange uses (whatever its width).
    tables: Tables,
}

/// The row gathers of the activations' exchanges, and the ledger's count of their bytes.
struct Tables {
    /// This rank's rows `(token, head group)` grouped by the member they go to.
    heads_send: Dispatch,
    /// The rows received, `(member, token)`, into position order.
    heads_recv: Dispatch,
    /// Position-ordered rows grouped by the member that owns the token.
    tokens_send: Dispatch,
    /// The rows received, `(member, token)`, into `(token, head group)`.
    tokens_recv: Dispatch,
    /// Shared key/value heads: each `(token, head)` row to its `share` members (None: not
    /// shared).
    shared: Option<Dispatch>,
    _held: Held,
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
    fn new(cp: &'c CpComm<'a>, dev: Device<'_>, sh: BlockShape) -> Self {
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
        let share = (c / kv).max(1);
        let tables = Tables::new(cp, dev, (sh.batch, n, &owner), (kv, share));
        Shards {
            cp,
            b: sh.batch,
            n,
            c,
            heads: sh.heads / c,
            kv_heads: (kv / c).max(1),
            share,
            d: sh.head_dim,
            owner,
            tables,
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

    /// Rows of `x` (`w` wide) grouped by `send` go out in `c` equal parts, part `j` to member
    /// `j`; the parts received, in member order, are gathered by `recv` into as many rows.
    fn exchange(
        &self,
        dev: Device<'_>,
        (x, w): (&DeviceSlice<f32>, usize),
        (send, recv): (&Dispatch, &Dispatch),
    ) -> Result<Buf<f32>, CommError> {
        let got = self.send(dev, (x, w), send, x.len())?;
        let mut y = dev.ledger.zeros::<f32>(Category::Workspace, x.len());
        dev.backend.moe_gather_rows(&mut y, &got, w, recv);
        Ok(y)
    }

    /// `[b·n, c·w]` (this rank's tokens, every head group of `w` features) to `[b·s, w]`
    /// (this rank's head group of every token, in position order).
    fn to_heads(
        &self,
        dev: Device<'_>,
        x: &DeviceSlice<f32>,
        w: usize,
    ) -> Result<Buf<f32>, CommError> {
        let t = &self.tables;
        self.exchange(dev, (x, w), (&t.heads_send, &t.heads_recv))
    }

    /// The inverse of [`Shards::to_heads`].
    fn to_tokens(
        &self,
        dev: Device<'_>,
        y: &DeviceSlice<f32>,
        w: usize,
    ) -> Result<Buf<f32>, CommError> {
        let t = &self.tables;
        self.exchange(dev, (y, w), (&t.tokens_send, &t.tokens_recv))
    }

    /// Keys or values (`[b·n, kv_local·d]`) to this rank's heads of every token: dealt out as
    /// the queries are, or each head copied to the `share` members that read it.
    fn kv_to_heads(&self, dev: Device<'_>, x: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        let d = self.d;
        let Some(shared) = &self.tables.shared else {
            return self.to_heads(dev, x, self.kv_heads * d);
        };
        let got = self.send(dev, (x, d), shared, x.len() * self.share)?;
        let mut y = dev.ledger.zeros::<f32>(Category::Workspace, got.len());
        dev.backend
            .moe_gather_rows(&mut y, &got, d, &self.tables.heads_recv);
        Ok(y)
    }

    /// Key or value gradients back to the tokens' owners; a shared head's `share` members'
    /// gradients summed.
    fn kv_to_tokens(&self, dev: Device<'_>, y: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        let d = self.d;
        let Some(shared) = &self.tables.shared else {
            return self.to_tokens(dev, y, self.kv_heads * d);
        };
        let got = self.send(dev, (y, d), &self.tables.tokens_send, y.len())?;
        let mut x = dev
            .ledger
            .zeros::<f32>(Category::Workspace, y.len() / self.share);
        dev.backend.moe_scatter_add_rows(&mut x, &got, d, shared);
        Ok(x)
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
        let (send, recv) = (Dispatch::permutation(send), Dispatch::permutation(recv));
        self.exchange(dev, (lse, 1), (&send, &recv))
    }

    /// The inverse of [`Shards::lse_to_tokens`].
    fn lse_to_heads(&self, dev: Device<'_>, lse: &DeviceSlice<f32>) -> Result<Buf<f32>, CommError> {
        let (b, n, c, h) = (self.b, self.n, self.c, self.heads);
        let send = order([c, b, h * n], |j, bi, e| (bi * c + j) * h * n + e);
        let recv = order([b, h, self.seq()], |bi, hh, p| {
            let (j, i) = self.owner[p];
            ((j * b + bi) * h + hh) * n + i
        });
        let (send, recv) = (Dispatch::permutation(send), Dispatch::permutation(recv));
        self.exchange(dev, (lse, 1), (&send, &recv))
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
}

impl Tables {
    /// The gathers for `b` sequences of `n` tokens per member (`owner` of every position),
    /// with `kv_local` key/value heads here, each shared by `share` members.
    fn new(
        cp: &CpComm<'_>,
        dev: Device<'_>,
        (b, n, owner): (usize, usize, &[(usize, usize)]),
        (kv_local, share): (usize, usize),
    ) -> Tables {
        let (c, rows) = (cp.size(), b * n);
        let s = c * n;
        let heads_send = order([c, b, n], |j, bi, i| (bi * n + i) * c + j);
        let heads_recv = order([b, s, 1], |bi, p, _| {
            let (j, i) = owner[p];
            j * rows + bi * n + i
        });
        let tokens_send = order([c, b, n], |j, bi, i| bi * s + cp.member_positions(j)[i]);
        let tokens_recv = order([b, n, c], |bi, i, g| g * rows + bi * n + i);
        let shared = (share > 1).then(|| {
            let row = order([rows, kv_local, share], |t, h, k| {
                (h * share + k) * rows + t
            });
            Dispatch::from_rows(row, share)
        });
        let all = [heads_send, heads_recv, tokens_send, tokens_recv].map(Dispatch::permutation);
        let bytes = all.iter().chain(&shared).map(Dispatch::heap_bytes).sum();
        let [heads_send, heads_recv, tokens_send, tokens_recv] = all;
        Tables {
            heads_send,
            heads_recv,
            tokens_send,
            tokens_recv,
            shared,
            _held: dev.ledger.hold(Category::Workspace, bytes),
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
    let u = Shards::new(cp, dev, sh);
    let qw = u.heads * u.d;
    let (qh, kh, vh) = (
        u.to_heads(dev, q, qw)?,
        u.kv_to_heads(dev, k)?,
        u.kv_to_heads(dev, v)?,
    );
    let zeros = |n: usize| dev.ledger.zeros::<f32>(Category::Workspace, n);
    let (mut out, mut lse) = (zeros(qh.len()), zeros(u.b * u.heads * u.seq()));
    whole_forward(
        dev,
        (&mut out, &mut lse),
        (&qh, &kh, &vh),
        u.shape(),
        starts,
    );
    drop((qh, kh, vh));
    dev.backend.copy(attn.out, &u.to_tokens(dev, &out, qw)?);
    dev.backend.copy(attn.lse, &u.lse_to_tokens(dev, &lse)?);
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
    let u = Shards::new(cp, dev, sh);
    let qw = u.heads * u.d;
    let heads = |x: &DeviceSlice<f32>| u.to_heads(dev, x, qw);
    let (q, k, v) = (
        heads(saved.q)?,
        u.kv_to_heads(dev, saved.k)?,
        u.kv_to_heads(dev, saved.v)?,
    );
    let (out, dout) = (heads(saved.out)?, heads(dout)?);
    let lse = u.lse_to_heads(dev, saved.lse)?;
    let zeros = |n: usize| dev.ledger.zeros::<f32>(Category::Workspace, n);
    let (mut dq, mut dk, mut dv) = (zeros(q.len()), zeros(k.len()), zeros(v.len()));
    let g = AttnGrads {
        dq: &mut dq,
        dk: &mut dk,
        dv: &mut dv,
    };
    let saved = AttnSaved {
        q: &*q,
        k: &*k,
        v: &*v,
        out: &*out,
        lse: &*lse,
    };
    whole_backward(dev, g, &dout, saved, (u.shape(), starts));
    drop((q, k, v, out, dout, lse));
    let be = dev.backend;
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
