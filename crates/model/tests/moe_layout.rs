//! The flat layout of a mixture-of-experts model: units tile the buffer in forward order,
//! experts form their own units, and expert parallelism gives every expert to exactly one
//! member of the group under its global Mixtral name.

use ferrotron_config::ModelConfig;
use ferrotron_model::{ParamLayout, Shard, StageParts, Unit};

#[test]
fn moe_layout_tiles_and_shards_experts() {
    let cfg = ModelConfig {
        layers: 4,
        experts: 4,
        top_k: 2,
        moe_every: 2,
        ..ModelConfig::default()
    };
    let full = ParamLayout::new(&cfg);
    assert_eq!(full.total, cfg.num_params());
    assert_eq!(
        full.units(),
        vec![
            Unit::Embed,
            Unit::Block(0),
            Unit::Block(1),
            Unit::Experts(1),
            Unit::Block(2),
            Unit::Block(3),
            Unit::Experts(3),
            Unit::Head
        ]
    );
    let mut next = 0;
    for u in full.units() {
        let r = full.unit_range(u);
        assert_eq!(r.start, next);
        next = r.end;
    }
    assert_eq!(next, full.total);
    let router = full
        .find("model.layers.1.block_sparse_moe.gate.weight")
        .unwrap();
    assert_eq!(router.full_shape, vec![4, cfg.hidden]);
    let w2 = full
        .find("model.layers.3.block_sparse_moe.experts.2.w2.weight")
        .unwrap();
    assert_eq!(w2.full_shape, vec![cfg.hidden, cfg.ffn]);
    assert!(full.find("model.layers.1.mlp.gate_proj.weight").is_none());
    let all = StageParts {
        layers: (0..4).collect(),
        embed: true,
        head: true,
    };
    let expert_elems = |l: &ParamLayout| -> usize {
        l.units()
            .into_iter()
            .filter(|u| ParamLayout::is_expert_unit(*u))
            .map(|u| l.unit_range(u).len())
            .sum()
    };
    assert_eq!(expert_elems(&full), cfg.num_expert_params());
    for ep in [2, 4] {
        let mut names = Vec::new();
        for ep_rank in 0..ep {
            let shard = Shard {
                tp: 1,
                tp_rank: 0,
                ep,
                ep_rank,
            };
            let l = ParamLayout::sharded(&cfg, shard, &all);
            assert_eq!(expert_elems(&l) * ep, cfg.num_expert_params());
            assert_eq!(
                full.total - l.total,
                cfg.num_expert_params() - cfg.num_expert_params() / ep
            );
            names.extend(l.params.iter().map(|p| p.name.clone()));
        }
        // Every expert is held by exactly one expert-parallel rank.
        for spec in &full.params {
            let held = names.iter().filter(|n| **n == spec.name).count();
            let expected = if spec.name.contains(".experts.") {
                1
            } else {
                ep
            };
            assert_eq!(held, expected, "{}", spec.name);
        }
    }
}
