use super::tiles::{tile_masked, tile_ranges, BC, BR};
use super::*;
use crate::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};

const B: usize = 2;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 8;

type Split = fn(usize, usize, usize) -> Result<Vec<usize>, SplitError>;

fn data(n: usize, f: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * f).sin()).collect()
}

/// The test's heads over `n` queries and `n` keys.
fn square(n: usize) -> BlockShape {
    BlockShape {
        batch: B,
        q_len: n,
        kv_len: n,
        heads: H,
        kv_heads: HKV,
        head_dim: D,
    }
}

/// Rows `pos` of every sequence of `x: [B·seq, width]`.
fn gather(x: &[f32], seq: usize, width: usize, pos: &[usize]) -> Vec<f32> {
    let mut y = Vec::with_capacity(B * pos.len() * width);
    for b in 0..B {
        for &p in pos {
            y.extend_from_slice(&x[(b * seq + p) * width..][..width]);
        }
    }
    y
}

/// Adds the rows of `x: [B·pos.len(), width]` into rows `pos` of `dst: [B·seq, width]`.
fn scatter_add(dst: &mut [f32], x: &[f32], seq: usize, width: usize, pos: &[usize]) {
    for b in 0..B {
        for (i, &p) in pos.iter().enumerate() {
            let src = &x[(b * pos.len() + i) * width..][..width];
            for (d, s) in dst[(b * seq + p) * width..][..width].iter_mut().zip(src) {
                *d += s;
            }
        }
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// Simulates one ring over `cp` ranks and returns the max abs errors of
/// (out, lse, dq, dk, dv) against the full-sequence kernels, and the max |dq|, |dk|, |dv|.
fn ring(seq: usize, cp: usize, split: Split) -> ([f32; 5], [f32; 3]) {
    let (qw, kw) = (H * D, HKV * D);
    let full = AttnShape {
        batch: B,
        seq,
        heads: H,
        kv_heads: HKV,
        head_dim: D,
    };
    let (q, k, v) = (
        data(B * seq * qw, 0.37),
        data(B * seq * kw, 0.71),
        data(B * seq * kw, 0.13),
    );
    let dout = data(B * seq * qw, 0.29);
    let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; B * H * seq]);
    attention_forward(&mut out, &mut lse, &q, &k, &v, full);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    let saved: AttnSaved = AttnSaved {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &lse,
    };
    let mut delta = vec![0.0; lse.len()];
    attention_backward(&mut dq, &mut dk, &mut dv, &mut delta, &dout, saved, full);

    let pos: Vec<Vec<usize>> = (0..cp).map(|r| split(seq, cp, r).unwrap()).collect();
    let n = seq / cp;
    let sh = square(n);
    let qs: Vec<_> = pos.iter().map(|p| gather(&q, seq, qw, p)).collect();
    let ks: Vec<_> = pos.iter().map(|p| gather(&k, seq, kw, p)).collect();
    let vs: Vec<_> = pos.iter().map(|p| gather(&v, seq, kw, p)).collect();
    // lse is [B, H, seq]: gathering "rows" of width 1 over B·H sequences of length seq.
    let lse_of = |x: &[f32], p: &[usize]| -> Vec<f32> {
        (0..B * H)
            .flat_map(|bh| p.iter().map(move |&i| x[bh * seq + i]))
            .collect()
    };
    let (mut r_out, mut r_lse) = (vec![0.0; q.len()], vec![0.0; lse.len()]);
    let (mut r_dq, mut r_dk, mut r_dv) =
        (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    for r in 0..cp {
        let (mut o, mut l) = (vec![0.0; B * n * qw], vec![0.0; B * H * n]);
        block_forward(
            &mut o,
            &mut l,
            &qs[r],
            &ks[r],
            &vs[r],
            KvBlock::causal(&pos[r], &pos[r], sh),
        );
        let (mut po, mut pl) = (o.clone(), l.clone());
        for step in 1..cp {
            let j = (r + cp - step) % cp; // the block that arrives from the left neighbour
            block_forward(
                &mut po,
                &mut pl,
                &qs[r],
                &ks[j],
                &vs[j],
                KvBlock::causal(&pos[r], &pos[j], sh),
            );
            assert!(po.iter().all(|x| x.is_finite()), "NaN/inf in a partial");
            merge_partial(&mut o, &mut l, &po, &pl, sh);
        }
        scatter_add(&mut r_out, &o, seq, qw, &pos[r]);
        let want_l = lse_of(&lse, &pos[r]);
        let e = max_abs_diff(&l, &want_l);
        assert!(e < 1e-5, "rank {r} lse error {e}");
        let dout_r = gather(&dout, seq, qw, &pos[r]);
        let mut delta = vec![0.0; l.len()];
        attention_delta(&mut delta, &dout_r, &o, sh);
        let mut dq_r = vec![0.0; o.len()];
        let (mut dk_p, mut dv_p) = (vec![f32::NAN; ks[r].len()], vec![f32::NAN; ks[r].len()]);
        for step in 0..cp {
            let j = (r + cp - step) % cp;
            block_backward(
                &mut dq_r,
                &mut dk_p,
                &mut dv_p,
                &dout_r,
                &qs[r],
                &ks[j],
                &vs[j],
                &l,
                &delta,
                KvBlock::causal(&pos[r], &pos[j], sh),
            );
            scatter_add(&mut r_dk, &dk_p, seq, kw, &pos[j]);
            scatter_add(&mut r_dv, &dv_p, seq, kw, &pos[j]);
        }
        scatter_add(&mut r_dq, &dq_r, seq, qw, &pos[r]);
        for (bh, row) in l.chunks(n).enumerate() {
            for (i, &p) in pos[r].iter().enumerate() {
                r_lse[bh * seq + p] = row[i];
            }
        }
    }
    (
        [
            max_abs_diff(&r_out, &out),
            max_abs_diff(&r_lse, &lse),
            max_abs_diff(&r_dq, &dq),
            max_abs_diff(&r_dk, &dk),
            max_abs_diff(&r_dv, &dv),
        ],
        [max_abs(&dq), max_abs(&dk), max_abs(&dv)],
    )
}

/// Forward (out, lse) within 1e-5 absolute; gradients within 1e-5 absolute.
fn assert_ring_matches(seq: usize, cp: usize, split: Split, name: &str) {
    let (err, mag) = ring(seq, cp, split);
    eprintln!(
        "{name} seq {seq} cp {cp}: max abs err out {:.1e} lse {:.1e} dq {:.1e} dk {:.1e} dv {:.1e} \
         (max |dq| {:.2} |dk| {:.2} |dv| {:.2})",
        err[0], err[1], err[2], err[3], err[4], mag[0], mag[1], mag[2]
    );
    for (name, e) in ["out", "lse", "dq", "dk", "dv"].iter().zip(err) {
        assert!(e < 1e-5, "seq {seq} cp {cp}: {name} max abs error {e}");
    }
}

#[test]
fn zigzag_ring_matches_full_attention() {
    assert_ring_matches(128, 2, zigzag_positions, "zigzag");
    assert_ring_matches(128, 4, zigzag_positions, "zigzag");
    // Chunks of 24 and 12 tokens: tiles straddle chunk boundaries and the 32-row tile edge.
    assert_ring_matches(96, 2, zigzag_positions, "zigzag");
    assert_ring_matches(96, 4, zigzag_positions, "zigzag");
    // Blocks of several tiles, so tiles inside a block are skipped, aligned (chunks of 128)
    // or not (chunks of 80).
    assert_ring_matches(512, 2, zigzag_positions, "zigzag");
    assert_ring_matches(320, 2, zigzag_positions, "zigzag");
}

#[test]
fn contiguous_ring_matches_full_attention() {
    assert_ring_matches(128, 2, contiguous_positions, "contiguous");
    assert_ring_matches(128, 4, contiguous_positions, "contiguous");
    assert_ring_matches(96, 4, contiguous_positions, "contiguous");
}

#[test]
fn masked_rows_are_empty_and_merge_as_no_ops() {
    let n = 40;
    let sh = square(n);
    let (q, k, v) = (
        data(B * n * H * D, 0.37),
        data(B * n * HKV * D, 0.71),
        data(B * n * HKV * D, 0.13),
    );
    let q_pos: Vec<usize> = (0..n).collect();
    let own: Vec<usize> = (0..n).collect();
    let later: Vec<usize> = (n..2 * n).collect();
    let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; B * H * n]);
    block_forward(
        &mut out,
        &mut lse,
        &q,
        &k,
        &v,
        KvBlock::causal(&q_pos, &own, sh),
    );

    let (mut mo, mut ml) = (vec![f32::NAN; q.len()], vec![f32::NAN; lse.len()]);
    block_forward(
        &mut mo,
        &mut ml,
        &q,
        &k,
        &v,
        KvBlock::causal(&q_pos, &later, sh),
    );
    assert!(mo.iter().all(|&x| x == 0.0));
    assert!(ml.iter().all(|&x| x == f32::NEG_INFINITY));

    let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
    let (mut o2, mut l2) = (out.clone(), lse.clone());
    merge_partial(&mut o2, &mut l2, &mo, &ml, sh);
    assert_eq!(bits(&o2), bits(&out));
    assert_eq!(bits(&l2), bits(&lse));
    // And the other way round: an empty running result takes the partial as is.
    merge_partial(&mut mo, &mut ml, &out, &lse, sh);
    assert_eq!(bits(&mo), bits(&out));
    assert_eq!(bits(&ml), bits(&lse));

    // Backward of the masked block: dq untouched, dk/dv overwritten with zeros.
    let dout = data(q.len(), 0.29);
    let mut delta = vec![0.0; lse.len()];
    attention_delta(&mut delta, &dout, &out, sh);
    let mut dq = data(q.len(), 0.5);
    let dq0 = dq.clone();
    let (mut dk, mut dv) = (vec![f32::NAN; k.len()], vec![f32::NAN; k.len()]);
    block_backward(
        &mut dq,
        &mut dk,
        &mut dv,
        &dout,
        &q,
        &k,
        &v,
        &lse,
        &delta,
        KvBlock::causal(&q_pos, &later, sh),
    );
    assert_eq!(bits(&dq), bits(&dq0));
    assert!(dk.iter().chain(&dv).all(|&x| x == 0.0));

    // Half the rows of one tile see the block, half see nothing.
    let mid: Vec<usize> = (n / 2..n / 2 + n).collect();
    block_forward(
        &mut mo,
        &mut ml,
        &q,
        &k,
        &v,
        KvBlock::causal(&q_pos, &mid, sh),
    );
    for bh in 0..B * H {
        for i in 0..n {
            let l = ml[bh * n + i];
            assert_eq!(i < n / 2, l == f32::NEG_INFINITY, "row {i}: lse {l}");
            assert!(i < n / 2 || l.is_finite());
        }
    }
    assert!(mo.iter().all(|x| x.is_finite()));
}

/// Per-rank totals over all visiting blocks of `block_flops` and of the tiles the kernels
/// compute (by the same skip test they use).
fn per_rank_work(seq: usize, cp: usize, split: Split) -> (Vec<u64>, Vec<usize>) {
    let pos: Vec<Vec<usize>> = (0..cp).map(|r| split(seq, cp, r).unwrap()).collect();
    let flops = pos
        .iter()
        .map(|qp| pos.iter().map(|kp| block_flops(qp, kp, 1, 64)).sum())
        .collect();
    let tiles = pos
        .iter()
        .map(|qp| {
            let qt = tile_ranges(qp, BR);
            pos.iter()
                .map(|kp| {
                    let kt = tile_ranges(kp, BC);
                    qt.iter()
                        .flat_map(|&q| kt.iter().filter(move |&&k| !tile_masked(q, k)))
                        .count()
                })
                .sum()
        })
        .collect();
    (flops, tiles)
}

fn imbalance(x: &[u64]) -> f64 {
    *x.iter().max().unwrap() as f64 / *x.iter().min().unwrap() as f64 - 1.0
}

#[test]
fn zigzag_balances_causal_work_and_contiguous_does_not() {
    let (seq, cp) = (4096, 4);
    // Zig-zag: chunks of L = 512; rank i's queries see p + 1 keys at position p, so it holds
    // Σ over chunks i and 7 − i = 8·L² + L = 2_097_664 pairs, the same for every rank;
    // × 4·d = 256 FLOPs each.
    let (zz, zz_tiles) = per_rank_work(seq, cp, zigzag_positions);
    assert_eq!(zz, vec![2_097_664 * 256; 4]);
    assert!(imbalance(&zz) <= 0.05);
    // Contiguous: chunks of C = 1024; rank r holds r·C² + C(C+1)/2 pairs.
    let (ct, ct_tiles) = per_rank_work(seq, cp, contiguous_positions);
    let pairs = [524_800u64, 1_573_376, 2_621_952, 3_670_528];
    assert_eq!(ct, pairs.map(|p| p * 256).to_vec());
    assert!(imbalance(&ct) > 0.5);
    assert!(imbalance(&ct) > 5.99, "first to last rank ≈ 7×");
    assert_eq!(zz.iter().sum::<u64>(), ct.iter().sum::<u64>());
    // Tiles of 32 query rows against chunks of 128 keys after skipping: the row tile at
    // global index T sees the chunks up to ⌊T/4⌋, ⌊T/4⌋ + 1 of them. Zig-zag: rank i holds
    // the row tiles of chunks i and 7 − i of 512 tokens, 16 each, Σ = 4·(16p + 10) per chunk
    // p, 528 for every rank; contiguous: rank r holds tiles 32r..32r+31, Σ = 256·r + 144.
    assert_eq!((BR, BC), (32, 128));
    assert_eq!(zz_tiles, vec![528; 4]);
    assert_eq!(ct_tiles, vec![144, 400, 656, 912]);
    eprintln!(
        "seq {seq} cp {cp} flops per rank: zig-zag {zz:?} (imbalance {:.3}), contiguous {ct:?} \
         (imbalance {:.3}); tiles zig-zag {zz_tiles:?}, contiguous {ct_tiles:?}",
        imbalance(&zz),
        imbalance(&ct)
    );
}

#[test]
fn splits_cover_the_sequence_and_reject_bad_shapes() {
    assert_eq!(zigzag_positions(8, 2, 0).unwrap(), vec![0, 1, 6, 7]);
    assert_eq!(zigzag_positions(8, 2, 1).unwrap(), vec![2, 3, 4, 5]);
    assert_eq!(contiguous_positions(8, 2, 1).unwrap(), vec![4, 5, 6, 7]);
    for split in [zigzag_positions as Split, contiguous_positions] {
        let mut all: Vec<usize> = (0..4).flat_map(|r| split(96, 4, r).unwrap()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..96).collect::<Vec<_>>());
    }
    let e = zigzag_positions(100, 4, 0).unwrap_err();
    assert_eq!(
        e,
        SplitError::Uneven {
            seq_len: 100,
            cp: 4,
            chunks: 8
        }
    );
    assert_eq!(
        e.to_string(),
        "seq_len 100 does not cut into 8 equal chunks (cp = 4)"
    );
    assert!(contiguous_positions(100, 4, 0).is_ok());
    assert_eq!(
        zigzag_positions(64, 4, 4),
        Err(SplitError::Rank { rank: 4, cp: 4 })
    );
    assert!(contiguous_positions(64, 0, 0).is_err());
}

/// Keys in any order: the kernels' fallback masks each score by position where a chunk's
/// positions do not ascend, and the result is the ascending block's with its key rows
/// permuted alike.
#[test]
fn keys_out_of_order_match_the_ordered_block() {
    let n = 200;
    let sh = square(n);
    let kw = HKV * D;
    let (q, k, v) = (
        data(B * n * H * D, 0.37),
        data(B * n * kw, 0.71),
        data(B * n * kw, 0.13),
    );
    let dout = data(q.len(), 0.29);
    let ordered: Vec<usize> = (0..n).collect();
    let run = |kv_pos: &[usize]| {
        let (ks, vs) = (gather(&k, n, kw, kv_pos), gather(&v, n, kw, kv_pos));
        let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; B * H * n]);
        block_forward(
            &mut out,
            &mut lse,
            &q,
            &ks,
            &vs,
            KvBlock::causal(&ordered, kv_pos, sh),
        );
        let mut delta = vec![0.0; lse.len()];
        attention_delta(&mut delta, &dout, &out, sh);
        let mut dq = vec![0.0; q.len()];
        let (mut dkp, mut dvp) = (vec![f32::NAN; k.len()], vec![f32::NAN; k.len()]);
        block_backward(
            &mut dq,
            &mut dkp,
            &mut dvp,
            &dout,
            &q,
            &ks,
            &vs,
            &lse,
            &delta,
            KvBlock::causal(&ordered, kv_pos, sh),
        );
        // Back to position order, so every run compares with the ordered one.
        let (mut dk, mut dv) = (vec![0.0; k.len()], vec![0.0; k.len()]);
        scatter_add(&mut dk, &dkp, n, kw, kv_pos);
        scatter_add(&mut dv, &dvp, n, kw, kv_pos);
        [out, lse, dq, dk, dv]
    };
    let want = run(&ordered);
    // The first chunk ascending and the second reversed; then every chunk shuffled.
    let half: Vec<usize> = (0..128).chain((128..n).rev()).collect();
    let shuffled: Vec<usize> = (0..n).map(|i| (i * 37 + 11) % n).collect();
    for (name, pos) in [("reversed second chunk", half), ("shuffled", shuffled)] {
        let got = run(&pos);
        for (what, (g, w)) in ["out", "lse", "dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip(&want))
        {
            let e = max_abs_diff(g, w);
            assert!(e < 1e-5, "{name}: {what} differs by {e}");
        }
    }
}
