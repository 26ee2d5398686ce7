//! Communicators of process groups: each group gets its own, created with
//! `MPI_Comm_create_group` (collective over the group's members only, not the world) the
//! first time the group is used, and cached by member list.
//!
//! Creating a communicator is a blocking MPI call, so the members first greet each other
//! with polled point-to-point messages on a control communicator: a member that never comes
//! is reported as [`CommError::Timeout`] instead of hanging, and ranks that set up their
//! shared groups in different orders (which would deadlock) are told so.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::os::raw::c_int;

use ::mpi::ffi;
use ::mpi::raw::AsRaw;
use ::mpi::traits::{Communicator, Group};

use super::poll::Waited;
use super::raw::{bytes_type, ints, null_request};
use super::MpiWorld;
use crate::error::CommError;

/// Tag of the greeting members exchange before creating a group's communicator.
const TAG_HELLO: c_int = 3;

/// A stable MPI tag for creating the communicator of `group` (distinct groups rarely
/// share one; the MPI standard guarantees tags up to 32767).
fn group_tag(group: &[usize]) -> c_int {
    let mut h = DefaultHasher::new();
    group.hash(&mut h);
    (h.finish() % 32_000) as c_int + 100
}

impl MpiWorld {
    /// The communicator of `group`, created on first use: the members first greet each
    /// other (polled, so a member that never comes is reported after the timeout), then
    /// create it with `MPI_Comm_create_group`, collective over the members only.
    pub(super) fn group_comm(
        &self,
        op: &'static str,
        group: &[usize],
        index: usize,
    ) -> Result<ffi::MPI_Comm, CommError> {
        let cached = self.with_mpi(op, |mpi| Ok(mpi.groups.get(group).map(|c| c.as_raw())))?;
        if let Some(comm) = cached {
            return Ok(comm);
        }
        self.greet(op, group, index)?;
        self.with_mpi(op, |mpi| {
            let ranks: Vec<c_int> = ints(group.iter().copied());
            let universe = mpi.universe.as_ref().ok_or_else(|| self.finalized(op))?;
            let world = universe.world();
            let members = world.group().include(&ranks);
            let comm = world
                .split_by_subgroup_with_tag(&members, group_tag(group))
                .ok_or_else(|| CommError::Backend {
                    op,
                    rank: self.rank,
                    message: format!("MPI_Comm_create_group gave no communicator for {group:?}"),
                })?;
            let raw = comm.as_raw();
            mpi.groups.insert(group.to_vec(), comm);
            Ok(raw)
        })
    }

    /// Exchanges a greeting naming `group` with every other member, so that creating the
    /// group's communicator (a blocking MPI call) starts only once all members are there.
    /// Greetings between two ranks are matched in order, so two ranks that set up their
    /// shared groups in different orders (which would deadlock) are told so.
    fn greet(&self, op: &'static str, group: &[usize], index: usize) -> Result<(), CommError> {
        let peers: Vec<usize> = (0..group.len()).filter(|&j| j != index).collect();
        if peers.is_empty() {
            return Ok(());
        }
        let mut h = DefaultHasher::new();
        group.hash(&mut h);
        let mine = h.finish().to_le_bytes().to_vec();
        let mut inbox = vec![0u8; 8 * peers.len()];
        let mut requests = vec![null_request(); 2 * peers.len()];
        let started = self.with_mpi(op, |mpi| {
            let comm = mpi
                .control
                .as_ref()
                .map(|c| c.as_raw())
                .ok_or_else(|| self.finalized(op))?;
            let (recvs, sends) = requests.split_at_mut(peers.len());
            for (k, &j) in peers.iter().enumerate() {
                let peer = group[j] as c_int;
                // SAFETY: the buffers outlive the requests (they are leaked if the wait
                // gives up) and are not touched until the requests complete.
                unsafe {
                    let code = ffi::MPI_Irecv(
                        inbox[8 * k..].as_mut_ptr().cast(),
                        8,
                        bytes_type(),
                        peer,
                        TAG_HELLO,
                        comm,
                        &mut recvs[k],
                    );
                    self.check_code(op, "MPI_Irecv", code)?;
                    let code = ffi::MPI_Isend(
                        mine.as_ptr().cast(),
                        8,
                        bytes_type(),
                        peer,
                        TAG_HELLO,
                        comm,
                        &mut sends[k],
                    );
                    self.check_code(op, "MPI_Isend", code)?;
                }
            }
            Ok(())
        });
        match started.and_then(|()| self.wait_all(op, &mut requests)) {
            Ok(Waited::Done) => {}
            Ok(Waited::Late(pending)) => {
                let missing = pending
                    .iter()
                    .map(|&i| group[peers[i % peers.len()]])
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect();
                std::mem::forget((inbox, mine));
                return Err(self.timed_out(op, group, missing));
            }
            Err(e) => {
                std::mem::forget((inbox, mine));
                return Err(e);
            }
        }
        let others: Vec<usize> = peers
            .iter()
            .enumerate()
            .filter(|&(k, _)| inbox[8 * k..8 * k + 8] != mine[..])
            .map(|(_, &j)| group[j])
            .collect();
        if others.is_empty() {
            return Ok(());
        }
        let err = CommError::Backend {
            op,
            rank: self.rank,
            message: format!(
                "{} set up another group first while this rank sets up {group:?}: ranks must \
                 start using the groups they share in the same order",
                crate::error::rank_words(&others)
            ),
        };
        self.record_failure(self.rank, err.to_string());
        Err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_tags_stay_in_range() {
        let t = group_tag(&[0, 1, 2]);
        assert!((100..32_100).contains(&t));
        assert_eq!(t, group_tag(&[0, 1, 2]));
    }
}
