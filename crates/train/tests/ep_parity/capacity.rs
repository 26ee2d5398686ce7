//! Token dropping (`model.moe_capacity_factor`): an expert takes at most
//! `⌈cf · T · k / E⌉` of a micro-batch's `T·k` assignments (the most probable) and drops the
//! rest. The capacity counts the micro-batch's tokens as the single rank routes them, so dp2,
//! dp2 ZeRO-1, dp2·ep2, tp2 + SP and pp2 drop the same assignments (per block and step,
//! exactly) and match the single rank within the parity tolerances. A capacity above every
//! load is the dropless run, bit for bit.

use ferrotron_config::{Config, PpSchedule};

use super::{base, compare, parallel, single, Run};

fn capped(cf: f64) -> Config {
    let mut c = base();
    c.model.moe_capacity_factor = Some(cf);
    c
}

fn dropped(run: &Run) -> Vec<Vec<u64>> {
    let moe = |s: &ferrotron_train::StepStats| s.moe.clone().unwrap();
    run.steps.iter().map(|s| moe(s).dropped).collect()
}

#[test]
fn dropped_tokens_agree_with_the_single_rank_on_every_layout() {
    // 0.75 of the balanced load: 16 tokens · 2 slots / 4 experts · 0.75 = 6 per expert.
    let mut single_cfg = capped(0.75);
    single_cfg.train.grad_accum *= 2;
    let reference = single(&single_cfg);
    let drops = dropped(&reference);
    assert!(drops.iter().flatten().all(|&d| d > 0), "{drops:?}");
    // Dropping changes the model: the dropless run learns other weights.
    let mut dropless = single_cfg.clone();
    dropless.model.moe_capacity_factor = None;
    let plain = single(&dropless);
    assert!(plain
        .steps
        .iter()
        .all(|s| s.moe.as_ref().unwrap().dropped.is_empty()));
    assert_ne!(plain.steps[0].loss, reference.steps[0].loss);
    let pp2: super::Setter = |c| {
        (c.parallel.pp, c.parallel.pp_schedule) = (2, PpSchedule::OneFOneB);
        c.train.grad_accum *= 2;
    };
    let mut layouts = super::routing_layouts();
    layouts.push(("pp2", pp2));
    for (what, set) in layouts {
        let mut c = capped(0.75);
        set(&mut c);
        for (rank, run) in parallel(&c).iter().enumerate() {
            compare(&format!("capacity {what} rank {rank}"), &c, run, &reference);
            assert_eq!(
                dropped(run),
                drops,
                "{what} rank {rank}: dropped assignments"
            );
        }
    }
}

#[test]
fn a_capacity_above_every_load_is_the_dropless_run() {
    // Capacity ⌈4 · 16·2/4⌉ = 16 = every token: nothing can be dropped.
    let c = capped(4.0);
    let mut dropless = c.clone();
    dropless.model.moe_capacity_factor = None;
    let (a, b) = (single(&c), single(&dropless));
    assert!(dropped(&a).iter().flatten().all(|&d| d == 0));
    let bits = |r: &Run| r.steps.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b));
    assert_eq!(a.params, b.params);
}
