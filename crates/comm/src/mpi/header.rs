//! The header exchange that starts every collective: each member sends every other member
//! its [`Signature`] (operation, dtype, sizes, or why its own arguments are invalid) by
//! point-to-point messages on the group's communicator, so that every member can check the
//! headers with the threads backend's rules
//! ([`check_agreement`](crate::op::check_agreement)) and the data collective is never
//! called with inconsistent sizes.
//!
//! A header is a fixed-size slot; a signature too long for it follows as a second message.
//! Waits are polled, so a member whose header never comes is named in
//! [`CommError::Timeout`].

use std::os::raw::c_int;

use ::mpi::ffi;

use super::poll::Waited;
use super::raw::{bytes_type, null_request};
use super::MpiWorld;
use crate::error::CommError;
use crate::op::Signature;

/// Bytes of the fixed-size header every member sends every other member of a collective.
const SLOT: usize = 256;
/// Header bytes available for the encoded signature (after its 8-byte length).
const INLINE: usize = SLOT - 8;
/// Tag of the fixed-size header on a group's communicator.
const TAG_HEADER: c_int = 1;
/// Tag of a signature too long for the fixed-size header.
const TAG_HEADER_LONG: c_int = 2;
/// Largest encoded signature accepted from a peer.
const MAX_SIGNATURE: usize = 64 << 20;

fn encode_signature(sig: &Signature) -> Vec<u8> {
    fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
        out.extend_from_slice(b);
    }
    fn put_counts(out: &mut Vec<u8>, v: &[usize]) {
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for &x in v {
            out.extend_from_slice(&(x as u64).to_le_bytes());
        }
    }
    let mut out = Vec::new();
    put_bytes(&mut out, sig.common.as_bytes());
    put_counts(&mut out, &sig.send);
    put_counts(&mut out, &sig.recv);
    match &sig.invalid {
        Some(m) => {
            out.push(1);
            put_bytes(&mut out, m.as_bytes());
        }
        None => out.push(0),
    }
    out
}

fn decode_signature(bytes: &[u8]) -> Option<Signature> {
    struct Reader<'a>(&'a [u8]);
    impl Reader<'_> {
        fn take(&mut self, n: usize) -> Option<&[u8]> {
            if n > self.0.len() {
                return None;
            }
            let (head, rest) = self.0.split_at(n);
            self.0 = rest;
            Some(head)
        }
        fn u64(&mut self) -> Option<u64> {
            Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
        }
        fn len(&mut self) -> Option<usize> {
            usize::try_from(self.u64()?).ok()
        }
        fn string(&mut self) -> Option<String> {
            let n = self.len()?;
            String::from_utf8(self.take(n)?.to_vec()).ok()
        }
        fn counts(&mut self) -> Option<Vec<usize>> {
            let n = self.len()?;
            if n > self.0.len() / 8 {
                return None;
            }
            (0..n).map(|_| self.len()).collect()
        }
    }
    let mut r = Reader(bytes);
    let common = r.string()?;
    let send = r.counts()?;
    let recv = r.counts()?;
    let invalid = match r.take(1)?.first()? {
        0 => None,
        1 => Some(r.string()?),
        _ => return None,
    };
    r.0.is_empty().then_some(Signature {
        common,
        send,
        recv,
        invalid,
    })
}

/// One exchange as member `index` of `group` runs it on the group's communicator.
struct Exchange<'a> {
    op: &'static str,
    group: &'a [usize],
    comm: ffi::MPI_Comm,
    /// Group indices of the other members.
    peers: Vec<usize>,
}

/// This member's header (the slot and the whole encoded signature), the slots received (one
/// per member, at its group index), and the sends of the long form when it does not fit.
/// While a wait may leave MPI writing or reading them, they are leaked rather than freed.
struct Buffers {
    slot: Vec<u8>,
    encoded: Vec<u8>,
    inbox: Vec<u8>,
    long_sends: Vec<ffi::MPI_Request>,
}

impl Buffers {
    /// The header of `sig` for a group of `n` members, `peers` of them others.
    fn new(sig: &Signature, n: usize, peers: usize) -> Buffers {
        let encoded = encode_signature(sig);
        let mut slot = vec![0u8; SLOT];
        slot[..8].copy_from_slice(&(encoded.len() as u64).to_le_bytes());
        let long = encoded.len() > INLINE;
        if !long {
            slot[8..8 + encoded.len()].copy_from_slice(&encoded);
        }
        Buffers {
            slot,
            encoded,
            inbox: vec![0u8; SLOT * n],
            long_sends: vec![null_request(); if long { peers } else { 0 }],
        }
    }

    /// Whether the signature follows its header as a second message.
    fn long(&self) -> bool {
        self.encoded.len() > INLINE
    }
}

impl Exchange<'_> {
    /// The members' signatures from their headers: the inline ones copied, room for those
    /// that follow (at most [`MAX_SIGNATURE`] bytes), and the world rank of a member whose
    /// header announces more.
    fn bodies(&self, inbox: &[u8]) -> (Vec<Vec<u8>>, Option<usize>) {
        let mut bodies: Vec<Vec<u8>> = vec![Vec::new(); self.group.len()];
        let mut bad = None;
        for &j in &self.peers {
            let header = &inbox[j * SLOT..(j + 1) * SLOT];
            let len = u64::from_le_bytes(header[..8].try_into().unwrap_or([0; 8]));
            let len = usize::try_from(len).unwrap_or(usize::MAX);
            if len <= INLINE {
                bodies[j] = header[8..8 + len].to_vec();
            } else if len <= MAX_SIGNATURE {
                bodies[j] = vec![0u8; len];
            } else {
                bad = Some(self.group[j]);
            }
        }
        (bodies, bad)
    }

    /// The world ranks behind the pending requests of the headers' wait (`peers` receives,
    /// then `peers` sends): those whose header did not come, else those that did not take
    /// ours.
    fn late_headers(&self, pending: &[usize]) -> Vec<usize> {
        let (group, peers) = (self.group, &self.peers);
        let missing: Vec<usize> = pending
            .iter()
            .filter(|&&i| i < peers.len())
            .map(|&i| group[peers[i]])
            .collect();
        if !missing.is_empty() {
            return missing;
        }
        pending
            .iter()
            .map(|&i| group[peers[i - peers.len()]])
            .collect()
    }

    /// The world ranks behind the pending requests of the long forms' wait (a receive per
    /// member, then a send per peer).
    fn late_bodies(&self, pending: &[usize]) -> Vec<usize> {
        let n = self.group.len();
        pending
            .iter()
            .map(|&i| {
                if i < n {
                    self.group[i]
                } else {
                    self.group[self.peers[i - n]]
                }
            })
            .collect()
    }
}

impl MpiWorld {
    /// Sends this member's signature to every other member of `group` and returns every
    /// member's, in group order.
    pub(super) fn exchange_signatures(
        &self,
        op: &'static str,
        group: &[usize],
        index: usize,
        comm: ffi::MPI_Comm,
        sig: &Signature,
    ) -> Result<Vec<Signature>, CommError> {
        let n = group.len();
        let x = Exchange {
            op,
            group,
            comm,
            peers: (0..n).filter(|&j| j != index).collect(),
        };
        if x.peers.is_empty() {
            return Ok(vec![sig.clone()]);
        }
        let mut b = Buffers::new(sig, n, x.peers.len());
        let mut requests = vec![null_request(); 2 * x.peers.len()];
        let started = self.post_headers(&x, &mut b, &mut requests);
        match started.and_then(|()| self.wait_all(op, &mut requests)) {
            Ok(Waited::Done) => {}
            Ok(Waited::Late(pending)) => {
                let missing = x.late_headers(&pending);
                std::mem::forget(b);
                return Err(self.timed_out(op, group, missing));
            }
            Err(e) => {
                std::mem::forget(b);
                return Err(e);
            }
        }
        // Headers of the members whose signature did not fit: fetch the long form.
        let (mut bodies, bad) = x.bodies(&b.inbox);
        let mut all = vec![null_request(); n];
        let fetched = self.post_bodies(&x, &mut bodies, &mut all);
        all.append(&mut b.long_sends);
        match fetched.and_then(|()| self.wait_all(op, &mut all)) {
            Ok(Waited::Done) => {}
            Ok(Waited::Late(pending)) => {
                let missing = x.late_bodies(&pending);
                std::mem::forget((bodies, b.encoded, all));
                return Err(self.timed_out(op, group, missing));
            }
            Err(e) => {
                std::mem::forget((bodies, b.encoded, all));
                return Err(e);
            }
        }
        if let Some(rank) = bad {
            return Err(CommError::Backend {
                op,
                rank: self.rank,
                message: format!("rank {rank} sent an oversized header"),
            });
        }
        self.decode_all(&x, index, sig, &bodies)
    }

    /// Starts, for each peer, the receive of its header into `b.inbox`, the send of ours and,
    /// when ours is long, the send of the whole signature: `requests` gets the receives then
    /// the header sends, `b.long_sends` the long sends.
    fn post_headers(
        &self,
        x: &Exchange<'_>,
        b: &mut Buffers,
        requests: &mut [ffi::MPI_Request],
    ) -> Result<(), CommError> {
        let (op, comm, long) = (x.op, x.comm, b.long());
        self.with_mpi(op, |_| {
            let (recvs, rest) = requests.split_at_mut(x.peers.len());
            for (k, &j) in x.peers.iter().enumerate() {
                let peer = j as c_int;
                // SAFETY: the buffers outlive the requests (they are leaked if a wait gives
                // up) and are not touched until the requests complete.
                unsafe {
                    let code = ffi::MPI_Irecv(
                        b.inbox[j * SLOT..].as_mut_ptr().cast(),
                        SLOT as c_int,
                        bytes_type(),
                        peer,
                        TAG_HEADER,
                        comm,
                        &mut recvs[k],
                    );
                    self.check_code(op, "MPI_Irecv", code)?;
                    let code = ffi::MPI_Isend(
                        b.slot.as_ptr().cast(),
                        SLOT as c_int,
                        bytes_type(),
                        peer,
                        TAG_HEADER,
                        comm,
                        &mut rest[k],
                    );
                    self.check_code(op, "MPI_Isend", code)?;
                    if long {
                        let code = ffi::MPI_Isend(
                            b.encoded.as_ptr().cast(),
                            c_int::try_from(b.encoded.len()).unwrap_or(c_int::MAX),
                            bytes_type(),
                            peer,
                            TAG_HEADER_LONG,
                            comm,
                            &mut b.long_sends[k],
                        );
                        self.check_code(op, "MPI_Isend", code)?;
                    }
                }
            }
            Ok(())
        })
    }

    /// Starts the receive of each long signature into its room in `bodies` (request at the
    /// member's group index in `requests`).
    fn post_bodies(
        &self,
        x: &Exchange<'_>,
        bodies: &mut [Vec<u8>],
        requests: &mut [ffi::MPI_Request],
    ) -> Result<(), CommError> {
        self.with_mpi(x.op, |_| {
            for &j in &x.peers {
                if bodies[j].len() > INLINE {
                    // SAFETY: as above; `bodies[j]` is not resized while the request lives.
                    let code = unsafe {
                        ffi::MPI_Irecv(
                            bodies[j].as_mut_ptr().cast(),
                            bodies[j].len() as c_int,
                            bytes_type(),
                            j as c_int,
                            TAG_HEADER_LONG,
                            x.comm,
                            &mut requests[j],
                        )
                    };
                    self.check_code(x.op, "MPI_Irecv", code)?;
                }
            }
            Ok(())
        })
    }

    /// Every member's signature in group order: ours (`index`) as given, the others decoded
    /// from `bodies`.
    fn decode_all(
        &self,
        x: &Exchange<'_>,
        index: usize,
        sig: &Signature,
        bodies: &[Vec<u8>],
    ) -> Result<Vec<Signature>, CommError> {
        (0..x.group.len())
            .map(|j| {
                if j == index {
                    return Ok(sig.clone());
                }
                decode_signature(&bodies[j]).ok_or_else(|| CommError::Backend {
                    op: x.op,
                    rank: self.rank,
                    message: format!("rank {} sent a header that cannot be read", x.group[j]),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_round_trip() {
        let sig = Signature {
            common: "all_to_all(bf16) ×".to_string(),
            send: vec![1, 2, 3],
            recv: vec![0, usize::MAX],
            invalid: Some("counts wrong".to_string()),
        };
        assert_eq!(decode_signature(&encode_signature(&sig)), Some(sig.clone()));
        let plain = Signature::plain("barrier");
        assert_eq!(decode_signature(&encode_signature(&plain)), Some(plain));
        let bytes = encode_signature(&sig);
        for cut in 0..bytes.len() {
            assert_eq!(decode_signature(&bytes[..cut]), None);
        }
        assert_eq!(decode_signature(&[0xff; 40]), None);
    }
}
