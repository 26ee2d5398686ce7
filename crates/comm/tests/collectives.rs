//! Every collective on 1 to 4 ranks with exact expected values, in f32 and bf16.

use std::time::Duration;

use ferrotron_comm::{run_ranks, Comm, CommBuf, CommError, ReduceOp};
use ferrotron_tensor::{bf16, Ledger};

/// Runs `f(rank, comm)` on `n` ranks and returns the results in rank order.
fn run<T: Send>(n: usize, f: impl Fn(usize, &Comm) -> Result<T, CommError> + Sync) -> Vec<T> {
    run_ranks(n, Duration::from_secs(10), |ctx| {
        let comm = ctx.comm(Ledger::new())?;
        f(ctx.rank(), &comm)
    })
    .expect("every rank succeeds")
}

fn world(n: usize) -> Vec<usize> {
    (0..n).collect()
}

fn f32s(comm: &Comm, v: &[f32]) -> CommBuf {
    CommBuf::from_f32_slice(comm.ledger(), v)
}

fn bf16s(comm: &Comm, v: &[f32]) -> CommBuf {
    CommBuf::bf16_from_f32_slice(comm.ledger(), v)
}

#[test]
fn all_reduce_f32_sum_and_mean() {
    let expected_sum: [&[f32]; 4] = [
        &[1.0, 0.0, 0.0, 100.0, 1.0],
        &[3.0, 0.25, -1.0, 200.0, 3.0],
        &[6.0, 0.75, -3.0, 300.0, 7.0],
        &[10.0, 1.5, -6.0, 400.0, 15.0],
    ];
    for n in 1..=4 {
        let out = run(n, |r, comm| {
            let x = [
                r as f32 + 1.0,
                0.25 * r as f32,
                -(r as f32),
                100.0,
                (1 << r) as f32,
            ];
            let sum = comm
                .all_reduce(world(n), f32s(comm, &x), ReduceOp::Sum)
                .wait()?;
            let mean = comm
                .all_reduce(world(n), f32s(comm, &x), ReduceOp::Mean)
                .wait()?;
            Ok((sum.to_f32_vec(), mean.to_f32_vec(), sum.dtype()))
        });
        for (sum, mean, dtype) in out {
            assert_eq!(sum, expected_sum[n - 1], "n={n}");
            let m: Vec<f32> = expected_sum[n - 1].iter().map(|x| x / n as f32).collect();
            assert_eq!(mean, m, "n={n}");
            assert_eq!(dtype, ferrotron_comm::DType::F32);
        }
    }
    let mean4 = run(4, |r, comm| {
        let x = [
            r as f32 + 1.0,
            0.25 * r as f32,
            -(r as f32),
            100.0,
            (1 << r) as f32,
        ];
        Ok(comm
            .all_reduce(world(4), f32s(comm, &x), ReduceOp::Mean)
            .wait()?
            .to_f32_vec())
    });
    assert_eq!(mean4[3], vec![2.5, 0.375, -1.5, 100.0, 3.75]);
}

#[test]
fn all_reduce_bf16_rounds_once() {
    // Element 0: 256 on rank 0 and 1 on the others. Summed in f32 and rounded once,
    // 259 → 260 (bf16 spacing is 2 there, ties to even); adding in bf16 step by step would
    // give 256 + 1 → 256 each time.
    let expected: [[f32; 2]; 4] = [[256.0, 0.5], [256.0, 1.5], [258.0, 3.0], [260.0, 5.0]];
    for n in 1..=4 {
        let out = run(n, |r, comm| {
            let x = [if r == 0 { 256.0 } else { 1.0 }, 0.5 * (r as f32 + 1.0)];
            let y = comm
                .all_reduce(world(n), bf16s(comm, &x), ReduceOp::Sum)
                .wait()?;
            Ok((y.as_bf16().map(<[bf16]>::to_vec), y.to_f32_vec()))
        });
        for (bits, vals) in out {
            assert!(bits.is_some(), "bf16 in, bf16 out");
            assert_eq!(vals, expected[n - 1], "n={n}");
        }
    }
}

#[test]
fn all_reduce_is_bitwise_identical_and_in_group_order() {
    let len = 1001;
    let value = |r: usize, i: usize| {
        let h = (r * 7919 + i * 104_729) as u32;
        let h = h.wrapping_mul(2_654_435_761) >> 8;
        (h as f32 / (1u32 << 24) as f32 - 0.5) * 10f32.powi((i % 7) as i32 - 3)
    };
    let outs = run(4, |r, comm| {
        let x: Vec<f32> = (0..len).map(|i| value(r, i)).collect();
        let y = comm
            .all_reduce(world(4), f32s(comm, &x), ReduceOp::Sum)
            .wait()?;
        Ok(y.to_f32_vec())
    });
    let reference: Vec<f32> = (0..len)
        .map(|i| ((value(0, i) + value(1, i)) + value(2, i)) + value(3, i))
        .collect();
    for out in &outs {
        let bits: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
        let want: Vec<u32> = reference.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, want);
    }
}

#[test]
fn reduce_scatter_uneven() {
    // Three ranks, counts [2, 0, 3]: rank r contributes (r + 1)·[1, 2, 3, 4, 5].
    let out = run(3, |r, comm| {
        let x: Vec<f32> = (1..=5).map(|k| (r as f32 + 1.0) * k as f32).collect();
        let f = comm
            .reduce_scatter(world(3), f32s(comm, &x), vec![2, 0, 3])
            .wait()?;
        let b = comm
            .reduce_scatter(world(3), bf16s(comm, &x), vec![2, 0, 3])
            .wait()?;
        Ok((f.to_f32_vec(), b.to_f32_vec(), b.dtype()))
    });
    let expected: [&[f32]; 3] = [&[6.0, 12.0], &[], &[18.0, 24.0, 30.0]];
    for (r, (f, b, dtype)) in out.into_iter().enumerate() {
        assert_eq!(f, expected[r]);
        assert_eq!(b, expected[r]);
        assert_eq!(dtype, ferrotron_comm::DType::Bf16);
    }
    // 1 to 4 ranks with counts[i] = i + 1: rank r contributes (r + 1)·(k + 1) at k.
    let expected: [&[&[f32]]; 4] = [
        &[&[1.0]],
        &[&[3.0], &[6.0, 9.0]],
        &[&[6.0], &[12.0, 18.0], &[24.0, 30.0, 36.0]],
        &[
            &[10.0],
            &[20.0, 30.0],
            &[40.0, 50.0, 60.0],
            &[70.0, 80.0, 90.0, 100.0],
        ],
    ];
    for n in 1..=4 {
        let counts: Vec<usize> = (1..=n).collect();
        let total: usize = counts.iter().sum();
        let out = run(n, |r, comm| {
            let x: Vec<f32> = (0..total).map(|k| ((r + 1) * (k + 1)) as f32).collect();
            let y = comm
                .reduce_scatter(world(n), f32s(comm, &x), counts.clone())
                .wait()?;
            Ok(y.to_f32_vec())
        });
        for (r, y) in out.iter().enumerate() {
            assert_eq!(y, expected[n - 1][r], "n={n} rank {r}");
        }
    }
}

#[test]
fn all_gather_uneven() {
    let counts = vec![1, 3, 0, 2];
    let out = run(4, |r, comm| {
        let x: Vec<f32> = (0..counts[r]).map(|k| (10 * r + k) as f32).collect();
        let f = comm
            .all_gather(world(4), f32s(comm, &x), counts.clone())
            .wait()?;
        let b = comm
            .all_gather(world(4), bf16s(comm, &x), counts.clone())
            .wait()?;
        Ok((f.to_f32_vec(), b.to_f32_vec(), b.dtype()))
    });
    for (f, b, dtype) in out {
        assert_eq!(f, vec![0.0, 10.0, 11.0, 12.0, 30.0, 31.0]);
        assert_eq!(b, vec![0.0, 10.0, 11.0, 12.0, 30.0, 31.0]);
        assert_eq!(dtype, ferrotron_comm::DType::Bf16);
    }
    let expected: [&[f32]; 3] = [
        &[0.0],
        &[0.0, 10.0, 11.0],
        &[0.0, 10.0, 11.0, 20.0, 21.0, 22.0],
    ];
    for n in 1..=3 {
        let counts: Vec<usize> = (1..=n).collect();
        let out = run(n, |r, comm| {
            let x: Vec<f32> = (0..=r).map(|k| (10 * r + k) as f32).collect();
            Ok(comm
                .all_gather(world(n), f32s(comm, &x), counts.clone())
                .wait()?
                .to_f32_vec())
        });
        assert!(out.iter().all(|y| y == expected[n - 1]), "n={n}");
    }
}

#[test]
fn broadcast_from_any_root() {
    for n in 1..=4 {
        let root = n - 1;
        let out = run(n, |r, comm| {
            let x = if r == root {
                [7.5, -1.0, r as f32]
            } else {
                [0.0; 3]
            };
            let f = comm.broadcast(world(n), f32s(comm, &x), root).wait()?;
            let b = comm.broadcast(world(n), bf16s(comm, &x), root).wait()?;
            Ok((f.to_f32_vec(), b.to_f32_vec()))
        });
        for (f, b) in out {
            assert_eq!(f, vec![7.5, -1.0, root as f32]);
            assert_eq!(b, vec![7.5, -1.0, root as f32]);
        }
    }
}

#[test]
fn all_to_all_uneven() {
    // send[r][j]: elements rank r sends to rank j; rank r's input is 100·r + k.
    let send = [[1, 0, 2], [2, 1, 0], [0, 3, 1]];
    let out = run(3, |r, comm| {
        let total: usize = send[r].iter().sum();
        let x: Vec<f32> = (0..total).map(|k| (100 * r + k) as f32).collect();
        let recv: Vec<usize> = (0..3).map(|i| send[i][r]).collect();
        let f = comm.all_to_all(world(3), f32s(comm, &x), send[r].to_vec(), recv.clone());
        let b = comm.all_to_all(world(3), bf16s(comm, &x), send[r].to_vec(), recv);
        Ok((f.wait()?.to_f32_vec(), b.wait()?.to_f32_vec()))
    });
    let expected: [&[f32]; 3] = [
        &[0.0, 100.0, 101.0],
        &[102.0, 200.0, 201.0, 202.0],
        &[1.0, 2.0, 203.0],
    ];
    for (r, (f, b)) in out.into_iter().enumerate() {
        assert_eq!(f, expected[r]);
        assert_eq!(b, expected[r]);
    }
    // 1, 2 and 4 ranks with send[i][j] = (i + j) % 3.
    for n in [1, 2, 4] {
        let c = |i: usize, j: usize| (i + j) % 3;
        let out = run(n, |r, comm| {
            let sc: Vec<usize> = (0..n).map(|j| c(r, j)).collect();
            let rc: Vec<usize> = (0..n).map(|i| c(i, r)).collect();
            let x: Vec<f32> = (0..sc.iter().sum()).map(|k| (100 * r + k) as f32).collect();
            Ok(comm
                .all_to_all(world(n), f32s(comm, &x), sc, rc)
                .wait()?
                .to_f32_vec())
        });
        for (j, y) in out.iter().enumerate() {
            let mut want = Vec::new();
            for i in 0..n {
                let start: usize = (0..j).map(|l| c(i, l)).sum();
                want.extend((start..start + c(i, j)).map(|k| (100 * i + k) as f32));
            }
            assert_eq!(y, &want, "n={n} rank {j}");
        }
    }
    let two = run(2, |r, comm| {
        let x: Vec<f32> = (0..1 + r).map(|k| (100 * r + k) as f32).collect();
        let (sc, rc) = if r == 0 {
            (vec![0, 1], vec![0, 1])
        } else {
            (vec![1, 1], vec![1, 1])
        };
        Ok(comm
            .all_to_all(world(2), f32s(comm, &x), sc, rc)
            .wait()?
            .to_f32_vec())
    });
    assert_eq!(two, vec![vec![100.0], vec![0.0, 101.0]]);
}

#[test]
fn barrier_on_one_to_four_ranks() {
    for n in 1..=4 {
        let out = run(n, |_, comm| {
            comm.barrier(world(n)).wait()?;
            comm.barrier(world(n)).wait()
        });
        assert_eq!(out.len(), n);
    }
}
