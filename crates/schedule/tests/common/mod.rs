//! Shared helpers for the schedule tests (each test binary uses a subset).
#![allow(dead_code)]

use ferrotron_schedule::ScheduleKind;

/// Every configuration the brief asks for: p in 1..=8, m in 1..=32, for interleaved v in
/// {2, 3, 4} where m % p == 0, and DualPipeV (v = 2) where m ≥ 2p.
pub fn all_configs() -> Vec<(ScheduleKind, usize, usize, usize)> {
    let mut out = Vec::new();
    for p in 1..=8 {
        for m in 1..=32 {
            for kind in [
                ScheduleKind::Afab,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZeroBubble,
            ] {
                out.push((kind, p, m, 1));
            }
            if m % p == 0 {
                for v in 2..=4 {
                    out.push((ScheduleKind::Interleaved, p, m, v));
                }
            }
            if m >= 2 * p {
                out.push((ScheduleKind::DualPipeV, p, m, 2));
            }
        }
    }
    out
}

/// Asserts `a == b` within `tol`, naming the case.
#[track_caller]
pub fn assert_close(a: f64, b: f64, tol: f64, what: &str) {
    assert!(
        (a - b).abs() <= tol,
        "{what}: got {a}, want {b} (tolerance {tol})"
    );
}
