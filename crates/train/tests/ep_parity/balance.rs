//! Aux-loss-free balancing (`model.moe_balance = "bias"`): the per-expert biases steer the
//! routing, move by the sign rule from the global loads, agree on every rank and layout
//! (dp2, tp2 + SP, dp2·ep2, ZeRO-1) with the single rank, and resume bit for bit from a
//! checkpoint, also into another layout.

use ferrotron_config::{Config, MoeBalance};
use ferrotron_train::checkpoint::Checkpoint;
use ferrotron_train::launch::on_thread_ranks;
use ferrotron_train::{Init, StepStats, Trainer};

use super::{base, compare, Run};

fn biased() -> Config {
    let mut c = base();
    c.model.moe_balance = MoeBalance::Bias;
    // Large enough that the biases change the routing within the test's steps.
    c.model.moe_bias_rate = 0.02;
    c
}

/// The biases after each step, by block.
type History = Vec<Vec<Vec<f32>>>;

/// Every rank's steps, final parameters and biases after each step.
fn ranks(c: &Config, init: Init<'_>) -> Vec<(Run, History)> {
    on_thread_ranks(c, init, |mut t| {
        let (mut steps, mut biases) = (Vec::new(), Vec::new());
        while t.steps_done() < t.config.train.steps {
            steps.push(t.step()?);
            biases.push(t.expert_bias());
        }
        let params = t.full_params()?;
        Ok((Run { steps, params }, biases))
    })
    .unwrap()
}

fn counts(steps: &[StepStats]) -> Vec<Vec<Vec<u64>>> {
    steps
        .iter()
        .map(|s| s.moe.as_ref().unwrap().expert_counts.clone())
        .collect()
}

#[test]
fn the_biases_steer_the_routing_and_agree_with_the_single_rank_on_every_layout() {
    let mut single_cfg = biased();
    single_cfg.train.grad_accum *= 2;
    let reference = ranks(&single_cfg, Init::Fresh).remove(0);
    // The biases moved, and they changed the routing: without them the counts differ.
    assert!(reference.1.iter().flatten().flatten().any(|&b| b != 0.0));
    let mut plain = single_cfg.clone();
    plain.model.moe_balance = MoeBalance::AuxLoss;
    let unbiased = ranks(&plain, Init::Fresh).remove(0);
    assert_eq!(counts(&reference.0.steps)[0], counts(&unbiased.0.steps)[0]);
    assert_ne!(counts(&reference.0.steps), counts(&unbiased.0.steps));
    for (what, set) in super::routing_layouts() {
        let mut c = biased();
        set(&mut c);
        for (rank, (run, bias)) in ranks(&c, Init::Fresh).iter().enumerate() {
            compare(&format!("bias {what} rank {rank}"), &c, run, &reference.0);
            assert_eq!(bias, &reference.1, "{what} rank {rank}: biases");
        }
    }
}

#[test]
fn bias_balancing_resumes_bit_for_bit_also_into_another_layout() {
    let mut c = biased();
    c.train.grad_accum *= 2;
    let straight = ranks(&c, Init::Fresh).remove(0);
    let root = std::env::temp_dir().join(format!("ferrotron-bias-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut t = Trainer::new(c.clone()).unwrap();
    let first: Vec<StepStats> = (0..3).map(|_| t.step().unwrap()).collect();
    t.save_checkpoint(&root, 2).unwrap();
    let ck = Checkpoint::open(&root).unwrap();
    assert_eq!(ck.manifest.expert_bias.as_ref(), Some(&t.expert_bias()));
    let mut t = Trainer::resume(c.clone(), &ck).unwrap();
    let second = t.run(|_| {}).unwrap();
    let losses: Vec<u64> = first
        .iter()
        .chain(&second)
        .map(|s| s.loss.to_bits())
        .collect();
    let want: Vec<u64> = straight.0.steps.iter().map(|s| s.loss.to_bits()).collect();
    assert_eq!(losses, want, "losses after the resume");
    assert_eq!(
        &t.expert_bias(),
        straight.1.last().unwrap(),
        "biases after the resume"
    );
    assert!(t.full_params().unwrap() == straight.0.params);
    // Into dp2·ep2: the same biases on every rank, the same run.
    let mut wide = biased();
    (wide.parallel.dp, wide.parallel.ep) = (2, 2);
    for (rank, (run, bias)) in ranks(&wide, Init::Checkpoint(&ck)).iter().enumerate() {
        assert_eq!(bias[..], straight.1[3..], "dp2·ep2 rank {rank}: biases");
        let resumed = Run {
            steps: first.iter().cloned().chain(run.steps.clone()).collect(),
            params: run.params.clone(),
        };
        compare(
            &format!("resumed dp2·ep2 rank {rank}"),
            &wide,
            &resumed,
            &straight.0,
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The point of the biases: over a longer run (60 steps, DeepSeek-like rate 0.003) the
/// busiest expert carries less above the mean than without them (both at
/// router_aux_loss_coef = 0, so only the biases balance).
#[test]
fn the_biases_even_the_loads() {
    let busiest = |balance: MoeBalance| {
        let mut c = biased();
        c.model.router_aux_loss_coef = 0.0;
        c.model.moe_balance = balance;
        c.model.moe_bias_rate = 0.003;
        c.train.steps = 60;
        let mut t = Trainer::new(c).unwrap();
        let steps = t.run(|_| {}).unwrap();
        // Busiest expert over the mean, averaged over the blocks and the last 10 steps.
        let tail = &steps[steps.len() - 10..];
        let ratios: Vec<f64> = counts(tail)
            .iter()
            .flatten()
            .map(|c| {
                let mean = c.iter().sum::<u64>() as f64 / c.len() as f64;
                *c.iter().max().unwrap() as f64 / mean
            })
            .collect();
        ratios.iter().sum::<f64>() / ratios.len() as f64
    };
    let (biased, unbalanced) = (busiest(MoeBalance::Bias), busiest(MoeBalance::AuxLoss));
    eprintln!("busiest expert over the mean: bias {biased:.3}, none {unbalanced:.3}");
    // Measured 1.377 against 1.928 (at the rate 0.02 of the other tests, which makes the
    // biases overshoot and the routing swing step to step: 1.70 against 1.76 over 30 steps).
    assert!(
        biased < 0.8 * unbalanced,
        "bias {biased} vs none {unbalanced}"
    );
}
