//! Collectives over a group's communicator, bit-identical to the threads backend's: after the
//! header exchange agrees, the data moves as raw bits with `MPI_Ialltoallv`,
//! `MPI_Iallgatherv`, `MPI_Ibcast` or `MPI_Ibarrier`, and reductions happen locally in
//! group-index order in f32 with a single rounding, exactly as
//! [`ThreadWorld`](crate::ThreadWorld) computes them (see the table in the
//! [module documentation](crate::mpi)).
//!
//! MPI cannot cancel a started collective, so when a wait gives up the buffers it uses are
//! leaked rather than freed under MPI's feet.

use std::os::raw::{c_int, c_void};

use ::mpi::ffi;
use ferrotron_tensor::{Category, Held, Ledger};

use super::poll::Waited;
use super::raw::{buf_mut_ptr, buf_ptr, f32_bits_type, ints, null_request, prefix, raw_type};
use super::MpiWorld;
use crate::buf::{Builder, CommBuf, DType};
use crate::collective::even_range;
use crate::error::CommError;
use crate::op::{check_agreement, Op, OpOutput, ReduceOp, Signature};

/// Σ over members, in group-index order and in f32, of `n` consecutive chunks of `m`
/// elements (as [`collective::sum_range`](crate::collective) does over separate buffers).
fn sum_chunks(chunks: &CommBuf, n: usize, m: usize) -> Vec<f32> {
    let mut acc = vec![0.0f32; m];
    if n > 0 {
        chunks.read_into(0, &mut acc);
        for j in 1..n {
            chunks.add_into(j * m, &mut acc);
        }
    }
    acc
}

/// One collective as its member `index` runs it: its name, its group (world ranks), the
/// group's communicator, and the ledger its buffers are counted on.
struct Call<'a> {
    name: &'static str,
    group: &'a [usize],
    index: usize,
    comm: ffi::MPI_Comm,
    ledger: &'a Ledger,
}

impl Call<'_> {
    /// The group's size.
    fn n(&self) -> usize {
        self.group.len()
    }
}

impl MpiWorld {
    /// Starts one non-blocking collective with `start` (under the lock) and waits for it.
    /// On an error the caller must leak the buffers the collective uses.
    fn run_collective(
        &self,
        op: &'static str,
        group: &[usize],
        call: &str,
        start: impl FnOnce(&mut ffi::MPI_Request) -> c_int,
    ) -> Result<(), CommError> {
        let mut request = [null_request()];
        self.with_mpi(op, |_| {
            let code = start(&mut request[0]);
            self.check_code(op, call, code)
        })?;
        match self.wait_all(op, &mut request)? {
            Waited::Done => Ok(()),
            Waited::Late(_) => {
                let others = group.iter().copied().filter(|&r| r != self.rank).collect();
                Err(self.timed_out(op, group, others))
            }
        }
    }

    /// `MPI_Ialltoallv` of raw elements of `dtype` from `input` into `output`.
    fn alltoallv(
        &self,
        call: &Call<'_>,
        dtype: DType,
        input: *const c_void,
        send: (&[usize], &[usize]),
        output: *mut c_void,
        recv: (&[usize], &[usize]),
    ) -> Result<(), CommError> {
        let (sc, sd) = (ints(send.0.iter().copied()), ints(send.1.iter().copied()));
        let (rc, rd) = (ints(recv.0.iter().copied()), ints(recv.1.iter().copied()));
        let (ty, comm) = (raw_type(dtype), call.comm);
        let result = self.run_collective(call.name, call.group, "MPI_Ialltoallv", |req| {
            // SAFETY: the counts and displacements describe ranges inside `input` and
            // `output` (sizes were checked and agreed on by every member); the buffers
            // outlive the request or are leaked by the caller.
            unsafe {
                ffi::MPI_Ialltoallv(
                    input,
                    sc.as_ptr(),
                    sd.as_ptr(),
                    ty,
                    output,
                    rc.as_ptr(),
                    rd.as_ptr(),
                    ty,
                    comm,
                    req,
                )
            }
        });
        if result.is_err() {
            std::mem::forget((sc, sd, rc, rd));
        }
        result
    }

    /// `MPI_Iallgatherv` of `count` elements of type `ty` into `output` at `displs`.
    fn allgatherv(
        &self,
        call: &Call<'_>,
        ty: ffi::MPI_Datatype,
        input: *const c_void,
        count: usize,
        output: *mut c_void,
        recv: (&[usize], &[usize]),
    ) -> Result<(), CommError> {
        let (rc, rd) = (ints(recv.0.iter().copied()), ints(recv.1.iter().copied()));
        let (count, comm) = (ints([count])[0], call.comm);
        let result = self.run_collective(call.name, call.group, "MPI_Iallgatherv", |req| {
            // SAFETY: as in `alltoallv`.
            unsafe {
                ffi::MPI_Iallgatherv(
                    input,
                    count,
                    ty,
                    output,
                    rc.as_ptr(),
                    rd.as_ptr(),
                    ty,
                    comm,
                    req,
                )
            }
        });
        if result.is_err() {
            std::mem::forget((rc, rd));
        }
        result
    }

    /// Runs `op` as member `index` of its group: the members' signatures exchanged and
    /// checked for agreement (an argument error of any member fails every member), then the
    /// data moved.
    pub(super) fn collective(
        &self,
        index: usize,
        op: Op,
        args: Result<(), CommError>,
        ledger: &Ledger,
    ) -> Result<OpOutput, CommError> {
        let name = op.name();
        let group = op.group().unwrap_or_default().to_vec();
        let sig = op.signature(args.as_ref().err().map(ToString::to_string));
        let comm = self.group_comm(name, &group, index)?;
        let sigs = self.exchange_signatures(name, &group, index, comm, &sig)?;
        args?;
        let refs: Vec<&Signature> = sigs.iter().collect();
        check_agreement(name, &group, &refs)?;
        let call = Call {
            name,
            group: &group,
            index,
            comm,
            ledger,
        };
        let out = match op {
            Op::AllReduce {
                buf, op: reduce, ..
            } => self.all_reduce(&call, buf, reduce)?,
            Op::ReduceScatter { input, counts, .. } => {
                self.reduce_scatter(&call, input, &counts)?
            }
            Op::AllGather { input, counts, .. } => self.all_gather(&call, input, &counts)?,
            Op::Broadcast { buf, root, .. } => self.broadcast(&call, buf, root)?,
            Op::AllToAll {
                input,
                send_counts,
                recv_counts,
                ..
            } => self.all_to_all(&call, input, (&send_counts, &recv_counts))?,
            Op::Barrier { .. } => {
                self.run_collective(name, &group, "MPI_Ibarrier", |req| {
                    // SAFETY: a barrier reads and writes no buffer.
                    unsafe { ffi::MPI_Ibarrier(comm, req) }
                })?;
                return Ok(OpOutput::Done);
            }
            Op::Send { .. } | Op::Recv { .. } => return Ok(OpOutput::Done),
        };
        Ok(OpOutput::Buf(out))
    }

    /// `buf`'s elements, ranges of them (`counts` from `starts`), sent to the member that
    /// reduces each (`MPI_Ialltoallv` into `n` chunks of this member's range): the chunks
    /// summed in group order, as [`sum_chunks`] does, with the guard that counts the sum on
    /// the ledger.
    fn reduce_range(
        &self,
        call: &Call<'_>,
        buf: CommBuf,
        (counts, starts): (&[usize], &[usize]),
    ) -> Result<(Vec<f32>, Held), CommError> {
        let (n, ledger, dtype) = (call.n(), call.ledger, buf.dtype());
        let m = counts[call.index];
        let mut chunks = CommBuf::zeros(ledger, dtype, n * m);
        let same = vec![m; n];
        let at: Vec<usize> = (0..n).map(|j| j * m).collect();
        let moved = self.alltoallv(
            call,
            dtype,
            buf_ptr(&buf),
            (counts, starts),
            buf_mut_ptr(&mut chunks),
            (&same, &at),
        );
        if let Err(e) = moved {
            std::mem::forget((buf, chunks));
            return Err(e);
        }
        drop(buf);
        let held = ledger.hold(Category::Communication, 4 * m);
        let sum = sum_chunks(&chunks, n, m);
        drop(chunks);
        Ok((sum, held))
    }

    /// All-reduce: each member reduces an even range of the elements ([`Self::reduce_range`],
    /// divided by `n` for a mean), then every range is gathered to every member in f32 and
    /// rounded once to `buf`'s type.
    fn all_reduce(
        &self,
        call: &Call<'_>,
        buf: CommBuf,
        reduce: ReduceOp,
    ) -> Result<CommBuf, CommError> {
        let (n, ledger, dtype, len) = (call.n(), call.ledger, buf.dtype(), buf.len());
        let ranges: Vec<(usize, usize)> = (0..n).map(|j| even_range(len, n, j)).collect();
        let counts: Vec<usize> = ranges.iter().map(|&(s, e)| e - s).collect();
        let starts: Vec<usize> = ranges.iter().map(|&(s, _)| s).collect();
        let m = counts[call.index];
        let (mut share, held) = self.reduce_range(call, buf, (&counts, &starts))?;
        if reduce == ReduceOp::Mean {
            let k = n as f32;
            share.iter_mut().for_each(|x| *x /= k);
        }
        drop(held);
        let share = ledger.from_vec(Category::Communication, share);
        let sums_held = ledger.hold(Category::Communication, 4 * len);
        let mut sums = vec![0.0f32; len];
        let gathered = self.allgatherv(
            call,
            f32_bits_type(),
            share.host().as_ptr().cast(),
            m,
            sums.as_mut_ptr().cast(),
            (&counts, &starts),
        );
        if let Err(e) = gathered {
            std::mem::forget((share, sums, sums_held));
            return Err(e);
        }
        drop((share, sums_held));
        Ok(Builder { ledger, dtype }.rounded(sums))
    }

    /// Reduce-scatter: this member's `counts[index]` elements, summed over the members.
    fn reduce_scatter(
        &self,
        call: &Call<'_>,
        input: CommBuf,
        counts: &[usize],
    ) -> Result<CommBuf, CommError> {
        let (ledger, dtype) = (call.ledger, input.dtype());
        let (sum, held) = self.reduce_range(call, input, (counts, &prefix(counts)))?;
        drop(held);
        Ok(Builder { ledger, dtype }.rounded(sum))
    }

    /// All-gather: every member's `counts[j]` elements, in group order.
    fn all_gather(
        &self,
        call: &Call<'_>,
        input: CommBuf,
        counts: &[usize],
    ) -> Result<CommBuf, CommError> {
        let dtype = input.dtype();
        let mut out = CommBuf::zeros(call.ledger, dtype, counts.iter().sum());
        let gathered = self.allgatherv(
            call,
            raw_type(dtype),
            buf_ptr(&input),
            input.len(),
            buf_mut_ptr(&mut out),
            (counts, &prefix(counts)),
        );
        if let Err(e) = gathered {
            std::mem::forget((input, out));
            return Err(e);
        }
        Ok(out)
    }

    /// Broadcast: member `root`'s elements on every member.
    fn broadcast(&self, call: &Call<'_>, buf: CommBuf, root: usize) -> Result<CommBuf, CommError> {
        let (ledger, dtype, len, comm) = (call.ledger, buf.dtype(), buf.len(), call.comm);
        let mut out = if root == call.index {
            Builder { ledger, dtype }.concat(&[(&buf, 0, len)])
        } else {
            CommBuf::zeros(ledger, dtype, len)
        };
        drop(buf);
        let ptr = buf_mut_ptr(&mut out);
        let count = ints([len])[0];
        let moved = self.run_collective(call.name, call.group, "MPI_Ibcast", |req| {
            // SAFETY: `out` holds `len` elements on every member (agreed on) and
            // outlives the request or is leaked.
            unsafe { ffi::MPI_Ibcast(ptr, count, raw_type(dtype), root as c_int, comm, req) }
        });
        if let Err(e) = moved {
            std::mem::forget(out);
            return Err(e);
        }
        Ok(out)
    }

    /// All-to-all: `send[j]` elements to member `j`, `recv[j]` from it, in group order.
    fn all_to_all(
        &self,
        call: &Call<'_>,
        input: CommBuf,
        (send, recv): (&[usize], &[usize]),
    ) -> Result<CommBuf, CommError> {
        let dtype = input.dtype();
        let mut out = CommBuf::zeros(call.ledger, dtype, recv.iter().sum());
        let moved = self.alltoallv(
            call,
            dtype,
            buf_ptr(&input),
            (send, &prefix(send)),
            buf_mut_ptr(&mut out),
            (recv, &prefix(recv)),
        );
        if let Err(e) = moved {
            std::mem::forget((input, out));
            return Err(e);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sums_match_group_order() {
        let ledger = Ledger::new();
        let chunks = CommBuf::from_f32_slice(&ledger, &[1e8, 2.0, 1.0, 3.0, -1e8, 4.0]);
        assert_eq!(sum_chunks(&chunks, 3, 2), vec![0.0, 9.0]);
    }
}
