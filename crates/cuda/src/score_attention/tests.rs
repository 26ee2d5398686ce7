//! The plan run on the host ([`HostOps`]: plain loops with the semantics the CUDA backend's
//! cuBLASLt products and row kernels have) against `ferrotron-tensor`'s flash attention.

use super::*;
use ferrotron_tensor::attention::{attention_backward, attention_forward, AttnSaved};
use std::cell::RefCell;

/// One f32 arena; an address is a byte offset into it.
struct HostOps {
    mem: RefCell<Vec<f32>>,
}

impl HostOps {
    fn at(addr: u64) -> usize {
        assert_eq!(addr % F32, 0, "unaligned f32 address {addr}");
        (addr / F32) as usize
    }

    /// Calls `f` on every row of `r`'s matrices at `s`: (g, i, row index of the first
    /// element, visible columns).
    fn rows(r: ScoreRows, s: u64, mut f: impl FnMut(usize, usize, usize, usize)) {
        for g in 0..r.count {
            for i in 0..r.rows {
                let start = Self::at(s) + g * r.rows * r.cols + i * r.cols;
                f(g, i, start, (r.r0 + i + 1).min(r.cols));
            }
        }
    }
}

impl ScoreOps for HostOps {
    fn product(&self, g: Batched, a: u64, b: u64, c: u64, alpha: f32, beta: f32) {
        let mut m = self.mem.borrow_mut();
        let idx = |o: Operand, base: u64, batch: usize, r: usize, col: usize| {
            let (r, col) = if o.trans { (col, r) } else { (r, col) };
            Self::at(base) + batch * o.stride + r * o.ld + col
        };
        for x in 0..g.count {
            for i in 0..g.m {
                for j in 0..g.n {
                    let mut sum = 0.0f64;
                    for l in 0..g.k {
                        sum += m[idx(g.a, a, x, i, l)] as f64 * m[idx(g.b, b, x, l, j)] as f64;
                    }
                    let ci = idx(g.c, c, x, i, j);
                    let old = if beta == 0.0 { 0.0 } else { beta * m[ci] };
                    m[ci] = alpha * sum as f32 + old;
                }
            }
        }
    }
    fn probs_forward(&self, r: ScoreRows, s: u64, lse: u64) {
        let mut m = self.mem.borrow_mut();
        Self::rows(r, s, |g, i, start, seen| {
            let row = &mut m[start..start + r.cols];
            let max = row[..seen]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row[..seen].iter().map(|&x| (x - max).exp()).sum();
            for (j, x) in row.iter_mut().enumerate() {
                *x = if j < seen {
                    (*x - max).exp() / sum
                } else {
                    0.0
                };
            }
            m[Self::at(lse) + g * r.stat_stride + i] = max + sum.ln();
        });
    }
    fn probs_again(&self, r: ScoreRows, s: u64, lse: u64) {
        let mut m = self.mem.borrow_mut();
        Self::rows(r, s, |g, i, start, seen| {
            let l = m[Self::at(lse) + g * r.stat_stride + i];
            for (j, x) in m[start..start + r.cols].iter_mut().enumerate() {
                *x = if j < seen { (*x - l).exp() } else { 0.0 };
            }
        });
    }
    fn probs_grad(&self, r: ScoreRows, dp: u64, p: u64, delta: u64) {
        let mut m = self.mem.borrow_mut();
        let shift = Self::at(p) as isize - Self::at(dp) as isize;
        Self::rows(r, dp, |g, i, start, _| {
            let dl = m[Self::at(delta) + g * r.stat_stride + i];
            for j in start..start + r.cols {
                let pj = m[(j as isize + shift) as usize];
                m[j] = pj * (m[j] - dl);
            }
        });
    }
    fn zero(&self, x: u64, elems: usize) {
        let at = Self::at(x);
        self.mem.borrow_mut()[at..at + elems].fill(0.0);
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Places `parts` one after another in an arena (with a gap of 3 floats between them, so no
/// address is accidentally that of a neighbour); their byte addresses.
fn arena(parts: &[&[f32]]) -> (HostOps, Vec<u64>) {
    let mut mem = Vec::new();
    let mut at = Vec::new();
    for p in parts {
        mem.extend_from_slice(&[7.0; 3]);
        at.push(F32 * mem.len() as u64);
        mem.extend_from_slice(p);
    }
    (
        HostOps {
            mem: RefCell::new(mem),
        },
        at,
    )
}

fn read(ops: &HostOps, addr: u64, n: usize) -> Vec<f32> {
    let at = HostOps::at(addr);
    ops.mem.borrow()[at..at + n].to_vec()
}

/// Largest |a − b| / (max |b| + 1e-30) over the whole tensor.
fn normwise(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    err / (scale + 1e-30)
}

fn check(sh: AttnShape, rows: usize) {
    let (nq, nkv, ns) = (
        sh.batch * sh.seq * sh.heads * sh.head_dim,
        sh.batch * sh.seq * sh.kv_heads * sh.head_dim,
        sh.batch * sh.heads * sh.seq,
    );
    let (q, k, v, dout) = (values(nq, 1), values(nkv, 2), values(nkv, 3), values(nq, 4));
    // The flash kernels: the reference.
    let (mut out, mut lse) = (vec![0.0; nq], vec![0.0; ns]);
    attention_forward(&mut out, &mut lse, &q, &k, &v, sh);
    let (mut dq, mut dk, mut dv, mut delta) =
        (vec![0.0; nq], vec![0.0; nkv], vec![0.0; nkv], vec![0.0; ns]);
    let saved = AttnSaved {
        q: &q[..],
        k: &k[..],
        v: &v[..],
        out: &out[..],
        lse: &lse[..],
    };
    attention_backward(&mut dq, &mut dk, &mut dv, &mut delta, &dout, saved, sh);
    // The plan.
    let plan = ScorePlan::with_rows(sh, rows);
    let e = plan.score_elems();
    let junk = values(nq.max(nkv).max(e), 9);
    let (ops, at) = arena(&[
        &q,
        &k,
        &v,
        &dout,
        &junk[..nq],
        &junk[..ns],
        &delta,
        &junk[..nq],
        &junk[..nkv],
        &junk[..nkv],
        &junk[..e],
        &junk[..e],
    ]);
    let [q_, k_, v_, do_, o_, l_, de_, dq_, dk_, dv_, s_, dp_] = at[..] else {
        unreachable!()
    };
    let fwd = Forward {
        out: o_,
        lse: l_,
        q: q_,
        k: k_,
        v: v_,
    };
    plan.forward(&ops, fwd, s_);
    let what = format!("{sh:?}, {} rows per chunk", plan.rows);
    assert!(normwise(&read(&ops, o_, nq), &out) < 1e-5, "out: {what}");
    assert!(normwise(&read(&ops, l_, ns), &lse) < 1e-6, "lse: {what}");
    let bwd = Backward {
        dq: dq_,
        dk: dk_,
        dv: dv_,
        dout: do_,
        q: q_,
        k: k_,
        v: v_,
        lse: l_,
        delta: de_,
    };
    plan.backward(&ops, bwd, s_, dp_);
    for (name, at, want) in [("dq", dq_, &dq), ("dk", dk_, &dk), ("dv", dv_, &dv)] {
        let err = normwise(&read(&ops, at, want.len()), want);
        assert!(err < 1e-5, "{name}: normwise error {err:e}, {what}");
    }
    // Nothing outside the outputs and scratch was written: the inputs are as they were.
    assert_eq!(read(&ops, q_, nq), q);
    assert_eq!(read(&ops, k_, nkv), k);
    assert_eq!(read(&ops, de_, ns), delta);
}

fn shape(batch: usize, seq: usize, heads: usize, kv_heads: usize, head_dim: usize) -> AttnShape {
    AttnShape {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
    }
}

#[test]
fn chunks_of_every_size_match_flash_attention_with_grouped_heads() {
    let sh = shape(2, 37, 4, 2, 8);
    for rows in [1, 5, 16, 36, 37, 64] {
        check(sh, rows);
    }
}

#[test]
fn one_kv_head_per_query_head_and_one_for_all_match_flash_attention() {
    check(shape(1, 24, 3, 3, 16), 7);
    check(shape(3, 19, 4, 1, 12), 8);
}

#[test]
fn the_plans_scores_are_half_the_workspace_the_run_counts() {
    // The 1B Llama's attention (8 kv heads of 2,048 positions): chunks of 512 rows.
    let sh = shape(4, 2048, 32, 8, 64);
    let plan = ScorePlan::new(sh);
    assert_eq!(plan.rows, 512);
    let model = ferrotron_config::ModelConfig {
        heads: 32,
        kv_heads: 8,
        seq_len: 2048,
        ..Default::default()
    };
    let counted = ferrotron_config::device_attention_score_bytes(
        &model,
        &Default::default(),
        ferrotron_config::Attention::Products,
    );
    assert_eq!(2 * 4 * plan.score_elems() as u64, counted);
    // Never more rows than positions.
    assert_eq!(ScorePlan::new(shape(2, 100, 4, 2, 8)).rows, 100);
}

/// cuBLAS's strided batched product, column-major, as its documentation defines it.
fn column_major_product(g: ColumnMajor, a: &[f32], b: &[f32], c: &mut [f32]) {
    let at = |l: ColumnLayout, x: usize, i: usize, j: usize| x * l.stride + i + j * l.ld;
    for x in 0..g.count {
        for i in 0..g.m {
            for j in 0..g.n {
                let mut sum = 0.0f64;
                for l in 0..g.k {
                    let av = if g.ta {
                        a[at(g.a, x, l, i)]
                    } else {
                        a[at(g.a, x, i, l)]
                    };
                    let bv = if g.tb {
                        b[at(g.b, x, j, l)]
                    } else {
                        b[at(g.b, x, l, j)]
                    };
                    sum += av as f64 * bv as f64;
                }
                c[at(g.c, x, i, j)] = sum as f32;
            }
        }
    }
}

#[test]
fn the_column_major_call_computes_the_row_major_product() {
    let (m, n, k, count) = (5, 3, 4, 2);
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        // Padded leading dimensions and strides, as attention's operands have.
        let a = Operand {
            trans: ta,
            ld: if ta { m + 2 } else { k + 1 },
            stride: 40,
        };
        let b = Operand {
            trans: tb,
            ld: if tb { k + 3 } else { n + 1 },
            stride: 31,
        };
        let c = Operand {
            trans: false,
            ld: n + 2,
            stride: 27,
        };
        let g = Batched {
            m,
            n,
            k,
            a,
            b,
            c,
            count,
        };
        let (av, bv) = (values(80, 11), values(62, 12));
        let (ops, at) = arena(&[&av, &bv, &[0.0; 54]]);
        ops.product(g, at[0], at[1], at[2], 1.0, 0.0);
        let want = read(&ops, at[2], 54);
        let mut got = vec![0.0; 54];
        // The call's first operand is the row-major B, its second the row-major A; stored
        // as cuBLASLt validates them: op(first) is n × k, op(second) k × m, the result n × m.
        let cm = g.column_major();
        let dims = |l: ColumnLayout, t: bool| {
            if t {
                (l.cols, l.rows)
            } else {
                (l.rows, l.cols)
            }
        };
        assert_eq!((cm.m, cm.n, cm.k), (n, m, k));
        assert_eq!(dims(cm.a, cm.ta), (n, k));
        assert_eq!(dims(cm.b, cm.tb), (k, m));
        assert_eq!((cm.c.rows, cm.c.cols), (n, m));
        column_major_product(cm, &bv, &av, &mut got);
        for x in 0..count {
            for i in 0..m {
                for j in 0..n {
                    let e = x * c.stride + i * c.ld + j;
                    assert!((got[e] - want[e]).abs() < 1e-6, "{ta} {tb} ({x}, {i}, {j})");
                }
            }
        }
        assert!(want.iter().any(|&x| x != 0.0));
    }
}
