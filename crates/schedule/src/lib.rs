//! Pipeline-parallel schedules as data (playbook §4, design step 2).
//!
//! [`schedule`] is a pure function of `(kind, p, m, v)` that returns, per pipeline rank, the
//! ordered [`Action`]s of one training step: forwards, backwards (or zero bubble's split
//! `BackwardInput`/`BackwardWeight`), and the point-to-point sends and receives between
//! them, each placed where the executor posts it — a receive right before the computation
//! that needs it, a send right after the computation that produced it.
//!
//! [`simulate`] walks those lists with blocking receives and buffered sends under per-action
//! [`Costs`], detects deadlock, and reports the step time, each rank's busy and idle time and
//! its peak number of live activation sets; [`Simulation::bubble_fraction`] is the playbook's
//! bubble time over ideal time. The memory estimator can read
//! [`Schedule::peak_in_flight`] straight from the lists.
//!
//! What the tests establish, with free communication (`p2p = 0`) and costs per
//! `(micro-batch, chunk)`:
//! - AFAB, 1F1B and interleaved lose exactly `(p−1)·(F+B)` per rank for any `F`, `B`, so
//!   the bubble fraction is `(p−1)/m`, and `(p−1)/(v·m)` interleaved (`m` a multiple of `p`).
//! - Zero bubble (ZB-H1) with `m ≥ p` loses `(p−1)·(F + B_input − min(W, B_input))`, the
//!   paper's `(p−1)(F+B−W)`: `(p−1)/(3m)` at `F = B_input = W`. With `m < p` it loses
//!   `(2p−1−m)·F` at equal costs, the least any schedule can.
//! - With `p2p > 0`, AFAB loses `(p−1)·(F+B+2·p2p)`; 1F1B's steady state waits on a
//!   round trip every micro-batch, so its loss grows with `m`.
//!
//! ```
//! use ferrotron_schedule::{schedule, Costs, ScheduleKind};
//!
//! let s = schedule(ScheduleKind::OneFOneB, 4, 8, 1)?;
//! assert_eq!(s.peak_in_flight(0)?, 4);
//! let bubble = s.bubble_fraction(&Costs::default())?;
//! assert!((bubble - 3.0 / 8.0).abs() < 1e-12);
//! # Ok::<(), ferrotron_schedule::ScheduleError>(())
//! ```

#![warn(missing_docs)]

mod action;
mod build;
mod dualpipev;
mod error;
mod kind;
mod placement;
mod schedule;
mod shape;
mod sim;
mod split;

pub use action::{Action, Flow};
pub use build::{compute_actions, schedule};
pub use error::{ScheduleError, Stuck};
pub use kind::{ScheduleKind, MAX_UNITS};
pub use placement::Placement;
pub use schedule::Schedule;
pub use sim::{simulate, Costs, RankStats, Simulation, Timed};
pub use split::{check_split, rank_chunks, stage_sizes};
