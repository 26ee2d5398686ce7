//! The same run gives the same numbers, bit for bit, run after run: every reduction whose
//! order could follow thread scheduling (the loss over a chunk's rows, the squared norms of
//! the clipping, the norm weights' gradient over rows) adds in a fixed order. Five runs of a
//! mixture-of-experts model over tp2·pp2 with selective recomputation and two threads per
//! rank, five single-rank runs with two threads, and three runs each of dp2·ep2 under ZeRO-2
//! and of cp2 must agree exactly in every step's loss and gradient norm and in the final
//! parameters.

use ferrotron_config::{Config, DType, Recompute};
use ferrotron_train::launch::on_thread_ranks;
use ferrotron_train::{Init, Trainer};

fn config() -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 96;
    c.model.seq_len = 64;
    (c.model.experts, c.model.top_k, c.model.moe_every) = (4, 2, 1);
    c.train.steps = 4;
    c.train.micro_batch = 4;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 1;
    c.train.dtype = DType::F32;
    // Two threads per rank: work is split between them and stolen back and forth.
    c.train.threads = 2;
    c.parallel.recompute = Recompute::Selective;
    c.parallel.comm_timeout_s = 60.0;
    c
}

/// Every step's (loss, grad norm) bits and the full parameters' bits.
type Outcome = (Vec<(u64, u64)>, Vec<u32>);

fn outcome(t: &mut Trainer) -> Result<Outcome, ferrotron_train::TrainError> {
    let mut steps = Vec::new();
    for _ in 0..t.config.train.steps {
        let s = t.step()?;
        steps.push((s.loss.to_bits(), s.grad_norm.to_bits()));
    }
    let params = t.full_params()?.iter().map(|x| x.to_bits()).collect();
    Ok((steps, params))
}

fn assert_all_equal(what: &str, runs: &[Outcome]) {
    for (i, r) in runs.iter().enumerate().skip(1) {
        assert_eq!(
            r.0, runs[0].0,
            "{what}: run {i}'s losses differ from run 0's"
        );
        assert!(
            r.1 == runs[0].1,
            "{what}: run {i}'s parameters differ from run 0's"
        );
    }
}

#[test]
fn five_tp2_pp2_moe_runs_agree_bit_for_bit() {
    let mut c = config();
    (c.parallel.tp, c.parallel.pp) = (2, 2);
    c.parallel.sequence_parallel = true;
    let runs: Vec<Outcome> = (0..5)
        .map(|_| {
            let ranks = on_thread_ranks(&c, Init::Fresh, |mut t| outcome(&mut t)).unwrap();
            // Every rank reports the same loss; the parameters gathered on each are the same.
            ranks.into_iter().next().unwrap()
        })
        .collect();
    assert!(runs[0]
        .0
        .iter()
        .all(|(l, _)| f64::from_bits(*l).is_finite()));
    assert_all_equal("tp2·pp2 MoE", &runs);
}

#[test]
fn five_single_rank_runs_with_two_threads_agree_bit_for_bit() {
    let runs: Vec<Outcome> = (0..5)
        .map(|_| outcome(&mut Trainer::new(config()).unwrap()).unwrap())
        .collect();
    assert_all_equal("single rank", &runs);
}

/// The other dimensions: data parallelism with ZeRO-2 and expert parallelism, and context
/// parallelism (ring attention), three runs each.
#[test]
fn dp2_ep2_zero2_and_cp2_runs_agree_bit_for_bit() {
    let mut dp = config();
    (dp.parallel.dp, dp.parallel.ep, dp.parallel.zero) = (2, 2, 2);
    let mut cp = config();
    cp.parallel.cp = 2;
    for (what, c) in [("dp2·ep2 zero-2", dp), ("cp2", cp)] {
        let runs: Vec<Outcome> = (0..3)
            .map(|_| {
                let ranks = on_thread_ranks(&c, Init::Fresh, |mut t| outcome(&mut t)).unwrap();
                ranks.into_iter().next().unwrap()
            })
            .collect();
        assert_all_equal(what, &runs);
    }
}
