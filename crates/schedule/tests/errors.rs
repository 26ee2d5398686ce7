//! Bad input is refused with typed errors whose messages name the field and the fix.

use ferrotron_schedule::{
    check_split, schedule, simulate, Action, Costs, Schedule, ScheduleError, ScheduleKind,
};

use ScheduleKind::{Afab, Interleaved, OneFOneB, ZeroBubble};

fn message(e: ScheduleError) -> String {
    e.to_string()
}

#[test]
fn shape_is_validated_up_front() {
    assert_eq!(schedule(OneFOneB, 0, 4, 1), Err(ScheduleError::ZeroStages));
    assert_eq!(
        schedule(Afab, 4, 0, 1),
        Err(ScheduleError::ZeroMicroBatches)
    );
    assert_eq!(
        schedule(ZeroBubble, 4, 4, 0),
        Err(ScheduleError::ZeroVirtualStages)
    );
    assert!(message(ScheduleError::ZeroStages).contains("parallel.pp"));
    assert!(message(ScheduleError::ZeroMicroBatches).contains("train.grad_accum"));

    let e = schedule(OneFOneB, 4, 8, 2).unwrap_err();
    assert_eq!(
        e,
        ScheduleError::ChunksNeedInterleaved {
            kind: OneFOneB,
            v: 2
        }
    );
    let text = message(e);
    assert!(text.contains("v=2") && text.contains("`1f1b`") && text.contains("interleaved"));

    let e = schedule(Interleaved, 4, 8, 1).unwrap_err();
    assert_eq!(e, ScheduleError::InterleavedNeedsChunks);
    assert!(message(e).contains("parallel.virtual_stages >= 2"));

    let e = schedule(Interleaved, 4, 6, 2).unwrap_err();
    assert_eq!(e, ScheduleError::MicroBatchesNotDivisible { m: 6, p: 4 });
    assert!(message(e)
        .starts_with("interleaved schedules need micro-batches (m=6) divisible by stages (p=4)"));
}

#[test]
fn fewer_micro_batches_than_stages_work_where_the_schedule_allows() {
    for kind in [Afab, OneFOneB, ZeroBubble] {
        let s = schedule(kind, 8, 3, 1).unwrap();
        assert_eq!(s.ranks().len(), 8);
        assert!(simulate(&s, &Costs::default()).is_ok(), "{kind}");
    }
    // Interleaved needs m to be a multiple of p, so m < p is refused.
    assert!(matches!(
        schedule(Interleaved, 8, 3, 2),
        Err(ScheduleError::MicroBatchesNotDivisible { m: 3, p: 8 })
    ));
}

#[test]
fn layers_must_split_evenly() {
    assert_eq!(check_split(32, 4, 2, None), Ok(()));
    assert_eq!(check_split(32, 8, 1, None), Ok(()));
    let e = check_split(30, 4, 2, None).unwrap_err();
    assert_eq!(
        e,
        ScheduleError::LayersNotDivisible {
            layers: 30,
            p: 4,
            v: 2
        }
    );
    let text = message(e);
    assert!(text.contains("layers (30)") && text.contains("= 8") && text.contains("model.layers"));
    assert_eq!(check_split(8, 0, 1, None), Err(ScheduleError::ZeroStages));
    assert_eq!(
        check_split(8, 2, 0, None),
        Err(ScheduleError::ZeroVirtualStages)
    );
}

#[test]
fn kinds_parse_display_and_serialize_with_config_spellings() {
    for (kind, name) in [
        (Afab, "afab"),
        (OneFOneB, "1f1b"),
        (Interleaved, "interleaved"),
        (ZeroBubble, "zero_bubble"),
        (ScheduleKind::DualPipeV, "dualpipev"),
    ] {
        assert_eq!(kind.to_string(), name);
        assert_eq!(name.parse::<ScheduleKind>(), Ok(kind));
        assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{name}\""));
        assert_eq!(
            serde_json::from_str::<ScheduleKind>(&format!("\"{name}\"")).unwrap(),
            kind
        );
    }
    let e = "gpipe".parse::<ScheduleKind>().unwrap_err();
    assert_eq!(
        e,
        ScheduleError::UnknownKind {
            got: "gpipe".into()
        }
    );
    assert!(
        message(e).contains("`gpipe`")
            && message("1F1B".parse::<ScheduleKind>().unwrap_err()).contains("1f1b")
    );
    let json = serde_json::to_string(&Action::SendGrad {
        mb: 1,
        chunk: 0,
        to_stage: 2,
    })
    .unwrap();
    assert_eq!(json, r#"{"op":"send_grad","mb":1,"chunk":0,"to_stage":2}"#);
}

#[test]
fn bad_costs_are_refused() {
    let s = schedule(OneFOneB, 2, 2, 1).unwrap();
    let nan = Costs {
        forward: f64::NAN,
        ..Costs::default()
    };
    assert!(matches!(
        simulate(&s, &nan),
        Err(ScheduleError::InvalidCost {
            field: "forward",
            ..
        })
    ));
    let neg = Costs {
        p2p: -1.0,
        ..Costs::default()
    };
    let e = simulate(&s, &neg).unwrap_err();
    assert!(message(e).contains("Costs::p2p"));
    let zero = Costs {
        forward: 0.0,
        backward: 0.0,
        ..Costs::default()
    };
    assert_eq!(s.bubble_fraction(&zero), Err(ScheduleError::ZeroIdealTime));
    assert_eq!(
        s.peak_in_flight(2),
        Err(ScheduleError::RankOutOfRange { rank: 2, p: 2 })
    );
}

#[test]
fn hand_built_schedules_are_checked_against_the_layout() {
    let f = Action::Forward { mb: 0, chunk: 0 };
    let e = Schedule::from_actions(OneFOneB, 2, 1, 1, vec![vec![f]]).unwrap_err();
    assert_eq!(e, ScheduleError::RankCount { p: 2, got: 1 });
    let wrong_peer = Action::SendActivation {
        mb: 0,
        chunk: 0,
        to_stage: 2,
    };
    let e = Schedule::from_actions(OneFOneB, 3, 1, 1, vec![vec![f, wrong_peer], vec![], vec![]])
        .unwrap_err();
    assert!(matches!(
        e,
        ScheduleError::InvalidAction {
            rank: 0,
            index: 1,
            ..
        }
    ));
    assert!(message(e).contains("on rank 1, not 2"));
    let far = Action::Forward { mb: 5, chunk: 0 };
    let e = Schedule::from_actions(Afab, 1, 2, 1, vec![vec![far]]).unwrap_err();
    assert!(message(e).contains("micro-batch 5 is out of range 0..2"));
    let head_grad = Action::RecvGrad {
        mb: 0,
        chunk: 0,
        from_stage: 0,
    };
    let e = Schedule::from_actions(Afab, 2, 1, 1, vec![vec![], vec![head_grad]]).unwrap_err();
    assert!(message(e).contains("end of the model"));
}

#[test]
fn deadlock_names_the_stuck_ranks_and_their_next_actions() {
    // Both ranks wait for the other's gradient/activation before doing anything.
    let r0 = vec![
        Action::RecvGrad {
            mb: 0,
            chunk: 0,
            from_stage: 1,
        },
        Action::Forward { mb: 0, chunk: 0 },
        Action::SendActivation {
            mb: 0,
            chunk: 0,
            to_stage: 1,
        },
        Action::Backward { mb: 0, chunk: 0 },
    ];
    let r1 = vec![
        Action::RecvActivation {
            mb: 0,
            chunk: 0,
            from_stage: 0,
        },
        Action::Forward { mb: 0, chunk: 0 },
        Action::Backward { mb: 0, chunk: 0 },
        Action::SendGrad {
            mb: 0,
            chunk: 0,
            to_stage: 0,
        },
    ];
    let s = Schedule::from_actions(OneFOneB, 2, 1, 1, vec![r0, r1]).unwrap();
    let e = simulate(&s, &Costs::default()).unwrap_err();
    let ScheduleError::Deadlock { stuck } = &e else {
        panic!("want deadlock, got {e}")
    };
    assert_eq!(stuck.len(), 2);
    assert_eq!(
        (stuck[0].rank, stuck[0].index, stuck[1].rank, stuck[1].index),
        (0, 0, 1, 0)
    );
    let text = message(e);
    assert!(
        text.contains("rank 0 at action #0 RecvGrad(mb=0, chunk=0, from=1)"),
        "{text}"
    );
    assert!(
        text.contains("rank 1 at action #0 RecvActivation(mb=0, chunk=0, from=0)"),
        "{text}"
    );
}

#[test]
fn unreceived_sends_are_reported() {
    let r0 = vec![
        Action::Forward { mb: 0, chunk: 0 },
        Action::SendActivation {
            mb: 0,
            chunk: 0,
            to_stage: 1,
        },
        Action::Backward { mb: 0, chunk: 0 },
    ];
    let r1 = vec![];
    let s = Schedule::from_actions(Afab, 2, 1, 1, vec![r0, r1]).unwrap();
    let e = simulate(&s, &Costs::default()).unwrap_err();
    assert!(matches!(
        e,
        ScheduleError::UnmatchedSend {
            count: 1,
            rank: 0,
            to: 1,
            ..
        }
    ));
    assert!(message(e).contains("add the matching receive on rank 1"));
}

#[test]
fn absurd_sizes_are_refused_not_allocated() {
    let e = schedule(OneFOneB, usize::MAX, 2, 1).unwrap_err();
    assert!(matches!(e, ScheduleError::TooLarge { m: 2, v: 1, .. }));
    assert!(message(e).contains("lower parallel.pp"));
    assert!(matches!(
        schedule(Interleaved, 64, 1 << 20, 4),
        Err(ScheduleError::TooLarge { .. })
    ));
    let e = check_split(8, usize::MAX, 2, None).unwrap_err();
    assert!(matches!(
        e,
        ScheduleError::LayersNotDivisible { layers: 8, .. }
    ));
    assert!(!message(e).is_empty());
    let costs: Costs = serde_json::from_str(r#"{"p2p": 0.5}"#).unwrap();
    assert_eq!(
        costs,
        Costs {
            p2p: 0.5,
            ..Costs::default()
        }
    );
}
