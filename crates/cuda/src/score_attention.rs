//! Causal attention over whole sequences as batched products and two row kernels, the way a
//! GPU runs attention's products on cuBLASLt instead of in its tiled kernels:
//!
//! - forward, per chunk of query rows: `S = scale·Q Kᵀ`, then `P = softmax(S)` over the keys
//!   each row sees (with its log-sum-exp), then `O = P V`;
//! - backward, per chunk: `S` again, `P = exp(S − lse)`, `dP = dO Vᵀ`,
//!   `dS = P ∘ (dP − delta)`, then `dV += Pᵀ dO`, `dQ = scale·dS K`, `dK += scale·dSᵀ Q`.
//!
//! A chunk of `rows` query rows starting at `r0` sees keys `0..r0 + rows` (causal), so keys
//! past the chunk are never multiplied. Grouped-query attention: the query heads `g·group + j`
//! (`g` < kv heads) share kv head `g`, so one batched product per `j` covers every kv head.
//! The order of every sum is fixed (chunks and `j` in order), so the gradients are the same
//! from run to run.
//!
//! The plan only computes addresses and shapes; [`ScoreOps`] runs them. The CUDA backend
//! implements it with cuBLASLt and two kernels (`attention.cu`); the tests below implement it
//! on the host and check the plan against the flash-attention kernels of `ferrotron-tensor`.
//! Layouts are those of `ferrotron_tensor::attention`: `q`, `out`, `dq`, `dout`:
//! `[b, s, heads, d]`; `k`, `v`, `dk`, `dv`: `[b, s, kv_heads, d]`; `lse`, `delta`:
//! `[b, heads, s]`. Addresses are in bytes, of f32 elements.

use ferrotron_tensor::attention::AttnShape;

/// Bytes of an f32.
const F32: u64 = 4;

/// One operand of a [`Batched`] product: row-major, `ld` elements between rows, `stride`
/// elements between the matrices of the batch; `trans`: the product reads it transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Operand {
    /// Read transposed.
    pub trans: bool,
    /// Elements between rows.
    pub ld: usize,
    /// Elements between consecutive matrices of the batch.
    pub stride: usize,
}

/// A strided batch of row-major products: for `i < count`,
/// `C_i[m×n] = alpha·op(A_i)[m×k]·op(B_i)[k×n] + beta·C_i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Batched {
    /// Rows of `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// Left operand.
    pub a: Operand,
    /// Right operand.
    pub b: Operand,
    /// The result (`trans` unused).
    pub c: Operand,
    /// Matrices in the batch.
    pub count: usize,
}

/// A column-major operand as cuBLASLt describes it: `rows × cols` as stored, `ld` elements
/// between columns, `stride` between the matrices of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ColumnLayout {
    /// Rows as stored.
    pub rows: usize,
    /// Columns as stored.
    pub cols: usize,
    /// Elements between columns.
    pub ld: usize,
    /// Elements between consecutive matrices.
    pub stride: usize,
}

/// A [`Batched`] product in cuBLASLt's column-major terms. A row-major matrix is the
/// column-major one of its transpose, so `C = op(A)·op(B)` is `Cᵀ = op(B)ᵀ·op(A)ᵀ`: the
/// call's first operand is the row-major `B` (at `B`'s address) and its second the row-major
/// `A`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ColumnMajor {
    /// The first operand is read transposed.
    pub ta: bool,
    /// The second operand is read transposed.
    pub tb: bool,
    /// Rows of the column-major result (the row-major `n`).
    pub m: usize,
    /// Its columns (the row-major `m`).
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// The first operand (the row-major `B`).
    pub a: ColumnLayout,
    /// The second operand (the row-major `A`).
    pub b: ColumnLayout,
    /// The result.
    pub c: ColumnLayout,
    /// Matrices in the batch.
    pub count: usize,
}

impl Batched {
    /// The same product as cuBLASLt's column-major call (see [`ColumnMajor`]).
    pub fn column_major(&self) -> ColumnMajor {
        // A row-major `r × c` operand is stored column-major as `c × r`.
        let stored = |o: Operand, (r, c): (usize, usize)| {
            let (r, c) = if o.trans { (c, r) } else { (r, c) };
            ColumnLayout {
                rows: c,
                cols: r,
                ld: o.ld,
                stride: o.stride,
            }
        };
        ColumnMajor {
            ta: self.b.trans,
            tb: self.a.trans,
            m: self.n,
            n: self.m,
            k: self.k,
            a: stored(self.b, (self.k, self.n)),
            b: stored(self.a, (self.m, self.k)),
            c: stored(self.c, (self.m, self.n)),
            count: self.count,
        }
    }
}

/// The score matrices of one chunk, for the row kernels: `count` matrices (one per kv
/// head) of `rows × cols`, row-major with `cols` elements per row and `rows·cols` between
/// matrices. Row `i` is query position `r0 + i` and sees the columns `j ≤ r0 + i`. Its
/// log-sum-exp (and `delta`) is at element `g·stat_stride + i` of the address given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoreRows {
    /// Matrices (kv heads).
    pub count: usize,
    /// Rows per matrix (the chunk's query rows).
    pub rows: usize,
    /// Columns (the keys the chunk sees).
    pub cols: usize,
    /// The chunk's first query position.
    pub r0: usize,
    /// Elements between the statistics of consecutive matrices.
    pub stat_stride: usize,
}

/// What runs a [`ScorePlan`]: batched products and the three row kernels.
pub trait ScoreOps {
    /// The batched product `g` on the operands at byte addresses `a`, `b`, `c`.
    fn product(&self, g: Batched, a: u64, b: u64, c: u64, alpha: f32, beta: f32);
    /// In place over the masked rows of `s`: `P = softmax(S)` (0 where masked), and each row's
    /// log-sum-exp written to `lse`.
    fn probs_forward(&self, r: ScoreRows, s: u64, lse: u64);
    /// In place: `P = exp(S − lse)` (0 where masked), the forward's probabilities again.
    fn probs_again(&self, r: ScoreRows, s: u64, lse: u64);
    /// In place: `dP ← P ∘ (dP − delta)`, the scores' gradient.
    fn probs_grad(&self, r: ScoreRows, dp: u64, p: u64, delta: u64);
    /// Zeroes `elems` f32 at `x`.
    fn zero(&self, x: u64, elems: usize);
}

/// The forward's tensors (byte addresses).
#[derive(Debug, Clone, Copy)]
pub struct Forward {
    /// Output, `[b, s, heads, d]`.
    pub out: u64,
    /// Log-sum-exp, `[b, heads, s]`.
    pub lse: u64,
    /// Queries.
    pub q: u64,
    /// Keys.
    pub k: u64,
    /// Values.
    pub v: u64,
}

/// The backward's tensors (byte addresses); `delta` (`rowsum(dO ∘ O)`) already computed.
#[derive(Debug, Clone, Copy)]
pub struct Backward {
    /// Query gradient (overwritten).
    pub dq: u64,
    /// Key gradient (overwritten).
    pub dk: u64,
    /// Value gradient (overwritten).
    pub dv: u64,
    /// Output gradient.
    pub dout: u64,
    /// The forward's inputs, output statistics and `delta`.
    pub q: u64,
    /// Keys.
    pub k: u64,
    /// Values.
    pub v: u64,
    /// The forward's log-sum-exp.
    pub lse: u64,
    /// `rowsum(dO ∘ O)`, `[b, heads, s]`.
    pub delta: u64,
}

/// Attention of one shape as chunks of batched products.
#[derive(Debug, Clone, Copy)]
pub struct ScorePlan {
    /// The attention's shape.
    pub shape: AttnShape,
    /// Query rows per chunk.
    pub rows: usize,
}

impl ScorePlan {
    /// The plan for `shape`, in chunks of [`ferrotron_config::attention_score_rows`] rows
    /// (the size the run's workspace was counted for).
    pub fn new(shape: AttnShape) -> ScorePlan {
        let rows = ferrotron_config::attention_score_rows(shape.seq, shape.kv_heads);
        ScorePlan::with_rows(shape, rows)
    }

    /// The plan with chunks of `rows` query rows (at least 1; at most the sequence).
    pub fn with_rows(shape: AttnShape, rows: usize) -> ScorePlan {
        ScorePlan {
            shape,
            rows: rows.clamp(1, shape.seq.max(1)),
        }
    }

    /// Elements of one score buffer: the forward needs one, the backward two.
    pub fn score_elems(&self) -> usize {
        self.shape.kv_heads * self.rows * self.shape.seq
    }

    /// `(r0, rows)` of every chunk, in order.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.shape.seq)
            .step_by(self.rows)
            .map(|r0| (r0, self.rows.min(self.shape.seq - r0)))
    }

    /// Every (sequence, query head within its group, chunk) and where its tensors start.
    fn visits(&self) -> Vec<Visit> {
        let sh = &self.shape;
        let (group, d) = (sh.heads / sh.kv_heads, sh.head_dim);
        let mut out = Vec::new();
        for b in 0..sh.batch {
            for j in 0..group {
                for (r0, r) in self.chunks() {
                    out.push(Visit {
                        q: F32 * (((b * sh.seq + r0) * sh.heads + j) * d) as u64,
                        kv: F32 * (b * sh.seq * sh.kv_heads * d) as u64,
                        stat: F32 * ((b * sh.heads + j) * sh.seq + r0) as u64,
                        rows: ScoreRows {
                            count: sh.kv_heads,
                            rows: r,
                            cols: r0 + r,
                            r0,
                            stat_stride: group * sh.seq,
                        },
                    });
                }
            }
        }
        out
    }

    /// The query-side operand (`q`, `out`, `dq`, `dout`): rows of one head, the group's
    /// heads `group·d` apart.
    fn per_query(&self, trans: bool) -> Operand {
        let sh = &self.shape;
        Operand {
            trans,
            ld: sh.heads * sh.head_dim,
            stride: sh.heads / sh.kv_heads * sh.head_dim,
        }
    }

    /// The key-side operand (`k`, `v`, `dk`, `dv`): one kv head per matrix.
    fn per_kv(&self, trans: bool) -> Operand {
        let sh = &self.shape;
        Operand {
            trans,
            ld: sh.kv_heads * sh.head_dim,
            stride: sh.head_dim,
        }
    }

    /// A chunk's score matrices as an operand.
    fn scores(r: &ScoreRows, trans: bool) -> Operand {
        Operand {
            trans,
            ld: r.cols,
            stride: r.rows * r.cols,
        }
    }

    fn scale(&self) -> f32 {
        1.0 / (self.shape.head_dim as f32).sqrt()
    }

    /// The chunk's query-side rows times the kv heads' rows transposed, into score
    /// matrices: `S = Q Kᵀ`, `dP = dO Vᵀ`.
    fn rows_by_keys(&self, r: &ScoreRows) -> Batched {
        Batched {
            m: r.rows,
            n: r.cols,
            k: self.shape.head_dim,
            a: self.per_query(false),
            b: self.per_kv(true),
            c: Self::scores(r, false),
            count: r.count,
        }
    }

    /// Score matrices times the kv heads' rows, into the chunk's query-side rows:
    /// `O = P V`, `dQ = dS K`.
    fn scores_by_keys(&self, r: &ScoreRows) -> Batched {
        Batched {
            m: r.rows,
            n: self.shape.head_dim,
            k: r.cols,
            a: Self::scores(r, false),
            b: self.per_kv(false),
            c: self.per_query(false),
            count: r.count,
        }
    }

    /// Score matrices transposed times the chunk's query-side rows, added into the kv
    /// heads' rows: `dV += Pᵀ dO`, `dK += dSᵀ Q`.
    fn scores_to_keys(&self, r: &ScoreRows) -> Batched {
        Batched {
            m: r.cols,
            n: self.shape.head_dim,
            k: r.rows,
            a: Self::scores(r, true),
            b: self.per_query(false),
            c: self.per_kv(false),
            count: r.count,
        }
    }

    /// The forward: `out` and `lse` of causal attention, with `s` a buffer of
    /// [`Self::score_elems`] f32.
    pub fn forward(&self, ops: &dyn ScoreOps, t: Forward, s: u64) {
        for v in self.visits() {
            let r = &v.rows;
            ops.product(
                self.rows_by_keys(r),
                t.q + v.q,
                t.k + v.kv,
                s,
                self.scale(),
                0.0,
            );
            ops.probs_forward(*r, s, t.lse + v.stat);
            ops.product(self.scores_by_keys(r), s, t.v + v.kv, t.out + v.q, 1.0, 0.0);
        }
    }

    /// The backward: `dq`, `dk`, `dv` (overwritten) from `dout`, with `s` and `dp` two
    /// buffers of [`Self::score_elems`] f32 each.
    pub fn backward(&self, ops: &dyn ScoreOps, t: Backward, s: u64, dp: u64) {
        let sh = &self.shape;
        let kv_elems = sh.batch * sh.seq * sh.kv_heads * sh.head_dim;
        ops.zero(t.dk, kv_elems);
        ops.zero(t.dv, kv_elems);
        let scale = self.scale();
        for v in self.visits() {
            let r = &v.rows;
            let (q, kv) = (v.q, v.kv);
            ops.product(self.rows_by_keys(r), t.q + q, t.k + kv, s, scale, 0.0);
            ops.probs_again(*r, s, t.lse + v.stat);
            ops.product(self.rows_by_keys(r), t.dout + q, t.v + kv, dp, 1.0, 0.0);
            ops.probs_grad(*r, dp, s, t.delta + v.stat);
            // Key-side gradients, added chunk after chunk.
            let to_kv = self.scores_to_keys(r);
            ops.product(to_kv, s, t.dout + q, t.dv + kv, 1.0, 1.0);
            ops.product(to_kv, dp, t.q + q, t.dk + kv, scale, 1.0);
            ops.product(self.scores_by_keys(r), dp, t.k + kv, t.dq + q, scale, 0.0);
        }
    }
}

/// One chunk of one query head of one sequence: byte offsets of its first query row, its
/// sequence's keys and its statistics, and its score matrices.
struct Visit {
    q: u64,
    kv: u64,
    stat: u64,
    rows: ScoreRows,
}

#[cfg(test)]
mod tests;
