//! The scripts both backends run, and how their results become comparable lines: a
//! buffer as its length, dtype and a hash of its exact bits; an error as its kind, fields
//! and message.

use std::thread;
use std::time::Duration;

use ferrotron_comm::{Comm, CommBuf, CommError, DType, ReduceOp};
use ferrotron_tensor::Ledger;

/// How long the sender of the 16 MB message idles before the next collective.
const IDLE_SENDER: Duration = Duration::from_millis(1500);

/// Deterministic values of mixed magnitudes (so that the order of additions shows).
fn data(rank: usize, salt: usize, len: usize) -> Vec<f32> {
    let mut x = ((rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        ^ (salt as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            (u - 0.5) * 10f32.powi(((x >> 20) % 7) as i32 - 3)
        })
        .collect()
}

fn buf(ledger: &Ledger, dtype: DType, values: &[f32]) -> CommBuf {
    match dtype {
        DType::F32 => CommBuf::from_f32_slice(ledger, values),
        DType::Bf16 => CommBuf::bf16_from_f32_slice(ledger, values),
    }
}

/// An error as one line: its kind and fields (`Debug`) and its message (`Display`).
fn error_line(e: &CommError) -> String {
    format!("error {e:?} | {e}").replace('\n', "\\n")
}

/// A buffer as its length, dtype and a hash of its exact bits; or the error.
fn show(result: Result<CommBuf, CommError>) -> String {
    match result {
        Ok(b) => {
            let bits: Vec<u32> = match (b.as_f32(), b.as_bf16()) {
                (Some(x), _) => x.iter().map(|v| v.to_bits()).collect(),
                (_, Some(x)) => x.iter().map(|v| u32::from(v.to_bits())).collect(),
                _ => unreachable!("a buffer is f32 or bf16"),
            };
            let hash = bits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &v| {
                (h ^ u64::from(v)).wrapping_mul(0x100_0000_01b3)
            });
            format!("{} × {} #{hash:016x}", b.len(), b.dtype())
        }
        Err(e) => error_line(&e),
    }
}

fn show_done(result: Result<(), CommError>) -> String {
    match result {
        Ok(()) => "done".to_string(),
        Err(e) => error_line(&e),
    }
}

/// Every operation, with healthy and broken arguments, on a world of [`RANKS`] ranks.
pub fn ops_script(comm: &Comm) -> Vec<String> {
    let r = comm.rank();
    let l = comm.ledger().clone();
    let all = [0usize, 1, 2, 3];
    let pair: Vec<usize> = if r.is_multiple_of(2) {
        vec![0, 2]
    } else {
        vec![1, 3]
    };
    let mut t = Vec::new();
    for dt in [DType::F32, DType::Bf16] {
        for len in [0usize, 1, 3, 4, 5, 1000, 100_003] {
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                let input = buf(&l, dt, &data(r, len, len));
                t.push(show(comm.all_reduce(all, input, op).wait()));
            }
        }
        let input = buf(&l, dt, &data(r, 7, 77));
        t.push(show(comm.all_reduce(&pair, input, ReduceOp::Sum).wait()));
        let input = buf(&l, dt, &data(r, 8, 9));
        t.push(show(comm.all_reduce([r], input, ReduceOp::Mean).wait()));
        let counts = vec![3usize, 0, 5, 1000];
        let total = counts.iter().sum();
        let input = buf(&l, dt, &data(r, 9, total));
        t.push(show(comm.reduce_scatter(all, input, counts.clone()).wait()));
        let input = buf(&l, dt, &data(r, 10, counts[r]));
        t.push(show(comm.all_gather(all, input, counts).wait()));
        let input = buf(&l, dt, &data(r, 11, 333));
        t.push(show(comm.broadcast(all, input, 2).wait()));
        let send: Vec<usize> = (0..4).map(|j| (r * 3 + j * 5) % 7).collect();
        let recv: Vec<usize> = (0..4).map(|j| (j * 3 + r * 5) % 7).collect();
        let input = buf(&l, dt, &data(r, 12, send.iter().sum()));
        t.push(show(comm.all_to_all(all, input, send, recv).wait()));
        t.push(show_done(comm.barrier(all).wait()));
        t.push(show_done(comm.barrier(&pair).wait()));
    }
    // Members that disagree: length, dtype, an invalid argument on one rank, counts.
    let len = if r == 3 { 5 } else { 4 };
    let input = buf(&l, DType::F32, &data(r, 1, len));
    t.push(show(comm.all_reduce(all, input, ReduceOp::Sum).wait()));
    let dt = if r == 1 { DType::Bf16 } else { DType::F32 };
    t.push(show(
        comm.all_gather(all, buf(&l, dt, &data(r, 1, 2)), vec![2; 4])
            .wait(),
    ));
    let n = if r == 2 { 3 } else { 2 };
    let input = buf(&l, DType::F32, &data(r, 1, n));
    t.push(show(comm.all_gather(all, input, vec![2; 4]).wait()));
    let recv = if r == 0 { vec![1, 1, 1, 2] } else { vec![1; 4] };
    let input = buf(&l, DType::F32, &data(r, 1, 4));
    t.push(show(comm.all_to_all(all, input, vec![1; 4], recv).wait()));
    // Healthy again afterwards.
    let input = buf(&l, DType::Bf16, &data(r, 2, 17));
    t.push(show(comm.all_reduce(all, input, ReduceOp::Sum).wait()));
    // A ring of sends, one to self; received out of tag order.
    let (next, prev) = ((r + 1) % 4, (r + 3) % 4);
    let h1 = comm.send(next, 7, buf(&l, DType::F32, &data(r, 3, 10)));
    let h2 = comm.send(next, 8, buf(&l, DType::Bf16, &data(r, 4, 11)));
    let h3 = comm.send(r, 9, buf(&l, DType::F32, &data(r, 5, 3)));
    let sent = [h1.wait(), h2.wait(), h3.wait()].map(show_done);
    t.push(sent.join(", "));
    t.push(show(comm.recv(prev, 8, 11, DType::Bf16).wait()));
    t.push(show(comm.recv(prev, 7, 10, DType::F32).wait()));
    t.push(show(comm.recv(r, 9, 3, DType::F32).wait()));
    // Receives of the wrong length and of the wrong dtype.
    t.push(show_done(
        comm.send(next, 20, buf(&l, DType::F32, &data(r, 6, 4)))
            .wait(),
    ));
    t.push(show_done(
        comm.send(next, 21, buf(&l, DType::F32, &data(r, 6, 4)))
            .wait(),
    ));
    t.push(show(comm.recv(prev, 20, 5, DType::F32).wait()));
    t.push(show(comm.recv(prev, 21, 4, DType::Bf16).wait()));
    // 16 MB to a peer while the sender idles before the next collective.
    if r == 0 {
        let big = buf(&l, DType::F32, &data(r, 30, 4 << 20));
        t.push(show_done(comm.send(1, 30, big).wait()));
        thread::sleep(IDLE_SENDER);
    }
    if r == 1 {
        t.push(show(comm.recv(0, 30, 4 << 20, DType::F32).wait()));
    }
    t.push(show_done(comm.barrier(all).wait()));
    // A malformed group and a peer outside the world.
    let input = buf(&l, DType::F32, &[1.0]);
    t.push(show(comm.all_reduce([0, 0], input, ReduceOp::Sum).wait()));
    t.push(show(comm.recv(9, 1, 1, DType::F32).wait()));
    t
}

/// Rank 0: a group whose other member never comes, then the next operation.
fn stalled_first_use(comm: &Comm) -> Vec<String> {
    vec![
        show_done(comm.barrier([0, 1]).wait()),
        show(comm.recv(2, 1, 1, DType::F32).wait()),
    ]
}

/// Rank 1: a message that is never sent, then the next operation.
fn stalled_recv(comm: &Comm) -> Vec<String> {
    vec![
        show(comm.recv(3, 5, 4, DType::F32).wait()),
        show_done(comm.barrier([1, 3]).wait()),
    ]
}

/// Rank 2: a group set up together with rank 3, which then stays away; then the next
/// operation.
fn stalled_header(comm: &Comm) -> Vec<String> {
    let input = CommBuf::from_f32_slice(comm.ledger(), &[1.0, 2.0]);
    vec![
        show_done(comm.barrier([2, 3]).wait()),
        show(comm.all_reduce([2, 3], input, ReduceOp::Sum).wait()),
        show_done(comm.barrier([2, 3]).wait()),
    ]
}

/// Rank 3: sets up the group with rank 2, then stays away.
fn helps_set_up(comm: &Comm) -> Vec<String> {
    vec![show_done(comm.barrier([2, 3]).wait())]
}

/// The timeouts script of `rank` (ranks 0 to 3).
pub fn timeouts_script(rank: usize, comm: &Comm) -> Vec<String> {
    [
        stalled_first_use,
        stalled_recv,
        stalled_header,
        helps_set_up,
    ][rank](comm)
}
