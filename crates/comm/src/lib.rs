//! Communication for ferrotron: the grid of ranks and its process groups, and collectives
//! with asynchronous handles.
//!
//! - [`topology`]: [`Topology`] (`dp · pp · cp · tp` ranks, TP innermost, DP outermost,
//!   expert parallelism folded into DP), [`Coords`], [`Group`]s of every [`GroupKind`], and a
//!   printable description of the layout.
//! - [`Comm`]: one rank's communicator. Every operation (all-reduce, reduce-scatter,
//!   all-gather, broadcast, all-to-all, send/recv, barrier) is queued to the rank's single
//!   worker thread, runs in issue order and returns a [`Handle`] at once; `handle.wait()`
//!   gives the output, allocated on the rank's [`Ledger`](ferrotron_tensor::Ledger) under
//!   `Category::Communication`. Members check that they called the same thing
//!   ([`CommError::Mismatch`]), every wait ends after the world's timeout
//!   ([`CommError::Timeout`]) and a failed rank stops everyone promptly
//!   ([`CommError::PeerFailed`]).
//! - [`Transport`]: what a backend implements. [`ThreadWorld`] runs ranks as threads of
//!   this process and meets in shared memory; [`run_ranks`] launches one closure per rank
//!   and reports the first [`RankFailure`].
//! - [`bench_collective`]: time and algorithm/bus bandwidth of a collective, as
//!   nccl-tests defines them.
//!
//! ```
//! use std::time::Duration;
//! use ferrotron_comm::{run_ranks, CommBuf, ReduceOp};
//! use ferrotron_tensor::Ledger;
//!
//! let sums = run_ranks(2, Duration::from_secs(10), |ctx| {
//!     let comm = ctx.comm(Ledger::new())?;
//!     let mine = CommBuf::from_f32_slice(comm.ledger(), &[ctx.rank() as f32, 1.0]);
//!     let sum = comm.all_reduce([0, 1], mine, ReduceOp::Sum).wait()?;
//!     Ok::<_, ferrotron_comm::CommError>(sum.to_f32_vec())
//! })
//! .unwrap();
//! assert_eq!(sums, vec![vec![1.0, 2.0], vec![1.0, 2.0]]);
//! ```

#![warn(missing_docs)]

pub mod bench;
mod buf;
mod collective;
mod comm;
mod error;
mod harness;
#[cfg(feature = "mpi")]
pub mod mpi;
mod op;
mod threads;
pub mod topology;

pub use bench::{bench_collective, BenchPoint, CollectiveKind};
pub use buf::{CommBuf, DType, STAGING};
pub use comm::{Comm, FromOutput, Handle, OpTiming, Transport};
pub use error::{CommError, RankFailure, TopologyError};
pub use harness::{run_ranks, run_ranks_in, RankContext};
#[cfg(feature = "mpi")]
pub use mpi::MpiWorld;
pub use op::{Op, OpOutput, ReduceOp};
pub use threads::ThreadWorld;
pub use topology::{Coords, Group, GroupKind, Topology};
