//! Structural properties of every built schedule, checked without tensors.

mod common;

use std::collections::HashMap;

use common::all_configs;
use ferrotron_schedule::{
    schedule, simulate, Action, Costs, Flow, Placement, Schedule, ScheduleKind,
};

fn build(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Schedule {
    schedule(kind, p, m, v).unwrap_or_else(|e| panic!("{kind} p={p} m={m} v={v}: {e}"))
}

#[test]
fn each_chunk_runs_each_micro_batch_once_forward_before_backward() {
    for (kind, p, m, v) in all_configs() {
        let s = build(kind, p, m, v);
        // Zero bubble splits every backward, DualPipeV some, the others none.
        let split = kind == ScheduleKind::ZeroBubble;
        let mixed = kind == ScheduleKind::DualPipeV;
        for (rank, actions) in s.ranks().iter().enumerate() {
            let at = |want: fn(&Action) -> bool, mb: usize, chunk: usize| -> Vec<usize> {
                let hit = |a: &Action| want(a) && a.mb() == mb && a.chunk() == chunk;
                actions
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| hit(a))
                    .map(|(i, _)| i)
                    .collect()
            };
            let case = format!("{kind} p={p} m={m} v={v} rank={rank}");
            for mb in 0..m {
                for chunk in 0..v {
                    let f = at(|a| matches!(a, Action::Forward { .. }), mb, chunk);
                    let full = at(|a| matches!(a, Action::Backward { .. }), mb, chunk);
                    let bi = at(|a| matches!(a, Action::BackwardInput { .. }), mb, chunk);
                    let bw = at(|a| matches!(a, Action::BackwardWeight { .. }), mb, chunk);
                    assert_eq!(f.len(), 1, "{case} forwards of ({mb}, {chunk})");
                    if split || (mixed && full.is_empty()) {
                        assert_eq!((full.len(), bi.len(), bw.len()), (0, 1, 1), "{case}");
                        assert!(f[0] < bi[0] && bi[0] < bw[0], "{case} F < B < W ({mb})");
                    } else {
                        assert_eq!((full.len(), bi.len(), bw.len()), (1, 0, 0), "{case}");
                        assert!(f[0] < full[0], "{case} forward before backward ({mb})");
                    }
                }
            }
            let compute = actions.iter().filter(|a| a.is_compute()).count();
            let weights = actions
                .iter()
                .filter(|a| matches!(a, Action::BackwardWeight { .. }))
                .count();
            assert_eq!(weights, if split { m * v } else { weights }, "{case}");
            assert!(mixed || split || weights == 0, "{case}: W without a split");
            assert_eq!(compute, 2 * m * v + weights, "{case} compute count");
        }
    }
}

/// (flow, boundary, mb) -> every end posted for it: (rank, chunk, peer rank).
type Book = HashMap<(Flow, usize, usize), Vec<(usize, usize, usize)>>;

#[test]
fn every_send_has_exactly_one_matching_receive_and_vice_versa() {
    for (kind, p, m, v) in all_configs() {
        let s = build(kind, p, m, v);
        let placement = kind.placement();
        let mut sends = Book::new();
        let mut recvs = Book::new();
        for (rank, actions) in s.ranks().iter().enumerate() {
            for a in actions.iter().filter(|a| !a.is_compute()) {
                let (flow, edge) = a
                    .edge(rank, p, placement)
                    .expect("comm actions have an edge");
                let entry = (rank, a.chunk(), a.peer().unwrap());
                let book = match a {
                    Action::SendActivation { .. } | Action::SendGrad { .. } => &mut sends,
                    _ => &mut recvs,
                };
                book.entry((flow, edge, a.mb())).or_default().push(entry);
            }
        }
        let case = format!("{kind} p={p} m={m} v={v}");
        assert_eq!(sends.len(), recvs.len(), "{case}: message counts");
        // Boundaries between stages on different ranks (the V turns on rank p−1 in place).
        let rank_of = |stage: usize| placement.owner(p, stage).0;
        let boundaries = (0..v * p - 1)
            .filter(|&e| rank_of(e) != rank_of(e + 1))
            .count();
        assert_eq!(
            sends.len(),
            2 * m * boundaries,
            "{case}: one message per boundary per mb"
        );
        for (key, sent) in &sends {
            let got = recvs
                .get(key)
                .unwrap_or_else(|| panic!("{case}: {key:?} never received"));
            assert_eq!(
                (sent.len(), got.len()),
                (1, 1),
                "{case}: {key:?} duplicated"
            );
            let ((s_rank, s_chunk, to), (r_rank, r_chunk, from)) = (sent[0], got[0]);
            assert_eq!((to, from), (r_rank, s_rank), "{case}: {key:?} wrong peers");
            // Same chunk at both ends, except where the ring wraps: the rank-0 end is one
            // chunk higher there.
            let wraps = placement == Placement::Looped && (key.1 + 1) % p == 0;
            let (low, high) = if s_rank == 0 {
                (r_chunk, s_chunk)
            } else {
                (s_chunk, r_chunk)
            };
            if wraps {
                assert_eq!(high, low + 1, "{case}: {key:?} wrap chunks");
            } else {
                assert_eq!(s_chunk, r_chunk, "{case}: {key:?} chunks");
            }
        }
    }
}

#[test]
fn sends_and_receives_sit_next_to_their_computation() {
    for (kind, p, m, v) in all_configs() {
        let s = build(kind, p, m, v);
        for (rank, actions) in s.ranks().iter().enumerate() {
            let case = format!("{kind} p={p} m={m} v={v} rank={rank}");
            for (i, a) in actions.iter().enumerate() {
                let same = |b: &Action| b.mb() == a.mb() && b.chunk() == a.chunk();
                let next = actions.get(i + 1).filter(|b| same(b));
                let prev = i.checked_sub(1).map(|j| &actions[j]).filter(|b| same(b));
                let ok = match a {
                    Action::RecvActivation { .. } => matches!(next, Some(Action::Forward { .. })),
                    Action::SendActivation { .. } => matches!(prev, Some(Action::Forward { .. })),
                    Action::RecvGrad { .. } => matches!(
                        next,
                        Some(Action::Backward { .. } | Action::BackwardInput { .. })
                    ),
                    Action::SendGrad { .. } => matches!(
                        prev,
                        Some(Action::Backward { .. } | Action::BackwardInput { .. })
                    ),
                    _ => true,
                };
                assert!(ok, "{case}: {a} at #{i} is not next to its computation");
            }
            // Virtual stage 0 receives no activations; the last receives no gradients.
            for a in actions {
                let vs = s.virtual_stage(rank, a.chunk());
                let first_recv = matches!(a, Action::RecvActivation { .. }) && vs == 0;
                let last_recv =
                    matches!(a, Action::RecvGrad { .. }) && s.holds_head(rank, a.chunk());
                assert!(!first_recv && !last_recv, "{case}: {a} at a model end");
            }
        }
    }
}

#[test]
fn simulated_timings_respect_every_cross_stage_dependency() {
    let costs = Costs {
        p2p: 0.1,
        ..Costs::default()
    };
    for (kind, p, m, v) in all_configs() {
        let s = build(kind, p, m, v);
        let sim = simulate(&s, &costs).unwrap_or_else(|e| panic!("{kind} p={p} m={m}: {e}"));
        // (vs, mb) -> (forward start, forward end, backward start, backward end)
        let mut at: HashMap<(usize, usize), [f64; 4]> = HashMap::new();
        for (rank, stats) in sim.ranks.iter().enumerate() {
            for t in &stats.timeline {
                let e = at.entry((s.virtual_stage(rank, t.action.chunk()), t.action.mb()));
                let slot = e.or_insert([f64::NAN; 4]);
                match t.action {
                    Action::Forward { .. } => (slot[0], slot[1]) = (t.start, t.end),
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        (slot[2], slot[3]) = (t.start, t.end)
                    }
                    _ => {}
                }
            }
        }
        let case = format!("{kind} p={p} m={m} v={v}");
        let last = v * p - 1;
        // Stages on one rank hand outputs on locally, without a message.
        let rank_of = |stage: usize| kind.placement().owner(p, stage).0;
        for mb in 0..m {
            for vs in 0..last {
                let hop = if rank_of(vs) != rank_of(vs + 1) {
                    costs.p2p
                } else {
                    0.0
                };
                let (lo, hi) = (at[&(vs, mb)], at[&(vs + 1, mb)]);
                assert!(
                    hi[0] >= lo[1] + hop - 1e-9,
                    "{case}: forward {mb} at vs {vs}"
                );
                assert!(
                    lo[2] >= hi[3] + hop - 1e-9,
                    "{case}: backward {mb} at vs {vs}"
                );
            }
            let head = at[&(last, mb)];
            assert!(
                head[2] >= head[1],
                "{case}: head backward {mb} before its forward"
            );
        }
    }
}

#[test]
fn backwards_of_each_chunk_run_in_ascending_micro_batch_order() {
    // Gradients then accumulate in the same order as on a single rank.
    for (kind, p, m, v) in all_configs() {
        let s = build(kind, p, m, v);
        for (rank, actions) in s.ranks().iter().enumerate() {
            for chunk in 0..v {
                let order = |want: fn(&Action) -> bool| -> Vec<usize> {
                    let hit = |a: &&Action| want(a) && a.chunk() == chunk;
                    actions.iter().filter(hit).map(Action::mb).collect()
                };
                // Weight gradients come from full backwards and from W, in list order.
                let grads =
                    order(|a| matches!(a, Action::Backward { .. } | Action::BackwardWeight { .. }));
                assert_eq!(
                    grads,
                    (0..m).collect::<Vec<_>>(),
                    "{kind} p={p} m={m} r={rank}"
                );
            }
        }
    }
}

#[test]
fn no_self_messages_with_one_stage() {
    let s = build(ScheduleKind::Interleaved, 1, 3, 2);
    let expect = [(0, 0), (0, 1), (1, 0)];
    let forwards: Vec<_> = s.ranks()[0]
        .iter()
        .filter(|a| matches!(a, Action::Forward { .. }))
        .map(|a| (a.mb(), a.chunk()))
        .collect();
    assert_eq!(&forwards[..3], &expect);
    assert!(s.ranks()[0].iter().all(Action::is_compute));
    assert!(s.holds_embedding(0, 0) && s.holds_head(0, 1) && !s.holds_head(0, 0));
}

#[test]
fn one_f_one_b_on_two_stages_is_the_textbook_order() {
    let s = build(ScheduleKind::OneFOneB, 2, 3, 1);
    let text: Vec<Vec<String>> = s
        .ranks()
        .iter()
        .map(|r| r.iter().map(ToString::to_string).collect())
        .collect();
    let f = |mb| format!("Forward(mb={mb}, chunk=0)");
    let b = |mb| format!("Backward(mb={mb}, chunk=0)");
    let sa = |mb| format!("SendActivation(mb={mb}, chunk=0, to=1)");
    let rg = |mb| format!("RecvGrad(mb={mb}, chunk=0, from=1)");
    let ra = |mb| format!("RecvActivation(mb={mb}, chunk=0, from=0)");
    let sg = |mb| format!("SendGrad(mb={mb}, chunk=0, to=0)");
    #[rustfmt::skip]
    let rank0 = [f(0), sa(0), f(1), sa(1), rg(0), b(0), f(2), sa(2), rg(1), b(1), rg(2), b(2)];
    #[rustfmt::skip]
    let rank1 = [ra(0), f(0), b(0), sg(0), ra(1), f(1), b(1), sg(1), ra(2), f(2), b(2), sg(2)];
    assert_eq!(text, vec![rank0.to_vec(), rank1.to_vec()]);
}

/// `compute_actions` is each rank's list of `schedule` without its sends and receives.
#[test]
fn compute_actions_are_the_schedules_compute_steps() {
    use ferrotron_schedule::{compute_actions, schedule, ScheduleKind};
    for kind in ScheduleKind::ALL {
        let v = kind.chunks(2);
        for (p, m) in [(1, 3), (2, 4), (4, 8), (3, 6)] {
            if kind == ScheduleKind::Interleaved && (p < 2 || m % p != 0) {
                continue;
            }
            let s = schedule(kind, p, m, v).unwrap();
            for rank in 0..p {
                let full: Vec<_> = s
                    .actions(rank)
                    .unwrap()
                    .iter()
                    .filter(|a| a.is_compute())
                    .cloned()
                    .collect();
                assert_eq!(compute_actions(kind, p, m, v, rank).unwrap(), full);
            }
            assert!(compute_actions(kind, p, m, v, p).is_err());
        }
    }
}
