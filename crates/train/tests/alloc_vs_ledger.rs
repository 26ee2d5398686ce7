//! The CPU cost model's allocation term (`ferrotron_plan::cpu_kernels::unit_alloc_bytes`:
//! the buffers a step allocates, zero-filled, between its kernels) against the memory
//! ledger's count of what a real step allocated. One step's allocations are the difference
//! between a run of two steps and a run of one (start-up and shut-down allocate the same).

use ferrotron_config::Config;
use ferrotron_plan::cpu_kernels::{reduction_alloc_elems, unit_alloc_bytes};
use ferrotron_plan::Job;
use ferrotron_train::launch::run_threads;
use ferrotron_train::Init;

/// The bench's tiny preset, one micro-batch of 4 × 128 tokens per step, 2 per step.
fn base() -> Config {
    let mut c = Config::default();
    c.model.vocab = 256;
    c.train.micro_batch = 4;
    c.train.grad_accum = 2;
    c.train.threads = 1;
    c
}

/// Bytes each rank's runs of one and two steps allocated, by rank.
fn allocated(c: &Config, steps: usize) -> Vec<usize> {
    let mut c = c.clone();
    c.train.steps = steps;
    let mut out = run_threads(&c, Init::Fresh, |_| {}, |_, _| {}).unwrap();
    out.sort_by_key(|o| o.rank);
    out.iter().map(|o| o.memory.allocated).collect()
}

#[test]
fn the_cost_models_allocations_match_the_ledger() {
    let layouts: &[&[&str]] = &[
        &[],
        &["parallel.recompute=full"],
        &["parallel.tp=2"],
        &["parallel.tp=2", "parallel.sequence_parallel=true"],
        &["parallel.cp=2"],
        &["parallel.dp=2"],
        &["parallel.dp=2", "parallel.zero=1"],
        &["parallel.dp=2", "parallel.zero=3"],
        &["model.experts=4", "model.top_k=2"],
    ];
    for sets in layouts {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let c =
            Config::from_toml_with_overrides(&toml::to_string(&base()).unwrap(), &sets).unwrap();
        c.validate().unwrap();
        let job = Job::from_config(&c).unwrap();
        let per_micro_batch: f64 = job
            .model
            .units()
            .into_iter()
            .map(|u| {
                let (f, b) = unit_alloc_bytes(&job.model, &job.layout, u);
                f + b
            })
            .sum();
        let p = &c.parallel;
        let params = ferrotron_plan::estimate(&job).unwrap().params as f64;
        let reduction = reduction_alloc_elems(params, p.dp * p.cp, p.zero, c.train.grad_accum);
        let predicted = per_micro_batch * c.train.grad_accum as f64 + 4.0 * reduction;
        let (one, two) = (allocated(&c, 1), allocated(&c, 2));
        for (rank, (a, b)) in one.iter().zip(&two).enumerate() {
            let measured = (b - a) as f64;
            let err = (predicted - measured) / measured;
            println!("{sets:?} rank {rank}: step allocated {measured} bytes, predicted {predicted} ({:+.1}%)", 100.0 * err);
            assert!(
                err.abs() <= 0.10,
                "{sets:?} rank {rank}: a step allocated {measured} bytes, the cost model says {predicted}"
            );
        }
    }
}
