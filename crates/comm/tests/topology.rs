//! Rank grid: coordinates, groups, errors and the printed layout.

use ferrotron_comm::{Coords, GroupKind, Topology, TopologyError};

fn topo(dp: usize, pp: usize, cp: usize, tp: usize, ep: usize) -> Topology {
    Topology::new(dp, pp, cp, tp, ep).expect("valid layout")
}

#[test]
fn coordinates_round_trip() {
    for (dp, pp, cp, tp, ep) in [
        (1, 1, 1, 1, 1),
        (2, 2, 2, 2, 1),
        (4, 1, 2, 1, 2),
        (3, 2, 1, 2, 3),
        (2, 3, 1, 1, 1),
        (6, 1, 1, 4, 2),
    ] {
        let t = topo(dp, pp, cp, tp, ep);
        assert_eq!(t.world_size(), dp * pp * cp * tp);
        for rank in 0..t.world_size() {
            let c = t.coords(rank).expect("rank in range");
            assert!(c.dp < dp && c.pp < pp && c.cp < cp && c.tp < tp);
            assert_eq!(c.ep, c.dp % ep);
            assert_eq!(c.edp, c.dp / ep);
            assert_eq!(t.rank_of(c.dp, c.pp, c.cp, c.tp), Ok(rank));
        }
    }
}

#[test]
fn tp_is_innermost_and_dp_outermost() {
    let t = topo(2, 2, 2, 2, 2);
    let c = |dp, pp, cp, tp, ep, edp| Coords {
        dp,
        pp,
        cp,
        tp,
        ep,
        edp,
    };
    assert_eq!(t.coords(0), Ok(c(0, 0, 0, 0, 0, 0)));
    assert_eq!(t.coords(1), Ok(c(0, 0, 0, 1, 0, 0)));
    assert_eq!(t.coords(2), Ok(c(0, 0, 1, 0, 0, 0)));
    assert_eq!(t.coords(4), Ok(c(0, 1, 0, 0, 0, 0)));
    assert_eq!(t.coords(8), Ok(c(1, 0, 0, 0, 1, 0)));
    assert_eq!(t.coords(13), Ok(c(1, 1, 0, 1, 1, 0)));
    assert_eq!(t.rank_of(1, 1, 1, 1), Ok(15));
}

#[test]
fn groups_of_a_16_rank_grid() {
    let t = topo(2, 2, 2, 2, 2);
    // rank 13 = dp 1, pp 1, cp 0, tp 1; rank 6 = dp 0, pp 1, cp 1, tp 0.
    let expect = [
        (13, GroupKind::Tp, vec![12, 13], 1),
        (13, GroupKind::Cp, vec![13, 15], 0),
        (13, GroupKind::Pp, vec![9, 13], 1),
        (13, GroupKind::Dp, vec![5, 13], 1),
        (13, GroupKind::DpCp, vec![5, 7, 13, 15], 2),
        (13, GroupKind::Ep, vec![5, 13], 1),
        (13, GroupKind::ExpertData, vec![13], 0),
        (13, GroupKind::ExpertDataCp, vec![13, 15], 0),
        (6, GroupKind::Tp, vec![6, 7], 0),
        (6, GroupKind::Cp, vec![4, 6], 1),
        (6, GroupKind::Pp, vec![2, 6], 1),
        (6, GroupKind::Dp, vec![6, 14], 0),
        (6, GroupKind::DpCp, vec![4, 6, 12, 14], 1),
        (6, GroupKind::Ep, vec![6, 14], 0),
        (6, GroupKind::ExpertData, vec![6], 0),
        (6, GroupKind::ExpertDataCp, vec![4, 6], 1),
    ];
    for (rank, kind, ranks, index) in expect {
        let g = t.group(kind, rank).expect("group");
        assert_eq!(
            (g.kind, &g.ranks, g.index),
            (kind, &ranks, index),
            "{kind:?} of {rank}"
        );
        assert_eq!(g.size(), ranks.len());
    }
    let world = t.group(GroupKind::World, 5).expect("world");
    assert_eq!(world.ranks, (0..16).collect::<Vec<_>>());
    assert_eq!(world.index, 5);

    let tp: Vec<Vec<usize>> = t
        .groups(GroupKind::Tp)
        .into_iter()
        .map(|g| g.ranks)
        .collect();
    let pairs: Vec<Vec<usize>> = (0..8).map(|i| vec![2 * i, 2 * i + 1]).collect();
    assert_eq!(tp, pairs);
    let dp: Vec<Vec<usize>> = t
        .groups(GroupKind::Dp)
        .into_iter()
        .map(|g| g.ranks)
        .collect();
    let pairs: Vec<Vec<usize>> = (0..8).map(|i| vec![i, i + 8]).collect();
    assert_eq!(dp, pairs);
    let dpcp: Vec<Vec<usize>> = t
        .groups(GroupKind::DpCp)
        .into_iter()
        .map(|g| g.ranks)
        .collect();
    assert_eq!(
        dpcp,
        vec![
            vec![0, 2, 8, 10],
            vec![1, 3, 9, 11],
            vec![4, 6, 12, 14],
            vec![5, 7, 13, 15]
        ]
    );
    for (kind, size, count) in [
        (GroupKind::Tp, 2, 8),
        (GroupKind::Cp, 2, 8),
        (GroupKind::Pp, 2, 8),
        (GroupKind::Dp, 2, 8),
        (GroupKind::DpCp, 4, 4),
        (GroupKind::Ep, 2, 8),
        (GroupKind::ExpertData, 1, 16),
        (GroupKind::ExpertDataCp, 2, 8),
        (GroupKind::World, 16, 1),
    ] {
        let groups = t.groups(kind);
        assert_eq!(groups.len(), count, "{kind:?}");
        assert!(groups.iter().all(|g| g.size() == size), "{kind:?}");
    }
}

#[test]
fn expert_parallelism_folds_into_dp() {
    let t = topo(4, 1, 1, 1, 2);
    let ep: Vec<Vec<usize>> = t
        .groups(GroupKind::Ep)
        .into_iter()
        .map(|g| g.ranks)
        .collect();
    assert_eq!(ep, vec![vec![0, 1], vec![2, 3]]);
    let edp: Vec<Vec<usize>> = t
        .groups(GroupKind::ExpertData)
        .into_iter()
        .map(|g| g.ranks)
        .collect();
    assert_eq!(edp, vec![vec![0, 2], vec![1, 3]]);
    let t = topo(4, 1, 1, 2, 4);
    assert_eq!(
        t.group(GroupKind::Ep, 3).expect("ep").ranks,
        vec![1, 3, 5, 7]
    );
    assert_eq!(
        t.group(GroupKind::ExpertData, 3).expect("edp").ranks,
        vec![3]
    );
}

#[test]
fn errors_name_the_problem() {
    let msg = |e: TopologyError| e.to_string();
    assert_eq!(
        msg(Topology::new(2, 1, 1, 0, 1).unwrap_err()),
        "parallel.tp=0: must be at least 1"
    );
    assert_eq!(
        msg(Topology::new(0, 1, 1, 1, 1).unwrap_err()),
        "parallel.dp=0: must be at least 1"
    );
    assert_eq!(
        msg(Topology::new(4, 1, 1, 1, 3).unwrap_err()),
        "parallel.ep=3 does not divide parallel.dp=4: \
         expert parallelism is folded into data parallelism"
    );
    assert_eq!(
        Topology::new(usize::MAX, 2, 1, 1, 1),
        Err(TopologyError::TooManyRanks {
            dp: usize::MAX,
            pp: 2,
            cp: 1,
            tp: 1
        })
    );
    let t = topo(2, 2, 1, 2, 1);
    assert_eq!(t.check_world(8), Ok(()));
    assert_eq!(
        msg(t.check_world(6).unwrap_err()),
        "world size 6 ≠ dp·pp·cp·tp = 8 (dp=2 pp=2 cp=1 tp=2): launch 8 ranks or change the layout"
    );
    assert_eq!(
        msg(t.coords(8).unwrap_err()),
        "rank 8 is out of range: the layout has 8 ranks"
    );
    assert_eq!(
        msg(t.rank_of(0, 2, 0, 0).unwrap_err()),
        "coordinate pp=2 is out of range: parallel.pp=2"
    );
    assert!(t.group(GroupKind::Tp, 8).is_err());
    assert!(t.describe_rank(9).is_err());
}

#[test]
fn prints_the_layout() {
    let t = topo(2, 1, 1, 2, 2);
    assert_eq!(
        t.describe_rank(3).expect("rank 3"),
        "rank 3: dp=1 pp=0 cp=0 tp=1 ep=1 edp=0 | tp group [2, 3] cp group [3] pp group [3] \
         dp group [1, 3] dp·cp group [1, 3] ep group [1, 3] edp group [3] edp·cp group [3]"
    );
    let text = t.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5);
    assert_eq!(
        lines[0],
        "layout dp=2 pp=1 cp=1 tp=2 ep=2: 4 ranks (tp innermost, dp outermost)"
    );
    assert_eq!(
        lines[1],
        "rank 0: dp=0 pp=0 cp=0 tp=0 ep=0 edp=0 | tp group [0, 1] cp group [0] pp group [0] \
         dp group [0, 2] dp·cp group [0, 2] ep group [0, 2] edp group [0] edp·cp group [0]"
    );
    assert_eq!(lines[4], t.describe_rank(3).expect("rank 3"));
}
