//! The planner: speed at 4096 GPUs, the playbook's §6 table, and its reasons.
//!
//! §6 (8×H100 nodes, seq 4096, global batch 2²⁰ tokens; MFU counts attention over the full
//! s×s matrix, nanotron's convention). The cost model has ONE calibrated constant, the kernel
//! efficiency (0.48 of the bf16 peak), fitted once to the three single-node cells with the
//! playbook's own configurations (where communication is negligible); nothing is tuned per
//! cell. The planner runs with [`PlanOptions::playbook_measured`], the system the playbook
//! measured (nanotron: fp32 gradients all-reduced after the backward, ZeRO-0/1, AFAB/1F1B,
//! no CP) — with this engine's overlap the multi-node cells come out 6–14 points higher.
//! Asserted within 5 points: the planner's best of 6 cells (1 node; 3B and 8B at 8 nodes; 8B
//! at 64 nodes) and the playbook's configurations where given. Not reproduced: 1B at 8 nodes
//! (37.7% against 32.5%: the planner's DP32·TP2 is predicted faster than the playbook's
//! DP32·PP2, which it puts at 34.3%), and 1B and 3B at 64 nodes (2048 tokens per GPU per
//! step), where the measured 5.2% and 10.5% are far below what bandwidth, latency, bubble
//! and overlap predict for the best layouts (18% and 20%).

use std::time::Instant;

use ferrotron_plan::{
    plan_with, Hardware, ModelSpec, PlanOptions, PlanRequest, Schedule, ShapeFilter, Verdict,
};

fn request(model: &str, gpus: usize) -> PlanRequest {
    PlanRequest {
        model: ModelSpec::preset(model).unwrap(),
        gpus,
        hardware: Hardware::builtin("h100").unwrap(),
        seq: 4096,
        global_batch_tokens: 1 << 20,
    }
}

#[test]
fn plans_4096_gpus_in_well_under_10_s() {
    for model in ["llama3-405b", "mixtral-8x7b"] {
        let mut req = request(model, 4096);
        req.global_batch_tokens = 16 << 20;
        let start = Instant::now();
        let p = plan_with(&req, &PlanOptions::default()).unwrap();
        let took = start.elapsed().as_secs_f64();
        let best = &p.candidates[0];
        eprintln!(
            "{model} on 4096 H100: {} layouts in {took:.2} s; best {}",
            p.considered,
            best.summary()
        );
        assert!(took < 5.0, "{took} s");
        assert_eq!(best.verdict, Verdict::Best);
        assert!(best.memory.total() <= p.usable_bytes);
        assert_eq!(best.layout.world_size(), 4096);
        let l = &best.layout;
        assert_eq!(l.dp * l.micro_batch * l.grad_accum * 4096, 16 << 20);
    }
}

/// The playbook's configuration of a cell: (dp, tp, pp, zero).
type Config = Option<(usize, usize, usize, u8)>;

/// (model, nodes, measured MFU %, the playbook's configuration if given, asserted within 5
/// points).
const TABLE: [(&str, usize, f64, Config, bool); 9] = [
    ("llama3-1b", 1, 44.3, Some((4, 1, 2, 1)), true),
    ("llama3-3b", 1, 46.7, Some((4, 1, 2, 1)), true),
    ("llama3-8b", 1, 45.2, Some((2, 1, 4, 1)), true),
    ("llama3-1b", 8, 32.5, Some((32, 1, 2, 1)), false),
    ("llama3-3b", 8, 35.5, None, true),
    ("llama3-8b", 8, 39.5, Some((32, 1, 2, 1)), true),
    ("llama3-1b", 64, 5.2, None, false),
    ("llama3-3b", 64, 10.5, None, false),
    ("llama3-8b", 64, 18.7, Some((128, 4, 1, 0)), true),
];

#[test]
fn playbook_section_6_table() {
    println!(
        "{:<10} {:>5} | {:>8} | {:<34} {:>6} | {:<40} {:>6}",
        "model", "nodes", "measured", "playbook config", "ours", "planner's best", "MFU"
    );
    for (model, nodes, measured, config, assert) in TABLE {
        let req = request(model, nodes * 8);
        let measured_system = PlanOptions::playbook_measured();
        let best = &plan_with(&req, &measured_system).unwrap().candidates[0];
        let best_mfu = 100.0 * best.cost.mfu;
        let (cfg_text, cfg_mfu) = match config {
            Some((dp, tp, pp, zero)) => {
                let opts = PlanOptions {
                    only: ShapeFilter {
                        dp: Some(dp),
                        tp: Some(tp),
                        pp: Some(pp),
                        cp: Some(1),
                        ep: None,
                        zero: Some(zero),
                        schedule: Some(Schedule::OneFOneB),
                    },
                    ..measured_system
                };
                let c = &plan_with(&req, &opts).unwrap().candidates[0];
                (c.layout.describe(), Some(100.0 * c.cost.mfu))
            }
            None => ("(not given)".to_string(), None),
        };
        println!(
            "{model:<10} {nodes:>5} | {measured:>7.1}% | {cfg_text:<34} {:>6} | {:<40} {best_mfu:>5.1}%",
            cfg_mfu.map_or("-".into(), |m| format!("{m:.1}%")),
            best.layout.describe(),
        );
        if assert {
            if let Some(m) = cfg_mfu {
                assert!(
                    (m - measured).abs() <= 5.0,
                    "{model} {nodes}: config {m:.1} vs {measured}"
                );
            }
            let d = best_mfu - measured;
            assert!(
                d.abs() <= 5.0,
                "{model} {nodes}: best {best_mfu:.1} vs {measured}"
            );
        }
    }
}

#[test]
fn alternatives_say_why_they_lost() {
    // 8B on one node: without ZeRO the optimizer states alone need 12 × 8.03e9 bytes per
    // rank, so the faster ZeRO-0 layouts are reported as out of memory.
    let req = request("llama3-8b", 8);
    let p = plan_with(&req, &PlanOptions::default()).unwrap();
    assert_eq!(p.candidates[0].verdict, Verdict::Best);
    assert!(p.candidates[0].layout.zero >= 1);
    let oom = p
        .candidates
        .iter()
        .find_map(|c| match &c.verdict {
            Verdict::OutOfMemory {
                needed, available, ..
            } => Some((*needed, *available)),
            _ => None,
        })
        .expect("an out-of-memory alternative");
    assert!(oom.0 > 12 * 8_030_261_248 && oom.1 == (0.9 * (80u64 << 30) as f64) as u64);
    for c in &p.candidates[1..] {
        if let Verdict::Slower { percent, why } = &c.verdict {
            assert!(*percent >= 0.0 && !why.is_empty(), "{}", c.summary());
        }
    }
    // 3 GPUs cannot split 256 sequences: only dp = 1 reaches the batch.
    let p = plan_with(&request("llama3-1b", 3), &PlanOptions::default()).unwrap();
    assert_eq!(p.candidates[0].layout.dp, 1);
    assert!(p
        .candidates
        .iter()
        .any(|c| matches!(c.verdict, Verdict::BatchNotReachable { .. })));
}

#[test]
fn bad_requests_are_errors() {
    let mut req = request("llama3-1b", 8);
    req.global_batch_tokens = 1000;
    let err = plan_with(&req, &PlanOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "global_batch_tokens: 1000 is not a positive multiple of seq=4096"
    );
    let mut req = request("llama3-1b", 0);
    req.global_batch_tokens = 4096;
    assert!(plan_with(&req, &PlanOptions::default()).is_err());
}
