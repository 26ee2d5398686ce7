//! Mismatches, bad arguments, timeouts and failing ranks: typed errors everywhere, promptly,
//! never a hang.

use std::error::Error;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use ferrotron_comm::{
    run_ranks, Comm, CommBuf, CommError, DType, RankFailure, ReduceOp, ThreadWorld,
};
use ferrotron_tensor::Ledger;

type BoxError = Box<dyn Error + Send + Sync>;

/// What each surviving rank saw: (rank, error, time its pending operation waited).
type Seen = Vec<(usize, CommError, Duration)>;

/// Runs `f(rank, comm)` on `n` ranks; `f` reports errors as values.
fn run_all<T: Send>(n: usize, timeout: Duration, f: impl Fn(usize, &Comm) -> T + Sync) -> Vec<T> {
    run_ranks(n, timeout, |ctx| {
        let comm = ctx.comm(Ledger::new())?;
        Ok::<_, CommError>(f(ctx.rank(), &comm))
    })
    .expect("no rank fails")
}

fn f32s(comm: &Comm, v: &[f32]) -> CommBuf {
    CommBuf::from_f32_slice(comm.ledger(), v)
}

fn mismatch(op: &'static str, group: Vec<usize>, ranks: Vec<usize>, detail: &str) -> CommError {
    CommError::Mismatch {
        op,
        group,
        ranks,
        detail: detail.to_string(),
    }
}

#[test]
fn length_mismatch_fails_on_every_rank_and_the_group_recovers() {
    let start = Instant::now();
    let out = run_all(3, Duration::from_secs(5), |r, comm| {
        let len = if r == 1 { 5 } else { 4 };
        let bad = comm
            .all_reduce([0, 1, 2], f32s(comm, &vec![1.0; len]), ReduceOp::Sum)
            .wait();
        let good = comm
            .all_reduce([0, 1, 2], f32s(comm, &[1.0]), ReduceOp::Sum)
            .wait();
        (bad.err(), good.map(|b| b.to_f32_vec()))
    });
    assert!(start.elapsed() < Duration::from_secs(2));
    let want = mismatch(
        "all_reduce",
        vec![0, 1, 2],
        vec![1],
        "ranks 0, 2 called all_reduce(4 × f32, sum); rank 1 called all_reduce(5 × f32, sum)",
    );
    for (bad, good) in out {
        assert_eq!(bad.as_ref(), Some(&want));
        assert_eq!(good, Ok(vec![3.0]));
    }
    assert_eq!(
        want.to_string(),
        "all_reduce on group [0, 1, 2]: members disagree (ranks [1]): \
         ranks 0, 2 called all_reduce(4 × f32, sum); rank 1 called all_reduce(5 × f32, sum)"
    );
}

#[test]
fn different_operations_and_dtypes_are_mismatches() {
    let out = run_all(2, Duration::from_secs(5), |r, comm| {
        let kind = if r == 0 {
            comm.barrier([0, 1]).wait().err()
        } else {
            comm.broadcast([0, 1], f32s(comm, &[1.0, 2.0]), 0)
                .wait()
                .err()
        };
        let input = if r == 0 {
            f32s(comm, &[1.0])
        } else {
            CommBuf::zeros(comm.ledger(), DType::Bf16, 1)
        };
        let dtype = comm.all_gather([0, 1], input, vec![1, 1]).wait().err();
        (kind, dtype)
    });
    let detail = "rank 0 called barrier; rank 1 called broadcast(2 × f32, root 0)";
    // Each rank names the operation it called itself.
    for (r, op) in [(0, "barrier"), (1, "broadcast")] {
        assert_eq!(out[r].0, Some(mismatch(op, vec![0, 1], vec![1], detail)));
        assert_eq!(
            out[r].1,
            Some(mismatch(
                "all_gather",
                vec![0, 1],
                vec![1],
                "rank 0 called all_gather(f32, counts [1, 1]); \
                 rank 1 called all_gather(bf16, counts [1, 1])"
            ))
        );
    }
}

#[test]
fn bad_arguments_on_one_rank_reach_its_peers() {
    let out = run_all(3, Duration::from_secs(5), |r, comm| {
        let len = if r == 2 { 2 } else { 1 };
        let g = comm.all_gather([0, 1, 2], f32s(comm, &vec![0.0; len]), vec![1, 1, 1]);
        g.wait().err()
    });
    let message = "input has 2 elements but counts[2] = 1";
    let detail = format!("rank 2: all_gather: {message}");
    for e in &out[..2] {
        let want = mismatch("all_gather", vec![0, 1, 2], vec![2], &detail);
        assert_eq!(e, &Some(want));
    }
    let invalid = CommError::InvalidArgument {
        op: "all_gather",
        message: message.to_string(),
    };
    assert_eq!(out[2], Some(invalid));

    let out = run_all(2, Duration::from_secs(5), |r, comm| {
        let (send, recv) = if r == 0 {
            (vec![1, 2], vec![1, 1])
        } else {
            (vec![1, 1], vec![3, 1])
        };
        let x = f32s(comm, &vec![0.0; send.iter().sum()]);
        comm.all_to_all([0, 1], x, send, recv).wait().err()
    });
    let detail = "rank 0 sends 2 elements to rank 1 but rank 1 expects 3";
    for e in out {
        assert_eq!(
            e,
            Some(mismatch("all_to_all", vec![0, 1], vec![0, 1], detail))
        );
    }
}

#[test]
fn local_errors_do_not_involve_peers() {
    let out = run_all(2, Duration::from_secs(5), |r, comm| {
        let other = 1 - r;
        let errors = vec![
            comm.all_reduce([other], f32s(comm, &[1.0]), ReduceOp::Sum)
                .wait()
                .err(),
            comm.barrier([1, 0]).wait().err(),
            comm.barrier([0, 7]).wait().err(),
            comm.send(5, 0, f32s(comm, &[1.0])).wait().err(),
            comm.broadcast([r], f32s(comm, &[1.0]), 1).wait().err(),
        ];
        let after = comm
            .all_reduce([0, 1], f32s(comm, &[2.0]), ReduceOp::Mean)
            .wait();
        (
            errors
                .into_iter()
                .map(|e| e.map(|e| e.to_string()))
                .collect::<Vec<_>>(),
            after.map(|b| b.to_f32_vec()),
        )
    });
    for (r, (errors, after)) in out.into_iter().enumerate() {
        let s = |x: &str| Some(x.to_string());
        assert_eq!(
            errors,
            vec![
                s(&format!("all_reduce: rank {r} is not in group [{}]", 1 - r)),
                s("barrier: group [1, 0] must list world ranks in increasing order without repeats"),
                s("barrier: group [0, 7] names rank 7 but the world has 2 ranks"),
                s("send: peer rank 5 is out of range: the world has 2 ranks"),
                s("broadcast: root index 1 is out of range for a group of 1"),
            ]
        );
        assert_eq!(after, Ok(vec![2.0]));
    }
}

#[test]
fn recv_of_the_wrong_size_is_a_mismatch() {
    let out = run_all(2, Duration::from_secs(5), |r, comm| {
        if r == 0 {
            comm.send(1, 4, f32s(comm, &[1.0, 2.0, 3.0])).wait().err()
        } else {
            comm.recv(0, 4, 2, DType::F32).wait().err()
        }
    });
    assert_eq!(out[0], None);
    let detail = "rank 0 sent 3 × f32 with tag 4; rank 1 expects 2 × f32";
    assert_eq!(out[1], Some(mismatch("recv", vec![0, 1], vec![0], detail)));
}

#[test]
fn absent_peer_times_out_naming_it() {
    let timeout = Duration::from_millis(300);
    let seen = Mutex::new(None);
    let start = Instant::now();
    let res = run_ranks(2, timeout, |ctx| -> Result<(), BoxError> {
        let comm = ctx.comm(Ledger::new())?;
        if ctx.rank() == 0 {
            let t = Instant::now();
            let e = comm
                .all_reduce([0, 1], f32s(&comm, &[1.0]), ReduceOp::Sum)
                .wait()
                .err();
            *seen.lock().expect("lock") = Some((e.clone(), t.elapsed()));
            if let Some(e) = e {
                return Err(e.into());
            }
        }
        Ok(())
    });
    let message = "all_reduce on group [0, 1] timed out after 300ms waiting for rank 1";
    assert_eq!(
        res,
        Err(RankFailure {
            rank: 0,
            message: message.to_string()
        })
    );
    let (err, elapsed) = seen.into_inner().expect("lock").expect("rank 0 ran");
    let want = CommError::Timeout {
        op: "all_reduce",
        group: vec![0, 1],
        missing: vec![1],
        after: timeout,
    };
    assert_eq!(err, Some(want));
    assert!(
        elapsed >= timeout && elapsed < Duration::from_millis(1500),
        "{elapsed:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(2));

    // Two absent members, and a receive that never gets its message.
    let res = run_ranks(
        3,
        Duration::from_millis(200),
        |ctx| -> Result<(), CommError> {
            let comm = ctx.comm(Ledger::new())?;
            match ctx.rank() {
                0 => comm.barrier([0, 1, 2]).wait(),
                _ => Ok(()),
            }
        },
    );
    let message = "barrier on group [0, 1, 2] timed out after 200ms waiting for ranks 1, 2";
    assert_eq!(
        res.map_err(|e| e.to_string()),
        Err(format!("rank 0 failed: {message}"))
    );
    let res = run_ranks(
        2,
        Duration::from_millis(200),
        |ctx| -> Result<(), CommError> {
            let comm = ctx.comm(Ledger::new())?;
            match ctx.rank() {
                1 => comm.recv(0, 3, 1, DType::F32).wait().map(drop),
                _ => Ok(()),
            }
        },
    );
    let message = "recv on group [0, 1] timed out after 200ms waiting for rank 0";
    assert_eq!(res.map_err(|e| e.message), Err(message.to_string()));
}

/// Rank 2 of 4 fails after the first all-reduce while the others wait in the second.
fn failing_rank(
    fail: impl Fn() -> Result<(), BoxError> + Sync,
) -> (Result<Vec<()>, RankFailure>, Seen) {
    let timeout = Duration::from_secs(5);
    let seen = Mutex::new(Vec::new());
    let res = run_ranks(4, timeout, |ctx| -> Result<(), BoxError> {
        let comm = ctx.comm(Ledger::new())?;
        let world = [0, 1, 2, 3];
        comm.all_reduce(world, f32s(&comm, &[1.0]), ReduceOp::Sum)
            .wait()?;
        if ctx.rank() == 2 {
            thread::sleep(Duration::from_millis(100));
            return fail();
        }
        let t = Instant::now();
        let pending = comm
            .all_reduce(world, f32s(&comm, &[1.0]), ReduceOp::Sum)
            .wait();
        let elapsed = t.elapsed();
        let later = comm.barrier(world).wait();
        let mut seen = seen.lock().expect("lock");
        for e in [pending.err(), later.err()].into_iter().flatten() {
            seen.push((ctx.rank(), e, elapsed));
        }
        Err("expected a failure".into())
    });
    let mut seen = seen.into_inner().expect("lock");
    seen.sort_by_key(|s| s.0);
    (res, seen)
}

#[test]
fn a_failing_rank_stops_everyone_promptly() {
    let (res, seen) = failing_rank(|| Err("data loader crashed".into()));
    let failure = RankFailure {
        rank: 2,
        message: "data loader crashed".to_string(),
    };
    assert_eq!(res, Err(failure.clone()));
    assert_eq!(failure.to_string(), "rank 2 failed: data loader crashed");
    let peer = CommError::PeerFailed {
        rank: 2,
        reason: "data loader crashed".to_string(),
    };
    assert_eq!(peer.to_string(), "rank 2 failed: data loader crashed");
    assert_eq!(
        seen.iter().map(|s| s.0).collect::<Vec<_>>(),
        vec![0, 0, 1, 1, 3, 3]
    );
    for (_, e, elapsed) in seen {
        assert_eq!(e, peer);
        assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
    }
}

#[test]
fn a_panicking_rank_is_reported_the_same_way() {
    let (res, seen) = failing_rank(|| panic!("out of memory in layer 3"));
    let message = "panicked: out of memory in layer 3".to_string();
    assert_eq!(
        res,
        Err(RankFailure {
            rank: 2,
            message: message.clone()
        })
    );
    assert_eq!(seen.len(), 6);
    for (_, e, elapsed) in seen {
        assert_eq!(
            e,
            CommError::PeerFailed {
                rank: 2,
                reason: message.clone()
            }
        );
        assert!(elapsed < Duration::from_millis(2500), "{elapsed:?}");
    }
}

#[test]
fn worlds_and_communicators_refuse_bad_requests() {
    assert!(ThreadWorld::new(0, Duration::from_secs(1)).is_err());
    let world = ThreadWorld::new(2, Duration::from_secs(1)).expect("world");
    let e = world.comm(2, Ledger::new()).err().map(|e| e.to_string());
    assert_eq!(
        e.as_deref(),
        Some("comm: rank 2 is out of range: the world has 2 ranks")
    );
    let comm = world.comm(1, Ledger::new()).expect("first");
    let e = world.comm(1, Ledger::new()).err().map(|e| e.to_string());
    assert_eq!(
        e.as_deref(),
        Some("comm: rank 1 already has a communicator")
    );
    let mut h = comm.barrier([1]);
    let t = Instant::now();
    while !h.is_complete() && t.elapsed() < Duration::from_secs(1) {
        thread::yield_now();
    }
    assert!(h.is_complete());
    assert_eq!(h.wait(), Ok(()));
    comm.fail("stopping");
    let e = comm.barrier([1]).wait();
    assert_eq!(
        e,
        Err(CommError::PeerFailed {
            rank: 1,
            reason: "stopping".to_string()
        })
    );
    assert_eq!(
        run_ranks(0, Duration::from_secs(1), |_| Ok::<u8, CommError>(1)),
        Ok(vec![])
    );
}

#[test]
fn an_unbounded_timeout_is_accepted() {
    let out = run_all(2, Duration::MAX, |_, comm| {
        let y = comm.all_reduce([0, 1], f32s(comm, &[1.0]), ReduceOp::Sum);
        y.wait().map(|b| b.to_f32_vec())
    });
    assert_eq!(out, vec![Ok(vec![2.0]), Ok(vec![2.0])]);
}
