//! Sub-groups used concurrently, handles waited out of order, point-to-point messages, the
//! ledger, and the benchmark.

use std::time::Duration;

use ferrotron_comm::{
    bench_collective, run_ranks, CollectiveKind, Comm, CommBuf, CommError, DType, GroupKind,
    Handle, ReduceOp, Topology,
};
use ferrotron_tensor::{Category, Ledger};

fn run<T: Send>(n: usize, f: impl Fn(usize, &Comm) -> Result<T, CommError> + Sync) -> Vec<T> {
    run_ranks(n, Duration::from_secs(10), |ctx| {
        let comm = ctx.comm(Ledger::new())?;
        f(ctx.rank(), &comm)
    })
    .expect("every rank succeeds")
}

fn f32s(comm: &Comm, v: &[f32]) -> CommBuf {
    CommBuf::from_f32_slice(comm.ledger(), v)
}

#[test]
fn communicators_and_handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Comm>();
    send_sync::<ferrotron_comm::ThreadWorld>();
    send::<Handle<CommBuf>>();
    send::<CommBuf>();
}

#[test]
fn tp_and_dp_groups_interleaved_and_waited_in_reverse() {
    // dp=2 × tp=2: rank = 2·dp + tp; tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3].
    let topo = Topology::new(2, 1, 1, 2, 1).expect("layout");
    let out = run(4, |r, comm| {
        let tp = topo.group(GroupKind::Tp, r).expect("tp");
        let dp = topo.group(GroupKind::Dp, r).expect("dp");
        let mut handles: Vec<Handle<CommBuf>> = Vec::new();
        for k in 0..4 {
            let x = (r + 1) as f32 * (k + 1) as f32;
            handles.push(comm.all_reduce(&tp, f32s(comm, &[x]), ReduceOp::Sum));
            handles.push(comm.all_reduce(&dp, f32s(comm, &[x, -x]), ReduceOp::Sum));
        }
        handles.push(comm.all_gather(&tp, f32s(comm, &[r as f32]), vec![1, 1]));
        let barrier = comm.barrier(&dp);
        let mut results = Vec::new();
        while let Some(h) = handles.pop() {
            results.push(h.wait()?.to_f32_vec());
        }
        barrier.wait()?;
        results.reverse();
        Ok(results)
    });
    // tp sums of (r + 1): 3 for dp 0, 7 for dp 1; dp sums: 4 for tp 0, 6 for tp 1.
    for (r, results) in out.iter().enumerate() {
        let tp_sum = if r < 2 { 3.0 } else { 7.0 };
        let dp_sum = if r % 2 == 0 { 4.0 } else { 6.0 };
        for k in 0..4 {
            let m = (k + 1) as f32;
            assert_eq!(results[2 * k], vec![tp_sum * m], "rank {r} round {k}");
            assert_eq!(
                results[2 * k + 1],
                vec![dp_sum * m, -dp_sum * m],
                "rank {r} round {k}"
            );
        }
        let gathered = if r < 2 {
            vec![0.0, 1.0]
        } else {
            vec![2.0, 3.0]
        };
        assert_eq!(results[8], gathered);
    }
}

#[test]
fn many_handles_on_the_world_waited_in_reverse() {
    let out = run(3, |r, comm| {
        let handles: Vec<_> = (0..10)
            .map(|k| comm.all_reduce([0, 1, 2], f32s(comm, &[(r * 10 + k) as f32]), ReduceOp::Sum))
            .collect();
        let mut sums = Vec::new();
        for h in handles.into_iter().rev() {
            sums.push(h.wait()?.to_f32_vec()[0]);
        }
        Ok(sums)
    });
    let want: Vec<f32> = (0..10).rev().map(|k| (30 + 3 * k) as f32).collect();
    assert!(out.iter().all(|s| s == &want));
}

#[test]
fn send_recv_matches_by_source_and_tag() {
    let out = run(2, |r, comm| {
        if r == 0 {
            comm.send(1, 1, f32s(comm, &[1.0])).wait()?;
            comm.send(1, 2, f32s(comm, &[2.0, 2.5])).wait()?;
            comm.send(1, 1, f32s(comm, &[11.0])).wait()?;
            let back = comm.recv(1, 9, 1, DType::Bf16).wait()?;
            Ok(vec![back.to_f32_vec()])
        } else {
            let b = comm.recv(0, 2, 2, DType::F32);
            let a = comm.recv(0, 1, 1, DType::F32);
            let c = comm.recv(0, 1, 1, DType::F32);
            let (c, a, b) = (c.wait()?, a.wait()?, b.wait()?);
            let reply = CommBuf::bf16_from_f32_slice(comm.ledger(), &[-3.0]);
            comm.send(0, 9, reply).wait()?;
            Ok(vec![a.to_f32_vec(), b.to_f32_vec(), c.to_f32_vec()])
        }
    });
    assert_eq!(out[0], vec![vec![-3.0]]);
    assert_eq!(out[1], vec![vec![1.0], vec![2.0, 2.5], vec![11.0]]);
}

#[test]
fn ring_of_buffered_sends_and_self_send() {
    let out = run(4, |r, comm| {
        let next = (r + 1) % 4;
        let prev = (r + 3) % 4;
        comm.send(next, 0, f32s(comm, &[r as f32])).wait()?;
        comm.send(r, 5, f32s(comm, &[42.0])).wait()?;
        let from_prev = comm.recv(prev, 0, 1, DType::F32).wait()?.to_f32_vec();
        let own = comm.recv(r, 5, 1, DType::F32).wait()?.to_f32_vec();
        Ok((from_prev[0], own[0]))
    });
    assert_eq!(
        out,
        vec![(3.0, 42.0), (0.0, 42.0), (1.0, 42.0), (2.0, 42.0)]
    );
}

#[test]
fn outputs_are_counted_under_communication_and_released() {
    let out = run(2, |r, comm| {
        let ledger = comm.ledger();
        let comm_bytes = || ledger.snapshot().current(Category::Communication);
        let y = comm
            .all_reduce([0, 1], f32s(comm, &[1.0; 100]), ReduceOp::Sum)
            .wait()?;
        // After the barrier the peer has finished the all-reduce and let go of our input.
        comm.barrier([0, 1]).wait()?;
        let with_output = comm_bytes();
        drop(y);
        let after_drop = comm_bytes();
        let g = comm.all_gather(
            [0, 1],
            CommBuf::zeros(ledger, DType::Bf16, 3 + r),
            vec![3, 4],
        );
        let g = g.wait()?;
        comm.barrier([0, 1]).wait()?;
        let gathered = comm_bytes();
        drop(g);
        let msg = comm.send(1 - r, 0, f32s(comm, &[0.0; 10]));
        msg.wait()?;
        let m = comm.recv(1 - r, 0, 10, DType::F32).wait()?;
        comm.barrier([0, 1]).wait()?;
        let received = comm_bytes();
        drop(m);
        Ok((with_output, after_drop, gathered, received, comm_bytes()))
    });
    for o in out {
        assert_eq!(o, (400, 0, 14, 40, 0));
    }
}

#[test]
fn ledger_counts_inputs_held_by_the_communication() {
    let ledger = Ledger::new();
    let world = ferrotron_comm::ThreadWorld::new(1, Duration::from_secs(5)).expect("world");
    let comm = world.comm(0, ledger.clone()).expect("comm");
    let x = CommBuf::from_f32_slice(&ledger, &[1.0, 2.0]);
    assert_eq!(x.size_bytes(), 8);
    assert_eq!(ledger.snapshot().current(Category::Communication), 8);
    let y = comm
        .all_reduce([0], x, ReduceOp::Mean)
        .wait()
        .expect("all_reduce");
    assert_eq!(y.to_f32_vec(), vec![1.0, 2.0]);
    let s = ledger.snapshot();
    assert_eq!(s.current(Category::Communication), 8);
    // Peak 16: the input is released before the output exists (input + share, then
    // share + output).
    assert_eq!(s.peak(Category::Communication), 16);
    drop(y);
    assert_eq!(ledger.snapshot().current(Category::Communication), 0);
}

#[test]
fn bench_reports_nccl_tests_bandwidths() {
    let kinds = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::Broadcast,
        CollectiveKind::AllToAll,
    ];
    let out = run(2, |_, comm| {
        let mut points = Vec::new();
        for kind in kinds {
            points.push(bench_collective(comm, [0, 1], kind, 1001, 3)?);
        }
        points.push(bench_collective(
            comm,
            [0, 1],
            CollectiveKind::AllGather,
            10,
            1,
        )?);
        Ok(points)
    });
    for points in out {
        for (p, kind) in points.iter().zip(kinds) {
            assert_eq!((p.kind, p.ranks, p.bytes, p.iters), (kind, 2, 1000, 3));
            assert!(p.time_s > 0.0);
            assert_eq!(p.algbw_gbps, 1000.0 / p.time_s / 1e9);
            assert_eq!(p.busbw_gbps, p.algbw_gbps * kind.bus_factor(2));
        }
        // 10 bytes over 2 ranks: one f32 element each, S = 8 bytes.
        assert_eq!(points[5].bytes, 8);
    }
}
