//! The per-rank timeline of a dp2·tp2·pp2 run: valid Chrome trace JSON, every rank present,
//! every kind of span present, no overlapping spans on one rank's track; and the step report,
//! whose spans must account for the step time (what no span covers stays under 5%).

use std::time::Instant;

use ferrotron_config::{Config, PpSchedule};
use ferrotron_tensor::trace::chrome_trace_json;
use ferrotron_train::launch::on_thread_ranks;
use ferrotron_train::step_report::rank_report;
use ferrotron_train::Init;

#[test]
fn dp2_tp2_pp2_trace_and_report() {
    let mut c = Config::default();
    // Steps long enough (≈ 2 s) that thread wake-ups between spans are noise, as in real
    // runs, even with 8 ranks sharing 2 cores.
    c.model.hidden = 256;
    c.model.layers = 4;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 768;
    c.model.seq_len = 128;
    c.train.steps = 3;
    c.train.micro_batch = 2;
    c.train.grad_accum = 4;
    c.train.threads = 1;
    c.parallel.dp = 2;
    c.parallel.tp = 2;
    c.parallel.pp = 2;
    c.parallel.pp_schedule = PpSchedule::OneFOneB;
    let origin = Instant::now();
    let ranks = on_thread_ranks(&c, Init::Fresh, |mut t| {
        let tracer = t.enable_trace(origin, 2, 3);
        t.run(|_| {})?;
        Ok((t.rank(), tracer.take()))
    })
    .unwrap();
    let json = chrome_trace_json(&ranks);
    let parsed: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    let events = parsed["traceEvents"].as_array().unwrap();
    let mut pids: Vec<u64> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    pids.sort();
    pids.dedup();
    assert_eq!(pids, (0..8).collect::<Vec<u64>>(), "every rank present");
    for cat in [
        "forward",
        "backward",
        "collective",
        "pipeline",
        "tensor-parallel",
        "data-parallel",
        "optimizer",
        "step",
        "data",
    ] {
        assert!(
            events.iter().any(|e| e["ph"] == "X" && e["cat"] == cat),
            "no span of kind {cat}"
        );
    }
    // Spans of one rank never overlap on one track.
    for pid in 0..8u64 {
        for tid in 0..4u64 {
            let mut spans: Vec<(f64, f64)> = events
                .iter()
                .filter(|e| e["ph"] == "X" && e["pid"] == pid && e["tid"] == tid)
                .map(|e| (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap()))
                .collect();
            spans.sort_by(|a, b| a.0.total_cmp(&b.0));
            for w in spans.windows(2) {
                // Timestamps are printed to 1 ns; allow that rounding.
                assert!(
                    w[0].0 + w[0].1 <= w[1].0 + 2e-3,
                    "rank {pid} track {tid}: {w:?} overlap"
                );
            }
        }
    }
    for (rank, spans) in &ranks {
        let r = rank_report(*rank, spans);
        let t = r.time;
        assert_eq!(r.steps, 2);
        assert!(
            t.compute_s > 0.0 && t.exposed_comm_s > 0.0,
            "rank {rank}: {t:?}"
        );
        let covered = t.compute_s + t.exposed_comm_s + t.bubble_s;
        eprintln!(
            "rank {rank}: spans cover {:.1}% of the step time",
            100.0 * covered / t.step_s
        );
        assert!(
            (t.step_s - covered).abs() <= 0.05 * t.step_s,
            "rank {rank}: compute + exposed + bubble = {covered:.4} s of a {:.4} s step time",
            t.step_s
        );
        assert!(
            r.volume.iter().any(|v| v.kind == "all_reduce"),
            "rank {rank}: no all-reduce counted"
        );
    }
}
