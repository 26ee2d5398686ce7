//! Document masking against attention run on each document alone: the packed, masked kernels
//! (whole sequences, ring blocks under both splits, keys in any order) give every document's
//! output, log-sum-exp and gradients as if it were a sequence of its own.

use super::*;
use crate::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};

const H: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const QW: usize = H * D;
const KW: usize = HKV * D;

fn data(n: usize, f: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * f).sin()).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The packed inputs: `batch` sequences of `seq` tokens, each cut into documents at `cuts`.
struct Packed {
    seq: usize,
    cuts: Vec<Vec<usize>>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dout: Vec<f32>,
}

/// What attention gives: `[out, lse, dq, dk, dv]` in the packed layout.
type Results = [Vec<f32>; 5];

impl Packed {
    fn new(seq: usize, cuts: Vec<Vec<usize>>) -> Packed {
        let b = cuts.len();
        Packed {
            seq,
            cuts,
            q: data(b * seq * QW, 0.37),
            k: data(b * seq * KW, 0.71),
            v: data(b * seq * KW, 0.13),
            dout: data(b * seq * QW, 0.29),
        }
    }

    fn batch(&self) -> usize {
        self.cuts.len()
    }

    /// `[batch · seq]`: where each token's document starts.
    fn starts(&self) -> Vec<usize> {
        let mut s = Vec::new();
        for cuts in &self.cuts {
            s.extend((0..self.seq).map(|i| cuts.iter().rev().find(|&&c| c <= i).copied().unwrap()));
        }
        s
    }

    /// Documents as (sequence, first token, end).
    fn documents(&self) -> Vec<(usize, usize, usize)> {
        let mut docs = Vec::new();
        for (b, cuts) in self.cuts.iter().enumerate() {
            for (i, &c) in cuts.iter().enumerate() {
                docs.push((b, c, cuts.get(i + 1).copied().unwrap_or(self.seq)));
            }
        }
        docs
    }

    /// The reference: every document through the whole-sequence kernels on its own.
    fn reference(&self) -> Results {
        let (b, s) = (self.batch(), self.seq);
        let mut r: Results = [
            vec![0.0; b * s * QW],
            vec![0.0; b * H * s],
            vec![0.0; b * s * QW],
            vec![0.0; b * s * KW],
            vec![0.0; b * s * KW],
        ];
        for (bi, a, e) in self.documents() {
            let n = e - a;
            let rows = |x: &[f32], w: usize| x[(bi * s + a) * w..(bi * s + e) * w].to_vec();
            let (q, k, v, dout) = (
                rows(&self.q, QW),
                rows(&self.k, KW),
                rows(&self.v, KW),
                rows(&self.dout, QW),
            );
            let sh = AttnShape {
                batch: 1,
                seq: n,
                heads: H,
                kv_heads: HKV,
                head_dim: D,
            };
            let (mut out, mut lse) = (vec![0.0; n * QW], vec![0.0; H * n]);
            attention_forward(&mut out, &mut lse, &q, &k, &v, sh);
            let (mut dq, mut dk, mut dv) =
                (vec![0.0; n * QW], vec![0.0; n * KW], vec![0.0; n * KW]);
            let mut delta = vec![0.0; lse.len()];
            let saved: AttnSaved = AttnSaved {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &lse,
            };
            attention_backward(&mut dq, &mut dk, &mut dv, &mut delta, &dout, saved, sh);
            let put = |dst: &mut Vec<f32>, src: &[f32], w: usize| {
                dst[(bi * s + a) * w..(bi * s + e) * w].copy_from_slice(src)
            };
            put(&mut r[0], &out, QW);
            put(&mut r[2], &dq, QW);
            put(&mut r[3], &dk, KW);
            put(&mut r[4], &dv, KW);
            for h in 0..H {
                r[1][(bi * H + h) * s + a..(bi * H + h) * s + e]
                    .copy_from_slice(&lse[h * n..(h + 1) * n]);
            }
        }
        r
    }

    /// Rows `pos` of every sequence of `x: [batch·seq, w]`.
    fn gather(&self, x: &[f32], w: usize, pos: &[usize]) -> Vec<f32> {
        let mut y = Vec::new();
        for b in 0..self.batch() {
            for &p in pos {
                y.extend_from_slice(&x[(b * self.seq + p) * w..][..w]);
            }
        }
        y
    }

    /// Adds rows of `x: [batch·pos.len(), w]` into rows `pos` of `dst`.
    fn scatter(&self, dst: &mut [f32], x: &[f32], w: usize, pos: &[usize]) {
        for b in 0..self.batch() {
            for (i, &p) in pos.iter().enumerate() {
                let src = &x[(b * pos.len() + i) * w..][..w];
                let row = &mut dst[(b * self.seq + p) * w..][..w];
                row.iter_mut().zip(src).for_each(|(d, s)| *d += s);
            }
        }
    }

    fn shape(&self, q_len: usize, kv_len: usize) -> BlockShape {
        BlockShape {
            batch: self.batch(),
            q_len,
            kv_len,
            heads: H,
            kv_heads: HKV,
            head_dim: D,
        }
    }

    /// The masked kernels over a ring of `cp` ranks holding positions `pos[r]`, each block's
    /// keys in the order `order` puts them.
    fn ring(&self, pos: &[Vec<usize>], order: fn(&[usize]) -> Vec<usize>) -> Results {
        let (b, s) = (self.batch(), self.seq);
        let starts = self.starts();
        let mut r: Results = [
            vec![0.0; b * s * QW],
            vec![0.0; b * H * s],
            vec![0.0; b * s * QW],
            vec![0.0; b * s * KW],
            vec![0.0; b * s * KW],
        ];
        let blocks: Vec<Vec<usize>> = pos.iter().map(|p| order(p)).collect();
        let kv = |j: usize| {
            (
                self.gather(&self.k, KW, &blocks[j]),
                self.gather(&self.v, KW, &blocks[j]),
            )
        };
        for q_pos in pos {
            let n = q_pos.len();
            let q_start: Vec<usize> = (0..b)
                .flat_map(|bi| q_pos.iter().map(move |&p| (bi, p)))
                .map(|(bi, p)| starts[bi * s + p])
                .collect();
            let block_of = |kv_pos| KvBlock {
                q_pos,
                kv_pos,
                q_start: Some(&q_start),
                shape: self.shape(n, kv_pos.len()),
            };
            let q = self.gather(&self.q, QW, q_pos);
            let (mut out, mut lse) = (vec![0.0; b * n * QW], vec![0.0; b * H * n]);
            for (j, kv_pos) in blocks.iter().enumerate() {
                let block = block_of(kv_pos);
                let (k, v) = kv(j);
                let (mut po, mut pl) = (vec![0.0; out.len()], vec![0.0; lse.len()]);
                block_forward(&mut po, &mut pl, &q, &k, &v, block);
                if j == 0 {
                    (out, lse) = (po, pl);
                } else {
                    merge_partial(&mut out, &mut lse, &po, &pl, block.shape);
                }
            }
            let dout = self.gather(&self.dout, QW, q_pos);
            let mut delta = vec![0.0; lse.len()];
            attention_delta(&mut delta, &dout, &out, self.shape(n, n));
            let mut dq = vec![0.0; out.len()];
            for (j, kv_pos) in blocks.iter().enumerate() {
                let block = block_of(kv_pos);
                let (k, v) = kv(j);
                let (mut dk, mut dv) = (vec![f32::NAN; k.len()], vec![f32::NAN; k.len()]);
                block_backward(
                    &mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, &lse, &delta, block,
                );
                self.scatter(&mut r[3], &dk, KW, kv_pos);
                self.scatter(&mut r[4], &dv, KW, kv_pos);
            }
            self.scatter(&mut r[0], &out, QW, q_pos);
            self.scatter(&mut r[2], &dq, QW, q_pos);
            for (bh, row) in lse.chunks(n).enumerate() {
                for (i, &p) in q_pos.iter().enumerate() {
                    r[1][bh * s + p] = row[i];
                }
            }
        }
        r
    }
}

fn assert_close(got: &Results, want: &Results, what: &str) {
    for (name, (g, w)) in ["out", "lse", "dq", "dk", "dv"]
        .iter()
        .zip(got.iter().zip(want))
    {
        let e = max_abs_diff(g, w);
        eprintln!("{what}: {name} max abs error {e:.1e}");
        assert!(
            e < 1e-5,
            "{what}: {name} differs from the per-document reference by {e}"
        );
    }
}

/// Two sequences cut differently (a one-token document, documents straddling the 32-row tiles
/// and the split's halves).
fn packed(seq: usize) -> Packed {
    Packed::new(seq, vec![vec![0, 37, 38, 100], vec![0, 70, seq - 5]])
}

#[test]
fn whole_sequences_attend_within_each_document() {
    for seq in [160, 320] {
        let p = packed(seq);
        let all: Vec<usize> = (0..seq).collect();
        let got = p.ring(&[all], |x| x.to_vec());
        assert_close(&got, &p.reference(), &format!("seq {seq}"));
    }
}

#[test]
fn ring_blocks_attend_within_each_document_under_both_splits() {
    let p = packed(160);
    let want = p.reference();
    for cp in [2, 4] {
        for (name, split) in [
            ("zigzag", zigzag_positions as fn(usize, usize, usize) -> _),
            ("contiguous", contiguous_positions),
        ] {
            let pos: Vec<Vec<usize>> = (0..cp).map(|r| split(160, cp, r).unwrap()).collect();
            assert_close(
                &p.ring(&pos, |x| x.to_vec()),
                &want,
                &format!("{name} cp{cp}"),
            );
        }
    }
}

#[test]
fn keys_in_any_order_are_masked_by_document() {
    let p = packed(160);
    let all: Vec<usize> = (0..160).collect();
    let shuffled = |x: &[usize]| (0..x.len()).map(|i| x[(i * 37 + 11) % x.len()]).collect();
    assert_close(&p.ring(&[all], shuffled), &p.reference(), "shuffled keys");
}

#[test]
fn masking_changes_attention_across_documents() {
    // The reference is not plain causal attention: a test that could not tell them apart
    // would prove nothing.
    let p = packed(160);
    let sh = AttnShape {
        batch: 2,
        seq: 160,
        heads: H,
        kv_heads: HKV,
        head_dim: D,
    };
    let (mut out, mut lse) = (vec![0.0; p.q.len()], vec![0.0; 2 * H * 160]);
    attention_forward(&mut out, &mut lse, &p.q, &p.k, &p.v, sh);
    assert!(max_abs_diff(&out, &p.reference()[0]) > 1e-2);
}
