//! DualPipeV: its lists by hand, its bubble and peak against the closed forms, and where
//! it beats 1F1B and zero bubble.

mod common;

use common::assert_close;
use ferrotron_schedule::{
    compute_actions, schedule, simulate, Costs, Placement, ScheduleError, ScheduleKind,
};

use ScheduleKind::{DualPipeV, OneFOneB, ZeroBubble};

/// A rank's compute list as letters: `F0(2)` is the forward of micro-batch 2 on chunk 0,
/// `B` a full backward, `I` an input half, `W` a weight half.
fn letters(p: usize, m: usize, rank: usize) -> String {
    use ferrotron_schedule::Action::*;
    let list = compute_actions(DualPipeV, p, m, 2, rank).unwrap();
    let one = |a: &ferrotron_schedule::Action| {
        let l = match a {
            Forward { .. } => 'F',
            Backward { .. } => 'B',
            BackwardInput { .. } => 'I',
            BackwardWeight { .. } => 'W',
            _ => '?',
        };
        format!("{l}{}({})", a.chunk(), a.mb())
    };
    list.iter().map(one).collect::<Vec<_>>().join(" ")
}

/// DeepSeek's eight phases for p = 2, m = 4, written out by hand from the reference's
/// loop counts (rank 0: 2·1 F0, 1·(F0 F1), 1·(B1 W F1), 1·(F0 B1 F1 B0), 1·(B1 F1 B0),
/// 1·(B1 B0) with B0 split, 1·(W B0), 1·W; rank 1: 2·(F0 F1), 2·(F0 B1 F1 B0), 2·(B1 B0)
/// with the second pair split, 2·W).
#[test]
fn two_ranks_four_micro_batches_by_hand() {
    let rank0 = "F0(0) F0(1) F0(2) F1(0) I1(0) W1(0) F1(1) F0(3) B1(1) F1(2) B0(0) \
                 B1(2) F1(3) B0(1) B1(3) I0(2) W0(2) I0(3) W0(3)";
    let rank1 = "F0(0) F1(0) F0(1) F1(1) F0(2) B1(0) F1(2) B0(0) F0(3) B1(1) F1(3) B0(1) \
                 B1(2) B0(2) I1(3) I0(3) W1(3) W0(3)";
    assert_eq!(letters(2, 4, 0), rank0);
    assert_eq!(letters(2, 4, 1), rank1);
}

/// Rank r holds stages r and 2p−1−r: rank 0 the embedding and the head, rank p−1 the turn.
#[test]
fn v_placement() {
    let s = schedule(DualPipeV, 4, 8, 2).unwrap();
    assert!(s.holds_embedding(0, 0) && s.holds_head(0, 1));
    assert_eq!((s.virtual_stage(3, 0), s.virtual_stage(3, 1)), (3, 4));
    assert_eq!(Placement::V.owner(4, 6), (1, 1));
    // Rank p−1 hands chunk 0's output to chunk 1 in place: it never talks to itself, and
    // its chunk-1 activations go back to rank p−2.
    for a in s.actions(3).unwrap() {
        assert_ne!(a.peer(), Some(3), "{a}");
    }
}

/// With F = B = W per chunk, DualPipeV loses `(p−1)·F`: half of zero bubble's `(p−1)·2F`
/// and a sixth of 1F1B's `(p−1)·6F` at equal work (a rank's two chunks are one stage of
/// theirs). So its bubble fraction is `(p−1)/(6m)`, and its peak `2p+1` chunk sets.
#[test]
fn bubble_and_peak_closed_forms() {
    for unit in [1.0, 0.5, 3.0] {
        let costs = Costs {
            forward: unit,
            backward: 2.0 * unit,
            backward_input: unit,
            backward_weight: unit,
            p2p: 0.0,
        };
        for p in 1..=8 {
            for m in 2 * p..=32 {
                let s = schedule(DualPipeV, p, m, 2).unwrap();
                let sim = simulate(&s, &costs).unwrap();
                let case = format!("p={p} m={m} unit={unit}");
                assert_close(sim.ideal, 6.0 * m as f64 * unit, 1e-9, &case);
                assert_close(sim.makespan - sim.ideal, (p - 1) as f64 * unit, 1e-9, &case);
                let fraction = (p - 1) as f64 / (6 * m) as f64;
                assert_close(sim.bubble_fraction(), fraction, 1e-12, &case);
                for r in 0..p {
                    assert_eq!(s.peak_in_flight(r).unwrap(), 2 * p + 1, "{case} r={r}");
                }
            }
        }
    }
}

/// At equal work (F = 1, B = 2 for a whole stage; half of each for a DualPipeV chunk, the
/// fraction does not depend on the unit) DualPipeV's bubble is below zero bubble's and
/// 1F1B's for every pipeline, at the price of `p + ½` stages of activations on every rank
/// (1F1B: `p − r`).
#[test]
fn beats_zero_bubble_and_1f1b() {
    let costs = Costs::default();
    for p in 2..=8 {
        for m in 2 * p..=32 {
            let dv = schedule(DualPipeV, p, m, 2).unwrap();
            let zb = schedule(ZeroBubble, p, m, 1).unwrap();
            let ofob = schedule(OneFOneB, p, m, 1).unwrap();
            let (d, z, o) = (
                dv.bubble_fraction(&costs).unwrap(),
                zb.bubble_fraction(&costs).unwrap(),
                ofob.bubble_fraction(&costs).unwrap(),
            );
            assert!(d < z && z < o, "p={p} m={m}: {d} {z} {o}");
            assert_close(d, z / 2.0, 1e-12, "half of zero bubble");
        }
    }
}

#[test]
fn refused_shapes_name_the_fix() {
    let e = schedule(DualPipeV, 4, 8, 1).unwrap_err();
    assert_eq!(e, ScheduleError::DualPipeVChunks { v: 1 });
    assert!(e.to_string().contains("parallel.virtual_stages"), "{e}");
    let e = schedule(DualPipeV, 4, 7, 2).unwrap_err();
    assert_eq!(e, ScheduleError::DualPipeVMicroBatches { m: 7, p: 4 });
    let text = e.to_string();
    assert!(
        text.contains("so 8") && text.contains("train.grad_accum"),
        "{text}"
    );
}
