//! Simulated bubble fractions and activation peaks against the playbook's formulas.

mod common;

use common::{all_configs, assert_close};
use ferrotron_schedule::{schedule, simulate, Costs, Schedule, ScheduleKind};

use ScheduleKind::{Afab, DualPipeV, Interleaved, OneFOneB, ZeroBubble};

fn bubble(kind: ScheduleKind, p: usize, m: usize, v: usize, costs: &Costs) -> f64 {
    let s = schedule(kind, p, m, v).unwrap();
    s.bubble_fraction(costs)
        .unwrap_or_else(|e| panic!("{kind} p={p} m={m} v={v}: {e}"))
}

fn peaks(s: &Schedule) -> Vec<usize> {
    (0..s.stages())
        .map(|r| s.peak_in_flight(r).unwrap())
        .collect()
}

/// With B = 2F and free communication, AFAB and 1F1B lose `(p−1)/m` and interleaved
/// `(p−1)/(v·m)`, exactly, for every configuration.
#[test]
fn bubble_matches_the_playbook_formula_exactly() {
    let costs = Costs::default();
    for (kind, p, m, v) in all_configs() {
        let (pf, mf, vf) = (p as f64, m as f64, v as f64);
        let want = match kind {
            Afab | OneFOneB => (pf - 1.0) / mf,
            Interleaved => (pf - 1.0) / (vf * mf),
            ZeroBubble | DualPipeV => continue,
        };
        let got = bubble(kind, p, m, v, &costs);
        assert_close(got, want, 1e-9, &format!("{kind} p={p} m={m} v={v}"));
    }
}

/// The exactness does not depend on B = 2F: the bubble time is `(p−1)·(F+B)` per rank
/// (costs are per chunk, so interleaving divides it by `v` at equal total work).
#[test]
fn bubble_time_is_p_minus_one_stage_passes_for_any_costs() {
    for (f, b) in [(1.0, 2.0), (1.0, 3.0), (2.5, 1.0), (0.5, 0.5)] {
        let costs = Costs {
            forward: f,
            backward: b,
            ..Costs::default()
        };
        let whole = |c: &(ScheduleKind, usize, usize, usize)| !c.0.splits_backward();
        for (kind, p, m, v) in all_configs().into_iter().filter(whole) {
            let sim = simulate(&schedule(kind, p, m, v).unwrap(), &costs).unwrap();
            assert_close(sim.ideal, (m * v) as f64 * (f + b), 1e-9, "ideal");
            let got = sim.makespan - sim.ideal;
            let want = (p - 1) as f64 * (f + b);
            assert_close(
                got,
                want,
                1e-9,
                &format!("{kind} p={p} m={m} v={v} F={f} B={b}"),
            );
        }
    }
}

/// ZB-H1 with m ≥ p: bubble time `(p−1)·(F + B − min(W, B))` — the paper's `(p−1)(F+B−W)`
/// while W ≤ B — so `(p−1)/(3m)` at F = B = W, a third of 1F1B's. With m < p it is
/// `(2p−1−m)·F` at F = B = W, which is optimal: rank 0 cannot start its first B before
/// `(2p−1)F` and then still has m B's and m W's to run.
#[test]
fn zero_bubble_is_zb_h1() {
    for (f, bi, w) in [
        (1.0, 1.0, 1.0),
        (1.0, 1.5, 0.5),
        (2.0, 1.0, 1.0),
        (1.0, 1.0, 1.5),
    ] {
        let costs = Costs {
            forward: f,
            backward_input: bi,
            backward_weight: w,
            ..Costs::default()
        };
        for p in 1..=8 {
            for m in p..=32 {
                let sim = simulate(&schedule(ZeroBubble, p, m, 1).unwrap(), &costs).unwrap();
                let want = (p - 1) as f64 * (f + bi - w.min(bi));
                let case = format!("p={p} m={m} F={f} B={bi} W={w}");
                assert_close(sim.makespan - sim.ideal, want, 1e-9, &case);
            }
        }
    }
    let unit = Costs::default();
    for p in 1..=8 {
        for m in 1..=32 {
            let (pf, mf) = (p as f64, m as f64);
            let want = if m >= p {
                (pf - 1.0) / (3.0 * mf)
            } else {
                (2.0 * pf - 1.0 - mf) / (3.0 * mf)
            };
            assert_close(
                bubble(ZeroBubble, p, m, 1, &unit),
                want,
                1e-9,
                &format!("p={p} m={m}"),
            );
        }
    }
}

#[test]
fn zero_bubble_beats_1f1b_whenever_there_is_a_pipeline() {
    let costs = Costs::default();
    for p in 1..=8 {
        for m in 1..=32 {
            let (zb, ofob) = (
                bubble(ZeroBubble, p, m, 1, &costs),
                bubble(OneFOneB, p, m, 1, &costs),
            );
            if p == 1 {
                assert_eq!((zb, ofob), (0.0, 0.0));
            } else {
                assert!(zb < ofob, "p={p} m={m}: zero bubble {zb} vs 1f1b {ofob}");
            }
        }
    }
}

#[test]
fn playbook_reference_values_for_eight_stages() {
    let costs = Costs::default();
    let cases = [
        (1, 1, 7.0),
        (2, 1, 3.5),
        (4, 1, 1.75),
        (8, 1, 0.875),
        (32, 1, 0.219),
        (32, 8, 0.027),
    ];
    for (m, v, reference) in cases {
        let kind = if v == 1 { OneFOneB } else { Interleaved };
        let got = bubble(kind, 8, m, v, &costs);
        // The playbook rounds to three decimals.
        assert_close(got, reference, 5e-4, &format!("{kind} p=8 m={m} v={v}"));
        if v == 1 {
            assert_close(bubble(Afab, 8, m, 1, &costs), reference, 5e-4, "afab");
        }
    }
}

#[test]
fn peak_micro_batches_in_flight() {
    for (kind, p, m, v) in all_configs() {
        let s = schedule(kind, p, m, v).unwrap();
        let sim = simulate(&s, &Costs::default()).unwrap();
        let got = peaks(&s);
        let timed: Vec<usize> = sim.ranks.iter().map(|r| r.peak_in_flight).collect();
        assert_eq!(
            got, timed,
            "{kind} p={p} m={m} v={v}: list and simulation agree"
        );
        let want: Vec<usize> = (0..p)
            .map(|r| match kind {
                // One stage has nothing to fill: plain gradient accumulation.
                Afab if p == 1 => 1,
                Afab => m,
                OneFOneB => (p - r).min(m),
                ZeroBubble => p.min(m),
                Interleaved => (2 * (p - r - 1) + (v - 1) * p + 1).min(m * v),
                DualPipeV => got[r],
            })
            .collect();
        assert_eq!(got, want, "{kind} p={p} m={m} v={v}");
        if kind == OneFOneB || kind == ZeroBubble {
            assert!(
                got[0] <= p,
                "{kind} p={p} m={m}: first stage holds at most p"
            );
        }
    }
}

#[test]
fn p2p_latency_is_exposed() {
    // AFAB pays each boundary's latency once per direction on the critical path.
    let costs = Costs {
        p2p: 0.25,
        ..Costs::default()
    };
    for p in 1..=8 {
        for m in [1, 4, 16] {
            let sim = simulate(&schedule(Afab, p, m, 1).unwrap(), &costs).unwrap();
            let want = (p - 1) as f64 * (1.0 + 2.0 + 2.0 * 0.25);
            assert_close(
                sim.makespan - sim.ideal,
                want,
                1e-9,
                &format!("afab p={p} m={m}"),
            );
            // 1F1B's steady state waits on a round trip every micro-batch, so it pays more.
            let ofob = simulate(&schedule(OneFOneB, p, m, 1).unwrap(), &costs).unwrap();
            assert!(ofob.makespan >= sim.makespan - 1e-9, "1f1b p={p} m={m}");
        }
    }
}

#[test]
fn bubble_table_for_four_stages() {
    let costs = Costs::default();
    let rows = [
        (Afab, 1),
        (OneFOneB, 1),
        (Interleaved, 2),
        (Interleaved, 4),
        (ZeroBubble, 1),
    ];
    let ms = [4, 8, 16];
    println!("bubble fraction (makespan - ideal)/ideal, p = 4, F = 1, B = 2 (B = W = 1)");
    println!(
        "{:<16}{:>8}{:>8}{:>8}   peak on rank 0 (m = 4, 8, 16)",
        "schedule", "m=4", "m=8", "m=16"
    );
    let mut table = Vec::new();
    for (kind, v) in rows {
        let fr: Vec<f64> = ms.iter().map(|&m| bubble(kind, 4, m, v, &costs)).collect();
        let pk: Vec<usize> = ms
            .iter()
            .map(|&m| schedule(kind, 4, m, v).unwrap().peak_in_flight(0).unwrap())
            .collect();
        let name = if v > 1 {
            format!("{kind} v={v}")
        } else {
            kind.to_string()
        };
        println!(
            "{name:<16}{:>8.4}{:>8.4}{:>8.4}   {pk:?}",
            fr[0], fr[1], fr[2]
        );
        table.push(fr);
    }
    let want = [
        [0.75, 0.375, 0.1875],
        [0.75, 0.375, 0.1875],
        [0.375, 0.1875, 0.09375],
        [0.1875, 0.09375, 0.046875],
        [0.25, 0.125, 0.0625],
    ];
    for (got, want) in table.iter().zip(want) {
        for (g, w) in got.iter().zip(want) {
            assert_close(*g, w, 1e-9, "p = 4 table");
        }
    }
}
