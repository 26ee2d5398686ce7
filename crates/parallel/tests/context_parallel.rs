//! The context-parallel ring (`ferrotron_parallel::context_parallel`) over real communicators against the
//! full-sequence flash attention, with grouped-query attention (kv_heads < heads), on 2 and 4
//! ranks: each rank's output, log-sum-exp and query gradient at its zig-zag positions, and
//! the key/value gradients that travel back around the ring to their owner. Also: the ring's
//! buffers in flight are counted as communication (between 2 and 2c + 3 packed key/value
//! blocks at the peak, depending on how far ranks drift apart), and none outlives the call.
//!
//! Tolerance: 1e-5 absolute on values of order 1 (the kernels' own tests, which simulate the
//! ring without communication, hold the same bound).

use std::time::Duration;

use ferrotron_comm::{run_ranks, GroupKind, Topology};
use ferrotron_model::strategy::{AttnOut, QkvGrads, RingSaved};
use ferrotron_parallel::context_parallel::{ring_backward, ring_forward, CpComm};
use ferrotron_tensor::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};
use ferrotron_tensor::ring_attention::BlockShape;
use ferrotron_tensor::{Category, CpuBackend, Device, Ledger};

const B: usize = 2;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const SEQ: usize = 48;

/// Host memory as the CPU backend's device memory.
fn d(x: &[f32]) -> &D {
    D::from_host(x)
}

type D = ferrotron_tensor::DeviceSlice<f32>;

fn data(n: usize, f: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * f).sin()).collect()
}

/// Rows `pos` of every sequence of `x: [B·SEQ, width]`.
fn gather(x: &[f32], width: usize, pos: &[usize]) -> Vec<f32> {
    let mut y = Vec::with_capacity(B * pos.len() * width);
    for b in 0..B {
        for &p in pos {
            y.extend_from_slice(&x[(b * SEQ + p) * width..][..width]);
        }
    }
    y
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn ring_over_communicators_matches_full_attention() {
    let (qw, kw) = (H * D, HKV * D);
    let full = AttnShape {
        batch: B,
        seq: SEQ,
        heads: H,
        kv_heads: HKV,
        head_dim: D,
    };
    let (q, k, v) = (
        data(B * SEQ * qw, 0.37),
        data(B * SEQ * kw, 0.71),
        data(B * SEQ * kw, 0.13),
    );
    let dout = data(B * SEQ * qw, 0.29);
    let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; B * H * SEQ]);
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

    for cp in [2usize, 4] {
        let errors = run_ranks(cp, Duration::from_secs(30), |ctx| {
            let ledger = Ledger::new();
            let comm = ctx.comm(ledger.clone())?;
            let group = Topology::new(1, 1, cp, 1, 1)?.group(GroupKind::Cp, ctx.rank())?;
            let ring = CpComm::new(&comm, &group, (SEQ, ferrotron_config::CpKind::Ring), None)?;
            let pos = ring.positions().to_vec();
            let n = pos.len();
            let sh = BlockShape {
                batch: B,
                q_len: n,
                kv_len: n,
                heads: H,
                kv_heads: HKV,
                head_dim: D,
            };
            let (ql, kl, vl) = (
                gather(&q, qw, &pos),
                gather(&k, kw, &pos),
                gather(&v, kw, &pos),
            );
            let dl = gather(&dout, qw, &pos);
            let (mut o, mut l) = (vec![0.0; ql.len()], vec![0.0; B * H * n]);
            let attn = AttnOut {
                out: D::from_host_mut(&mut o),
                lse: D::from_host_mut(&mut l),
            };
            let dev = Device {
                ledger: &ledger,
                backend: &CpuBackend::default(),
            };
            ring_forward(&ring, dev, attn, (d(&ql), d(&kl), d(&vl)), (sh, None))?;
            let (mut gq, mut gk, mut gv) = (
                vec![f32::NAN; ql.len()],
                vec![f32::NAN; kl.len()],
                vec![f32::NAN; kl.len()],
            );
            let saved = RingSaved {
                q: d(&ql),
                k: d(&kl),
                v: d(&vl),
                out: d(&o),
                lse: d(&l),
            };
            let grads = QkvGrads {
                dq: D::from_host_mut(&mut gq),
                dk: D::from_host_mut(&mut gk),
                dv: D::from_host_mut(&mut gv),
            };
            ring_backward(&ring, dev, grads, d(&dl), saved, (sh, None))?;
            // lse is [B, H, SEQ]: its rows at this rank's positions.
            let lse = &lse;
            let want_lse: Vec<f32> = (0..B * H)
                .flat_map(|bh| pos.iter().map(move |&p| lse[bh * SEQ + p]))
                .collect();
            let errors = [
                max_abs_diff(&o, &gather(&out, qw, &pos)),
                max_abs_diff(&l, &want_lse),
                max_abs_diff(&gq, &gather(&dq, qw, &pos)),
                max_abs_diff(&gk, &gather(&dk, kw, &pos)),
                max_abs_diff(&gv, &gather(&dv, kw, &pos)),
            ];
            // Sends are buffered: a message counts on its sender until the receiver takes it,
            // so wait until every member has finished before checking that nothing is left.
            comm.barrier(&group).wait()?;
            let snap = ledger.snapshot();
            // One packed key/value block: [k | v] of this rank's tokens, f32.
            let block = 2 * kl.len() * 4;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
                errors,
                snap.peak(Category::Communication),
                snap.current(Category::Communication),
                block,
            ))
        })
        .unwrap();
        for (rank, (errors, peak, current, block)) in errors.into_iter().enumerate() {
            eprintln!(
                "cp={cp} rank {rank}: max abs err out {:.1e} lse {:.1e} dq {:.1e} dk {:.1e} dv {:.1e}; \
                 communication peak {peak} bytes = {:.2} blocks",
                errors[0],
                errors[1],
                errors[2],
                errors[3],
                errors[4],
                peak as f64 / block as f64
            );
            for (name, e) in ["out", "lse", "dq", "dk", "dv"].iter().zip(errors) {
                assert!(e < 1e-5, "cp={cp} rank {rank}: {name} max abs error {e}");
            }
            // In backward a rank holds the visiting key/value block while the accumulator of
            // its gradient arrives: at least two packed blocks at once, all as communication.
            assert!(
                peak >= 2 * block,
                "cp={cp} rank {rank}: communication peak {peak} < two blocks of {block}"
            );
            // At most: the block held, the next block and an accumulator received, and every
            // message sent but not yet received. Sends are buffered and a rank is paced only
            // by its predecessor, so it may run up to c − 1 steps ahead of its successor:
            // up to c key/value copies and c accumulators wait in the mailbox.
            assert!(
                peak <= (2 * cp + 3) * block,
                "cp={cp} rank {rank}: communication peak {peak} > {} blocks of {block}",
                2 * cp + 3
            );
            assert_eq!(
                current, 0,
                "cp={cp} rank {rank}: ring buffers outlive the call"
            );
        }
    }
}
