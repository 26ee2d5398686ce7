//! The vocabulary-parallel cross-entropy and embedding against their unsharded kernels, on
//! 2 and 4 ranks: forward output (loss, embedding rows), input gradient (the sum of the ranks'
//! partial gradients) and weight gradients (each rank's rows). Column- and row-parallel
//! linears are checked through whole-model gradients in `ferrotron-train`'s `tp_parity.rs`.

use std::time::Duration;

use ferrotron_comm::run_ranks;
use ferrotron_model::strategy::{VocabHead, VpGrads};
use ferrotron_parallel::{CommVolume, TpComm};
use ferrotron_tensor::embedding::{embedding_backward, embedding_forward};
use ferrotron_tensor::embedding::{embedding_backward_slice, embedding_forward_slice};
use ferrotron_tensor::xent::{lm_head_xent, XentGrads};
use ferrotron_tensor::{CpuBackend, Device, DeviceSlice, Ledger};

fn vals(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 + 1.0) * seed).sin()).collect()
}

#[test]
fn vocab_parallel_cross_entropy_equals_the_full_one() {
    let (t, h, v) = (10, 8, 12);
    let x = vals(t * h, 0.37);
    let w = vals(v * h, 0.71);
    let targets: Vec<u32> = (0..t as u32).map(|i| (i * 5) % v as u32).collect();
    let ledger = Ledger::new();
    let (mut dx, mut dw) = (vec![0.0; t * h], vec![0.0; v * h]);
    let loss = lm_head_xent(
        &Default::default(),
        &ledger,
        &x,
        &w,
        &targets,
        h,
        v,
        4,
        Some(XentGrads {
            dx: &mut dx,
            dw: &mut dw,
            scale: 0.1,
        }),
    );
    for ranks in [2usize, 4] {
        let group: Vec<usize> = (0..ranks).collect();
        let out = run_ranks(ranks, Duration::from_secs(30), |ctx| {
            let ledger = Ledger::new();
            let comm = ctx.comm(ledger.clone())?;
            let g = ferrotron_comm::Topology::new(1, 1, 1, ranks, 1)?
                .group(ferrotron_comm::GroupKind::Tp, ctx.rank())?;
            assert_eq!(g.ranks(), &group[..]);
            let volume = CommVolume::default();
            let tp = TpComm {
                comm: &comm,
                group: &g,
                sequence_parallel: false,
                volume: &volume,
                trace: None,
            };
            let vl = v / ranks;
            let v0 = ctx.rank() * vl;
            let (mut pdx, mut pdw) = (vec![0.0; t * h], vec![0.0; vl * h]);
            let head = VocabHead {
                w: DeviceSlice::from_host(&w[v0 * h..(v0 + vl) * h]),
                hidden: h,
                v0,
                chunk: 4,
            };
            let dev = Device {
                ledger: &ledger,
                backend: &CpuBackend::default(),
            };
            let l = tp.vocab_parallel_xent(
                dev,
                head,
                DeviceSlice::from_host(&x),
                DeviceSlice::from_host(&targets),
                Some(VpGrads {
                    dx: DeviceSlice::from_host_mut(&mut pdx),
                    dw: DeviceSlice::from_host_mut(&mut pdw),
                    scale: 0.1,
                }),
            )?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((l, pdx, pdw))
        })
        .unwrap();
        let mut sum_dx = vec![0.0f32; t * h];
        for (r, (l, pdx, pdw)) in out.iter().enumerate() {
            assert!(
                (l - loss).abs() <= 1e-6 * loss,
                "{ranks} ranks, rank {r}: loss {l} vs {loss}"
            );
            sum_dx.iter_mut().zip(pdx).for_each(|(s, p)| *s += p);
            let vl = v / ranks;
            for (a, b) in pdw.iter().zip(&dw[r * vl * h..(r + 1) * vl * h]) {
                assert!(
                    (a - b).abs() <= 1e-6,
                    "{ranks} ranks, rank {r}: weight gradient {a} vs {b}"
                );
            }
        }
        for (a, b) in sum_dx.iter().zip(&dx) {
            assert!(
                (a - b).abs() <= 1e-6,
                "{ranks} ranks: input gradient {a} vs {b}"
            );
        }
    }
}

#[test]
fn vocab_parallel_embedding_sums_to_the_full_lookup() {
    let (h, v) = (4, 8);
    let table = vals(v * h, 0.3);
    let tokens = [3u32, 7, 0, 3, 5];
    let mut full = vec![0.0; tokens.len() * h];
    embedding_forward(&mut full, &table, &tokens, h);
    let dx = vals(tokens.len() * h, 1.1);
    let mut dtable = vec![0.0; v * h];
    embedding_backward(&mut dtable, &dx, &tokens, h);
    for ranks in [2, 4] {
        let vl = v / ranks;
        let mut sum = vec![0.0f32; full.len()];
        for r in 0..ranks {
            let mut part = vec![0.0; full.len()];
            embedding_forward_slice(
                &mut part,
                &table[r * vl * h..(r + 1) * vl * h],
                &tokens,
                h,
                r * vl,
            );
            sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            let mut dslice = vec![0.0; vl * h];
            embedding_backward_slice(&mut dslice, &dx, &tokens, h, r * vl);
            assert_eq!(&dslice[..], &dtable[r * vl * h..(r + 1) * vl * h]);
        }
        assert_eq!(sum, full);
    }
}
