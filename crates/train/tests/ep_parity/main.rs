//! Mixture-of-experts model and expert parallelism.
//!
//! 1. The whole MoE model's gradient (cross-entropy + weighted load-balancing loss) against
//!    central finite differences on one rank.
//! 2. Expert parallelism ep ∈ {2, 4} folded into dp = 4 against ep = 1 and against the single
//!    rank with grad_accum × dp (the same global batch, see `dp_parity.rs`): identical routing
//!    (expert counts per block and step, exactly), loss and load-balancing loss per step within
//!    relative 1e-5, every parameter tensor within relative 1e-5 (L2).
//! 3. ep = 2 combined with tensor (and sequence), pipeline and context parallelism, and all
//!    five together (dp2·ep2·tp2·pp2·cp2), against the single rank, same tolerances.
//! 4. The ledger: expert weights, gradients and optimizer states per rank are the ep = 1
//!    values divided by ep, exactly.
//! 5. bf16: expert parallelism stays as close to the single rank as plain data parallelism.
//! 6. The model gathered from an expert-parallel run exports as a Hugging Face Mixtral.
//!
//! Tolerances are those of `dp_parity.rs`: the layouts add the same gradient contributions in
//! another order. Routing is discrete, so it must match exactly; the model is small enough
//! that no token sits within rounding of a routing tie over these steps.

use ferrotron_config::{Config, DType, ModelConfig, PpSchedule, Recompute};
use ferrotron_model::{init_params, Grads, Llama, MoeStep, ParamLayout, StepCtx};
use ferrotron_parallel::buckets::BucketPlan;
use ferrotron_tensor::{Category, CpuBackend, Ledger, Store, StoreDType};
use ferrotron_train::launch::run_threads;
use ferrotron_train::{Init, StepStats, Trainer};

mod balance;
mod capacity;
mod gradcheck;

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 32;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 32;
    c.model.seq_len = 16;
    c.model.experts = 4;
    c.model.top_k = 2;
    c.model.moe_every = 1;
    // Larger than Mixtral's default so the load-balancing gradient is well above rounding.
    c.model.router_aux_loss_coef = 0.1;
    c.train.steps = 6;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 2;
    c.train.dtype = DType::F32;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.005;
    c.parallel.comm_timeout_s = 60.0;
    c
}

/// A layout's settings, applied to [`base`]; its single-rank reference is [`base`] with
/// `grad_accum` doubled (the same global batch).
type Setter = fn(&mut Config);

/// The layouts routing must agree on with the single rank (same global batch): dp2, dp2
/// ZeRO-1, dp2·ep2, and tp2 + SP (each rank the whole micro-batch, gathered).
fn routing_layouts() -> Vec<(&'static str, Setter)> {
    vec![
        ("dp2", |c| c.parallel.dp = 2),
        ("dp2 zero-1", |c| (c.parallel.dp, c.parallel.zero) = (2, 1)),
        ("dp2·ep2", |c| (c.parallel.dp, c.parallel.ep) = (2, 2)),
        ("tp2·sp", |c| {
            (c.parallel.tp, c.parallel.sequence_parallel) = (2, true);
            c.train.grad_accum *= 2;
        }),
    ]
}

struct Run {
    steps: Vec<StepStats>,
    params: Vec<f32>,
}

fn single(c: &Config) -> Run {
    let mut t = Trainer::new(c.clone()).unwrap();
    let steps = t.run(|_| {}).unwrap();
    Run {
        steps,
        params: t.full_params().unwrap(),
    }
}

fn parallel(c: &Config) -> Vec<Run> {
    run_threads(c, Init::Fresh, |_| {}, |_, _| {})
        .unwrap()
        .into_iter()
        .map(|o| Run {
            steps: o.steps,
            params: o.params,
        })
        .collect()
}

/// Asserts `a` matches `reference` (f32 tolerances); returns the worst (loss, aux, tensor)
/// relative errors.
fn compare(what: &str, c: &Config, a: &Run, reference: &Run) -> (f64, f64, f64) {
    compare_within(what, c, a, reference, [1e-5, 1e-5], true)
}

/// Asserts `a` matches `reference` within `[loss and aux, tensor]` relative tolerances, with
/// identical routing when `exact_routing`.
fn compare_within(
    what: &str,
    c: &Config,
    a: &Run,
    reference: &Run,
    [tol, tensor_tol]: [f64; 2],
    exact_routing: bool,
) -> (f64, f64, f64) {
    assert_eq!(a.steps.len(), reference.steps.len());
    let (mut loss, mut aux, mut tensor) = (0.0f64, 0.0f64, 0.0f64);
    for (s, (x, y)) in a.steps.iter().zip(&reference.steps).enumerate() {
        let (mx, my) = (x.moe.as_ref().unwrap(), y.moe.as_ref().unwrap());
        if exact_routing {
            assert_eq!(
                mx.expert_counts,
                my.expert_counts,
                "{what} step {}: routing",
                s + 1
            );
        }
        let rel = |p: f64, q: f64| (p - q).abs() / q.abs();
        loss = loss.max(rel(x.loss, y.loss));
        aux = aux.max(rel(mx.aux_loss, my.aux_loss));
        assert!(
            rel(x.loss, y.loss) <= tol,
            "{what} step {}: loss {} vs {}",
            s + 1,
            x.loss,
            y.loss
        );
        // The global norm counts every expert once (it clips: norms are about 1 here).
        assert!(
            rel(x.grad_norm, y.grad_norm) <= tol,
            "{what} step {}: gradient norm {} vs {}",
            s + 1,
            x.grad_norm,
            y.grad_norm
        );
        assert!(
            rel(mx.aux_loss, my.aux_loss) <= tol,
            "{what} step {}: aux {} vs {}",
            s + 1,
            mx.aux_loss,
            my.aux_loss
        );
    }
    for spec in &ParamLayout::new(&c.model).params {
        let (x, y) = (&a.params[spec.range()], &reference.params[spec.range()]);
        let diff: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let norm: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
        let rel = (diff / norm).sqrt();
        tensor = tensor.max(rel);
        assert!(
            rel <= tensor_tol,
            "{what}: {} differs by {rel:e}",
            spec.name
        );
    }
    eprintln!("{what}: loss {loss:.1e}, aux {aux:.1e}, worst tensor {tensor:.1e} (relative)");
    (loss, aux, tensor)
}

/// ep ∈ {2, 4} (dp = 4, ZeRO-0 and ZeRO-1; ep = 2 also ZeRO-2 and 3) against ep = 1 and the
/// single rank.
#[test]
fn expert_parallel_matches_ep1_and_single_rank() {
    let mut single_cfg = base();
    single_cfg.train.grad_accum *= 4;
    let reference = single(&single_cfg);
    let mut worst = (0.0f64, 0.0f64, 0.0f64);
    let mut ep1 = None;
    for (ep, zero) in [(1, 0), (2, 0), (4, 0), (2, 1), (4, 1), (2, 2), (2, 3)] {
        let mut c = base();
        (c.parallel.dp, c.parallel.ep, c.parallel.zero) = (4, ep, zero);
        let runs = parallel(&c);
        assert_eq!(runs.len(), 4);
        for (rank, r) in runs.iter().enumerate() {
            let what = format!("dp=4 ep={ep} zero={zero} rank {rank}");
            let (l, a, t) = compare(&what, &c, r, &reference);
            worst = (worst.0.max(l), worst.1.max(a), worst.2.max(t));
            if let Some(ep1) = &ep1 {
                compare(&format!("{what} vs ep=1"), &c, r, ep1);
            }
        }
        if ep == 1 {
            ep1 = runs.into_iter().next();
        }
    }
    eprintln!(
        "worst against the single rank: loss {:.1e}, aux {:.1e}, tensor {:.1e}",
        worst.0, worst.1, worst.2
    );
}

/// ep = 2 with tensor parallelism (with and without sequence parallelism), with pipeline
/// parallelism (1F1B and zero bubble), with full recomputation, with context parallelism,
/// and all five dimensions together, against the single rank.
#[test]
fn expert_parallel_with_tp_pp_and_cp_matches_single_rank() {
    let mut single_cfg = base();
    single_cfg.train.grad_accum *= 2;
    let reference = single(&single_cfg);
    type Setter = fn(&mut Config);
    let layouts: [(&str, Setter); 8] = [
        ("dp2·ep2·tp2", |c| c.parallel.tp = 2),
        ("dp2·ep2·tp2·sp", |c| {
            c.parallel.tp = 2;
            c.parallel.sequence_parallel = true;
        }),
        ("dp2·ep2·pp2 1f1b", |c| c.parallel.pp = 2),
        ("dp2·ep2·pp2 zero bubble", |c| {
            c.parallel.pp = 2;
            c.parallel.pp_schedule = PpSchedule::ZeroBubble;
        }),
        ("dp2·ep2 full recompute", |c| {
            c.parallel.recompute = Recompute::Full
        }),
        ("dp2·ep2·tp2·pp2 zero-1", |c| {
            (c.parallel.tp, c.parallel.pp, c.parallel.zero) = (2, 2, 1);
        }),
        ("dp2·ep2·cp2 zero-1", |c| {
            (c.parallel.cp, c.parallel.zero) = (2, 1);
        }),
        // The 5D layout: 16 ranks.
        ("dp2·ep2·tp2·sp·pp2·cp2 zero-1", |c| {
            (c.parallel.tp, c.parallel.pp, c.parallel.cp) = (2, 2, 2);
            (c.parallel.sequence_parallel, c.parallel.zero) = (true, 1);
        }),
    ];
    for (what, set) in layouts {
        let mut c = base();
        (c.parallel.dp, c.parallel.ep) = (2, 2);
        set(&mut c);
        let runs = parallel(&c);
        assert_eq!(runs.len(), c.parallel.world_size());
        for (rank, r) in runs.iter().enumerate() {
            compare(&format!("{what} rank {rank}"), &c, r, &reference);
        }
    }
}

/// Per rank under ZeRO-0 (f32), weights, gradients and Adam states are `4, 4, 8` bytes per
/// dense parameter plus the same per expert parameter divided by ep; under ZeRO-1 the
/// optimizer holds the rank's shard (dense buckets over dp, expert buckets over dp/ep).
#[test]
fn ledger_divides_expert_bytes_by_ep() {
    let mut c = base();
    c.train.steps = 1;
    let psi = c.model.num_params();
    let experts = c.model.num_expert_params();
    assert_eq!(experts % 4, 0);
    let dense = psi - experts;
    let mut expert_bytes_ep1 = [0usize; 3];
    for zero in [0u8, 1] {
        for ep in [1usize, 2, 4] {
            (c.parallel.dp, c.parallel.ep, c.parallel.zero) = (4, ep, zero);
            let outcomes = run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap();
            for o in &outcomes {
                let what = format!("zero={zero} ep={ep} rank {}", o.rank);
                let mem = &o.memory;
                let [w, g, opt] = [Category::Weights, Category::Gradients, Category::Optimizer]
                    .map(|cat| mem.current(cat));
                assert_eq!(w, 4 * (dense + experts / ep), "{what}: weights");
                assert_eq!(g, 4 * (dense + experts / ep), "{what}: gradients");
                assert_eq!(mem.current(Category::Activations), 0, "{what}: activations");
                // Between steps, workspace holds only the host kernels' scratch (for the run):
                // gemm's largest packing and the attention tiles' per compute thread.
                let (p, t) = (&c.parallel, &c.train);
                let threads = ferrotron_train::trainer::thread_pool(t.threads)
                    .unwrap()
                    .current_num_threads();
                let standing = ferrotron_config::step_matmul_scratch_bytes(
                    t.matmul,
                    threads,
                    &c.model,
                    p,
                    (t.micro_batch, t.loss_chunk),
                );
                assert_eq!(
                    mem.current(Category::Workspace),
                    standing as usize,
                    "{what}: workspace"
                );
                if zero == 0 {
                    assert_eq!(opt, 8 * (dense + experts / ep), "{what}: optimizer");
                    let expert_part = [w - 4 * dense, g - 4 * dense, opt - 8 * dense];
                    if ep == 1 {
                        expert_bytes_ep1 = expert_part;
                    }
                    assert_eq!(expert_part, expert_bytes_ep1.map(|b| b / ep), "{what}");
                    if o.rank == 0 {
                        eprintln!("{what}: expert bytes (weights, grads, adam) {expert_part:?}");
                    }
                } else {
                    let layout = Llama::sharded(
                        &c.model,
                        ferrotron_model::Shard {
                            tp: 1,
                            tp_rank: 0,
                            ep,
                            ep_rank: o.rank % ep,
                        },
                        &ferrotron_model::StageParts {
                            layers: vec![0, 1],
                            embed: true,
                            head: true,
                        },
                    )
                    .layout;
                    let elems = ferrotron_config::bucket_elems(c.parallel.bucket_mb, 4);
                    let plan = BucketPlan::with_experts(&layout, elems, 4, (ep, 1), true, false);
                    assert_eq!(opt, 8 * plan.shard_len(o.rank), "{what}: optimizer");
                    let expert_shard: usize = plan
                        .pieces(o.rank)
                        .iter()
                        .filter(|(k, _, _)| plan.buckets[*k].experts)
                        .map(|(_, r, _)| r.len())
                        .sum();
                    // The experts of one ep index are split over its dp/ep replicas.
                    let edp = 4 / ep;
                    assert!(expert_shard.abs_diff(experts / ep / edp) < layout.layers.len() * edp);
                }
            }
        }
    }
}

/// The model gathered from a dp = 2, ep = 2 run (every expert once, under its global name) is
/// written as a Hugging Face `MixtralForCausalLM` and reads back bitwise.
#[test]
fn hf_export_writes_a_mixtral_model() {
    let mut c = base();
    (c.parallel.dp, c.parallel.ep, c.train.steps) = (2, 2, 1);
    let dir = std::env::temp_dir().join(format!("ferrotron-ep-hf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let params = ferrotron_train::launch::on_thread_ranks(&c, Init::Fresh, |mut t| {
        t.step()?;
        let (layout, weights) = t.gather_model()?;
        if t.rank() == 0 {
            let ledger = t.device().ledger;
            ferrotron_train::hf::save_model(
                &dir,
                &t.config.model,
                &layout,
                &weights,
                ledger,
                ferrotron_train::hf::shards::DEFAULT_MAX_SHARD,
            )
            .unwrap();
        }
        t.full_params()
    })
    .unwrap();
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["architectures"][0], "MixtralForCausalLM");
    assert_eq!(json["model_type"], "mixtral");
    assert_eq!(json["num_local_experts"], 4);
    assert_eq!(json["num_experts_per_tok"], 2);
    assert_eq!(json["router_aux_loss_coef"], 0.1);
    let loaded = ferrotron_train::hf::load_model(&dir).unwrap();
    assert_eq!(loaded.config.experts, 4);
    assert_eq!(loaded.config.top_k, 2);
    assert_eq!(loaded.weights, params[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// bf16 with fp32 master weights: dp = 2 with ep = 2 and with ep = 1 (plain data
/// parallelism), ZeRO-1, against the single rank. bf16 rounding of the gradients at different
/// points of the sums, not the parallelism, sets the scale (see `dp_parity.rs`): loss within
/// 2e-3; tensors within 1e-1 relative (L2), because four Adam steps of ±lr ≈ 3e-3 move the
/// 0.01-sized experts' `w2` by a third of their size, so a few sign-flipped tiny gradients show
/// (measured 5.7e-2 for ep = 1 and 5.9e-2 for ep = 2). Expert parallelism must not add to
/// that: its worst tensor stays within 1.5 × plain data parallelism's. Routing may flip at a
/// near-tie and is not compared exactly.
#[test]
fn bf16_expert_parallel_tracks_single_rank_like_data_parallelism() {
    let mut c = base();
    c.train.dtype = DType::Bf16;
    c.train.steps = 4;
    let mut single_cfg = c.clone();
    single_cfg.train.grad_accum *= 2;
    let reference = single(&single_cfg);
    let mut worst = [0.0f64; 2];
    for (i, ep) in [1, 2].into_iter().enumerate() {
        (c.parallel.dp, c.parallel.ep, c.parallel.zero) = (2, ep, 1);
        for (rank, r) in parallel(&c).iter().enumerate() {
            let what = format!("bf16 dp2·ep{ep} rank {rank}");
            let (_, _, tensor) = compare_within(&what, &c, r, &reference, [2e-3, 1e-1], false);
            worst[i] = worst[i].max(tensor);
        }
    }
    assert!(
        worst[1] <= 1.5 * worst[0],
        "ep=2 {:e} vs ep=1 {:e}",
        worst[1],
        worst[0]
    );
}

/// Experts that receive no token in a micro-batch still close their gradient bucket: under
/// ZeRO-2/3 its reduce-scatter runs with zeros. The router is set so that, with top-1
/// routing, experts 2 and 3 never win (of the logits `(2a, −a, a, 0)·100` expert 0 wins for
/// a > 0 and expert 1 for a < 0), so the ranks holding them see an empty bucket.
#[test]
fn experts_without_tokens_under_zero_2_and_3() {
    let mut c = base();
    c.model.top_k = 1;
    // A small learning rate keeps the router collapsed over the run.
    (c.train.lr, c.train.min_lr) = (1e-4, 1e-5);
    let layout = ParamLayout::new(&c.model);
    let mut w = vec![0.0f32; layout.total];
    init_params(&layout, c.train.seed, &mut w);
    let h = c.model.hidden;
    for l in 0..c.model.layers {
        let gate = layout
            .find(&format!("model.layers.{l}.block_sparse_moe.gate.weight"))
            .unwrap();
        let g = &mut w[gate.range()];
        let u: Vec<f32> = g[..h].to_vec();
        for j in 0..h {
            // Large logits, so the few optimizer steps cannot bring expert 3 into play.
            (g[j], g[h + j], g[2 * h + j]) = (200.0 * u[j], -100.0 * u[j], 100.0 * u[j]);
        }
        g[3 * h..].fill(0.0);
    }
    let mut single_cfg = c.clone();
    single_cfg.train.grad_accum *= 4;
    let mut t = Trainer::with_weights(single_cfg, &w).unwrap();
    let steps = t.run(|_| {}).unwrap();
    let reference = Run {
        steps,
        params: t.full_params().unwrap(),
    };
    // The whole first step routes nothing to experts 2 and 3 in any block (and so in any
    // micro-batch); later steps may let a token through near a = 0.
    for counts in &reference.steps[0].moe.as_ref().unwrap().expert_counts {
        assert_eq!(
            (counts[2], counts[3]),
            (0, 0),
            "experts 2, 3 got tokens: {counts:?}"
        );
    }
    for zero in [2, 3] {
        let mut p = c.clone();
        // ep = 2: ep rank 1 holds experts 2 and 3, replicated over an expert-data group of 2.
        (p.parallel.dp, p.parallel.ep, p.parallel.zero) = (4, 2, zero);
        let runs: Vec<Run> = run_threads(&p, Init::Weights(&w), |_| {}, |_, _| {})
            .unwrap()
            .into_iter()
            .map(|o| Run {
                steps: o.steps,
                params: o.params,
            })
            .collect();
        compare(
            &format!("ep2 zero{zero} with idle experts"),
            &p,
            &runs[0],
            &reference,
        );
    }
}
