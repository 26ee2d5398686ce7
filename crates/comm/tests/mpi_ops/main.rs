//! The MPI backend operation by operation against the threads backend, under
//! `mpirun -np 4`: every output (the bits of every buffer) and every error (its kind and
//! message) must be identical.
//!
//! - `mpi_ops_match_threads`: about sixty operations per rank — all-reduce (sum, mean; f32,
//!   bf16; empty to 100k elements; world, pairs, single rank), reduce-scatter, all-gather,
//!   broadcast, all-to-all, barriers, mismatched and invalid arguments, sends received out
//!   of tag order, a send to self, receives of the wrong length or dtype, a 16 MB message
//!   whose sender then idles, a malformed group and an out-of-range peer.
//! - `mpi_timeouts_match_threads`: a peer that never comes — at a group's first use, in the
//!   header exchange of a group already set up, and for a receive — then
//!   [`CommError::PeerFailed`] for the next operation, and `fail` aborting the whole job.
//!
//! How: each test starts `mpirun` on this very test binary, selecting an ignored test
//! (`rank_ops`, `rank_timeouts`) that plays one rank and writes its transcript (one line per
//! operation) to the scratch directory named in [`DIR_VAR`](job::DIR_VAR); outside such a
//! launch those tests do nothing. The launching test runs the same script on a
//! [`ThreadWorld`] and compares line by line.
//!
//! Needs OpenMPI (`mpirun` on the PATH) and runs only with `--features mpi`.
#![cfg(feature = "mpi")]

mod job;
mod scripts;

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use ferrotron_comm::{run_ranks, Comm, CommError, MpiWorld, ThreadWorld, Transport};
use ferrotron_tensor::Ledger;

use job::{
    assert_same, describe, launch, launched_dir, or_abort, scratch, wait_for_transcripts,
    write_transcript, JOB_LIMIT, RANKS,
};
use scripts::{ops_script, timeouts_script};

/// Timeout of the operations script (never reached when all is well).
const OPS_TIMEOUT: Duration = Duration::from_secs(30);
/// Timeout of the timeouts script: how long a rank waits for a peer that never comes.
const SHORT_TIMEOUT: Duration = Duration::from_secs(2);
/// What rank 0 gives as the reason when it ends the timeouts job.
const ABORT_REASON: &str = "timeouts checked";

/// One `mpirun` job at a time: two at once would slow each other into spurious timeouts.
static JOBS: Mutex<()> = Mutex::new(());

#[test]
#[ignore = "one MPI rank of mpi_ops_match_threads, which launches it under mpirun"]
fn rank_ops() {
    let Some(dir) = launched_dir() else { return };
    let world = MpiWorld::init(OPS_TIMEOUT).expect("initialise MPI");
    let rank = world.rank();
    let lines = or_abort(&world, || {
        assert_eq!(world.world_size(), RANKS, "launch {RANKS} ranks");
        let comm = Comm::new(world.clone(), rank, Ledger::new())?;
        Ok(ops_script(&comm))
    });
    write_transcript(&dir, "ops", rank, &lines);
    world.finalize().expect("finalize MPI");
}

#[test]
#[ignore = "one MPI rank of mpi_timeouts_match_threads, which launches it under mpirun"]
fn rank_timeouts() {
    let Some(dir) = launched_dir() else { return };
    let world = MpiWorld::init(SHORT_TIMEOUT).expect("initialise MPI");
    let rank = world.rank();
    let lines = or_abort(&world, || {
        assert_eq!(world.world_size(), RANKS, "launch {RANKS} ranks");
        let comm = Comm::new(world.clone(), rank, Ledger::new())?;
        Ok(timeouts_script(rank, &comm))
    });
    write_transcript(&dir, "timeouts", rank, &lines);
    if rank == 0 {
        // Every world but the idle rank 3's has failed and cannot finalize: once the
        // transcripts are written, end the job the way a failed rank does.
        wait_for_transcripts(&dir, "timeouts");
        world.fail(0, ABORT_REASON);
    }
    // The others wait for that abort.
    thread::sleep(JOB_LIMIT);
}

#[test]
fn mpi_ops_match_threads() {
    let _one_job = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("ops");
    let out = launch("rank_ops", &dir);
    assert!(out.status.success(), "{}", describe(&out));
    let threads = run_ranks(RANKS, OPS_TIMEOUT, |ctx| {
        let comm = ctx.comm(Ledger::new())?;
        Ok::<_, CommError>(ops_script(&comm))
    })
    .expect("the threads backend runs the script");
    assert_same("ops", &dir, &out, &threads);
    // Both backends really met the errors (not merely agreed on nothing).
    let lines: Vec<&String> = threads.iter().flatten().collect();
    for kind in ["error Mismatch", "error InvalidArgument"] {
        assert!(
            lines.iter().any(|l| l.starts_with(kind)),
            "no {kind} in the transcripts"
        );
    }
    assert!(lines.len() >= RANKS * 55, "only {} operations", lines.len());
}

#[test]
fn mpi_timeouts_match_threads() {
    let _one_job = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    let dir = scratch("timeouts");
    let out = launch("rank_timeouts", &dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains(&format!("rank 0 failed: {ABORT_REASON}")),
        "rank 0 should have aborted the job\n{}",
        describe(&out)
    );
    // On threads a timeout fails the whole world, so each stalled rank gets a world of its
    // own (as each MPI process has), with rank 3 beside rank 2 to set their group up.
    let worlds: [&[usize]; 3] = [&[0], &[1], &[2, 3]];
    let mut threads: Vec<Vec<String>> = vec![Vec::new(); RANKS];
    thread::scope(|s| {
        let mut handles = Vec::new();
        for ranks in worlds {
            let world = ThreadWorld::new(RANKS, SHORT_TIMEOUT).expect("a threads world");
            for &rank in ranks {
                let world = Arc::clone(&world);
                handles.push((
                    rank,
                    s.spawn(move || {
                        let comm = world.comm(rank, Ledger::new()).expect("a communicator");
                        timeouts_script(rank, &comm)
                    }),
                ));
            }
        }
        for (rank, h) in handles {
            threads[rank] = h.join().expect("a threads rank");
        }
    });
    assert_same("timeouts", &dir, &out, &threads);
    // Ranks 0 to 2 each met their timeout (rank 3 only set its group up).
    for (rank, lines) in threads.iter().enumerate().take(3) {
        assert!(
            lines.iter().any(|l| l.starts_with("error Timeout")),
            "rank {rank} saw no timeout: {lines:?}"
        );
    }
}
