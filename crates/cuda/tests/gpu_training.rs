//! The GPU check, parts 2–4: the parity layouts (Ulysses and document masking among them) on
//! CUDA ranks (threads driving GPU
//! `rank mod count`) against the single GPU, the default tiny run learning on a GPU as it does
//! on the CPU, and the presets' throughput and memory. Ignored without a GPU;
//! `scripts/gpu-check` runs them. The layout harness itself runs in CI on the CPU backend.

#![cfg(feature = "cuda")]

mod twin;

use std::sync::Arc;

use ferrotron_config::{Config, CpKind, DType, Optimizer, PpSchedule};
use ferrotron_cuda::{CudaBackend, CudaOptions, Gpu};
use ferrotron_model::ParamLayout;
use ferrotron_plan::{estimate_with, Assumptions, Job};
use ferrotron_tensor::{Backend, CpuBackend};
use ferrotron_train::launch::on_thread_ranks_on;
use ferrotron_train::Init;
use twin::close;

/// A backend for every rank of a run.
type Backends<'a> = dyn Fn(usize) -> Arc<dyn Backend> + Sync + 'a;

/// CUDA ranks: rank `r` on GPU `r mod count`, each with its own stream and memory.
fn gpu_ranks(world: usize) -> Vec<Arc<dyn Backend>> {
    gpu_ranks_with(world, CudaOptions::default())
}

/// [`gpu_ranks`] with `options`.
fn gpu_ranks_with(world: usize, options: CudaOptions) -> Vec<Arc<dyn Backend>> {
    let count = Gpu::count().unwrap_or_else(|e| panic!("{e}"));
    assert!(count > 0, "no GPU");
    let gpus: Vec<Arc<Gpu>> = (0..count.min(world))
        .map(|o| Gpu::open(o).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    (0..world)
        .map(|r| {
            let be = CudaBackend::new(gpus[r % gpus.len()].clone(), options);
            Arc::new(be.unwrap_or_else(|e| panic!("{e}"))) as Arc<dyn Backend>
        })
        .collect()
}

/// The CPU parity tests' model (`tp_parity.rs`), three steps.
fn base() -> Config {
    let mut c = Config::default();
    (
        c.model.hidden,
        c.model.layers,
        c.model.heads,
        c.model.kv_heads,
    ) = (64, 2, 8, 4);
    (c.model.ffn, c.model.seq_len) = (128, 32);
    (c.train.steps, c.train.micro_batch, c.train.grad_accum) = (3, 2, 2);
    (c.train.warmup_steps, c.train.loss_chunk) = (2, 24);
    c.train.dtype = DType::F32;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.05;
    c.parallel.comm_timeout_s = 120.0;
    c
}

/// What a run of `c` on `backends` gives (rank 0's view): the loss and full gradients of one
/// step's gradient computation, then, in a second run, the losses of `c.train.steps` steps and
/// the full parameters after them.
struct Outcome {
    grad_loss: f64,
    grads: Vec<f32>,
    losses: Vec<f64>,
    params: Vec<f32>,
}

fn first<T>(ranks: Vec<T>) -> T {
    ranks.into_iter().next().expect("rank 0")
}

fn train(c: &Config, backends: &Backends<'_>) -> Outcome {
    let (grad_loss, grads) = first(
        on_thread_ranks_on(c, Init::Fresh, backends, |mut t| {
            let (loss, _) = t.compute_gradients()?;
            Ok((loss, t.full_grads()?))
        })
        .unwrap_or_else(|e| panic!("{e}")),
    );
    let (losses, params) = first(
        on_thread_ranks_on(c, Init::Fresh, backends, |mut t| {
            let losses = (0..c.train.steps)
                .map(|_| t.step().map(|s| s.loss))
                .collect::<Result<Vec<_>, _>>()?;
            Ok((losses, t.full_params()?))
        })
        .unwrap_or_else(|e| panic!("{e}")),
    );
    Outcome {
        grad_loss,
        grads,
        losses,
        params,
    }
}

/// Worst per-tensor relative L2 error and worst element error (relative to max(|b|, 1e-2))
/// of `a` against `b`, as the CPU parity tests measure them.
fn compare(c: &Config, a: &[f32], b: &[f32]) -> (f64, f64, String) {
    let layout = ParamLayout::new(&c.model);
    let mut worst = (0.0f64, String::new());
    for spec in &layout.params {
        let (x, y) = (&a[spec.range()], &b[spec.range()]);
        let diff: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
        let norm: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
        let rel = (diff / norm.max(1e-30)).sqrt();
        if rel > worst.0 {
            worst = (rel, spec.name.clone());
        }
    }
    let element = a
        .iter()
        .zip(b)
        .map(|(p, q)| (p - q).abs() as f64 / (q.abs() as f64).max(1e-2))
        .fold(0.0, f64::max);
    (worst.0, element, worst.1)
}

/// Asserts the parity tests' tolerances (f32): losses within relative 1e-5; one step's
/// gradients within 1e-5 per tensor (L2) and 1e-4 per element; parameters after the steps
/// within 1e-5 per tensor and 1e-3 per element (Adam turns the rounding of a near-zero
/// gradient into a visible step, see `tp_parity.rs`).
fn assert_parity(name: &str, c: &Config, a: &Outcome, reference: &Outcome) {
    let rel = |x: f64, y: f64| (x - y).abs() / y.abs().max(1e-30);
    let loss = rel(a.grad_loss, reference.grad_loss);
    assert!(
        loss <= 1e-5,
        "{name}: gradient-step loss differs by {loss:e}"
    );
    for (step, (x, y)) in a.losses.iter().zip(&reference.losses).enumerate() {
        assert!(rel(*x, *y) <= 1e-5, "{name} step {step}: loss {x} vs {y}");
    }
    let (tensor, element, worst) = compare(c, &a.grads, &reference.grads);
    eprintln!("{name}: gradients {tensor:.1e} per tensor ({worst}), {element:.1e} per element");
    assert!(
        tensor <= 1e-5 && element <= 1e-4,
        "{name}: gradients of {worst}"
    );
    let (tensor, element, worst) = compare(c, &a.params, &reference.params);
    eprintln!("{name}: parameters {tensor:.1e} per tensor ({worst}), {element:.1e} per element");
    assert!(
        tensor <= 1e-5 && element <= 1e-3,
        "{name}: parameters of {worst}"
    );
}

/// The parity suite's layouts, each against the single device, on `device(world)`.
fn layouts_match_the_single_device(device: &dyn Fn(usize) -> Vec<Arc<dyn Backend>>) {
    let mut layouts: Vec<(&str, Config)> = Vec::new();
    let mut c = base();
    c.parallel.dp = 2;
    layouts.push(("dp2", c));
    let mut c = base();
    (c.parallel.tp, c.parallel.sequence_parallel) = (2, true);
    layouts.push(("tp2 with sp", c));
    let mut c = base();
    (c.parallel.pp, c.parallel.pp_schedule) = (2, PpSchedule::OneFOneB);
    layouts.push(("pp2 1f1b", c));
    let mut c = base();
    c.parallel.cp = 2;
    layouts.push(("cp2", c));
    let mut c = base();
    (c.parallel.cp, c.parallel.cp_kind) = (2, CpKind::Ulysses);
    layouts.push(("cp2 ulysses", c));
    // Muon: the momentum kernel, the Newton–Schulz products and the gathers of
    // tensor-parallel slices (the harness reads whole gradients: no ZeRO).
    let mut c = base();
    c.parallel.dp = 2;
    c.train.optimizer = Optimizer::Muon;
    layouts.push(("dp2 muon", c));
    let mut c = base();
    (c.parallel.tp, c.parallel.sequence_parallel) = (2, true);
    c.train.optimizer = Optimizer::Muon;
    layouts.push(("tp2 with sp, muon", c));
    // Document masking: a 16-token vocabulary cut at token 7 (`document_mask.rs`); the
    // single device runs the masked whole-sequence blocks, cp2 the masked ring.
    let mut c = base();
    c.model.vocab = 16;
    (c.data.document_mask, c.data.eos_id) = (true, Some(7));
    c.parallel.cp = 2;
    layouts.push(("cp2 document-masked", c));
    // The expert-parallel parity test's model (`ep_parity/main.rs`): no token within rounding of
    // a routing tie over these steps.
    let mut c = base();
    (c.model.hidden, c.model.heads, c.model.kv_heads) = (32, 4, 2);
    (c.model.ffn, c.model.seq_len) = (32, 16);
    (c.model.experts, c.model.top_k, c.model.moe_every) = (4, 2, 1);
    c.model.router_aux_loss_coef = 0.1;
    (c.parallel.dp, c.parallel.ep) = (2, 2);
    layouts.push(("ep2 moe", c));
    for (name, c) in layouts {
        // The same global batch on one device, in micro-batches of the same size (the
        // load-balancing loss is a per-micro-batch statistic).
        let mut single = c.clone();
        single.train.grad_accum *= c.parallel.dp;
        (single.parallel.dp, single.parallel.tp, single.parallel.pp) = (1, 1, 1);
        (single.parallel.cp, single.parallel.ep) = (1, 1);
        single.parallel.cp_kind = CpKind::Ring;
        single.parallel.sequence_parallel = false;
        let one = device(1);
        let many = device(c.parallel.world_size());
        let reference = train(&single, &|r| one[r].clone());
        let parallel = train(&c, &|r| many[r].clone());
        assert_parity(name, &c, &parallel, &reference);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn parity_layouts_on_gpu_ranks_match_the_single_gpu() {
    layouts_match_the_single_device(&gpu_ranks);
}

/// The harness above on the CPU backend, so a GPU run tests the backend, not the harness.
#[test]
fn the_layout_harness_passes_on_the_cpu_backend() {
    layouts_match_the_single_device(&|world| {
        (0..world)
            .map(|_| Arc::new(CpuBackend::default()) as Arc<dyn Backend>)
            .collect()
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn the_default_tiny_run_learns_on_the_gpu_as_on_the_cpu() {
    let mut c = Config::default();
    c.train.steps = 100;
    let gpu = gpu_ranks(1);
    let on_gpu = train(&c, &|r| gpu[r].clone()).losses;
    let on_cpu = train(&c, &|_| Arc::new(CpuBackend::default())).losses;
    let tail = |l: &[f64]| l[l.len() - 10..].iter().sum::<f64>() / 10.0;
    let (g, cpu) = (tail(&on_gpu), tail(&on_cpu));
    eprintln!(
        "default run, 100 steps: loss {:.3} → {g:.3} on the GPU, {:.3} → {cpu:.3} on the CPU",
        on_gpu[0], on_cpu[0]
    );
    close("first loss", &[on_cpu[0] as f32], &[on_gpu[0] as f32], 1e-5);
    // Learning: the CPU run goes from 4.18 to 2.40 in 100 steps (measured); the GPU run must
    // learn as much (rounding differences grow over 100 steps, hence 3%).
    assert!(g < on_gpu[0] - 1.0, "the GPU run did not learn: {on_gpu:?}");
    assert!((g - cpu).abs() <= 0.03 * cpu, "GPU {g} vs CPU {cpu}");
}

/// The presets of `bench` plus a 1B Llama (Llama-3.2-1B's shape with a 32k vocabulary) in
/// the bf16 regime, with f32 products and with bf16 products: tokens/s, MFU against the GPU's dense bf16 peak, and the ledger's peak
/// against the estimator.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn presets_throughput_and_memory_on_the_gpu() {
    let name = Gpu::open(0).map(|g| g.name().to_string()).ok();
    let peak = bf16_dense_peak(name.as_deref().unwrap_or(""));
    println!(
        "| config | params | tokens/s | MFU vs bf16 dense peak | ledger peak GiB | estimate GiB |"
    );
    println!("|---|---|---|---|---|---|");
    let presets = [
        "tiny",
        "small",
        "medium",
        "1b, f32 products",
        "1b",
        "1b, attention as products",
        "1b, attention as TF32 products",
    ];
    for preset in presets {
        let mut c = match preset {
            "1b" => llama_1b(),
            "1b, f32 products" => {
                let mut c = llama_1b();
                c.train.matmul = ferrotron_config::Matmul::Gemm;
                c
            }
            "1b, attention as products" => products_attention(llama_1b(), false),
            "1b, attention as TF32 products" => products_attention(llama_1b(), true),
            p => ferrotron_bench::presets::preset(p).expect("a preset"),
        };
        // On the GPU: the estimator counts no host matmul scratch (and, with bf16 products,
        // the backend's scratch for their operands), as the trainer's ledger does.
        (c.train.steps, c.train.device) = (4, ferrotron_config::Device::Cuda);
        let gpu = gpu_ranks_with(1, CudaOptions::of(&c));
        let est = estimate_with(&Job::from_config(&c).expect("job"), &Assumptions::default())
            .expect("estimate")
            .total() as f64;
        let out = on_thread_ranks_on(&c, Init::Fresh, &|r| gpu[r].clone(), |mut t| {
            t.metrics.peak_flops = peak;
            let stats = t.run(|_| {})?;
            Ok(t.summary(&stats, None))
        })
        .unwrap_or_else(|e| panic!("{preset}: {e}"));
        let s = &out[0];
        let gib = (1u64 << 30) as f64;
        println!(
            "| {preset} | {} | {:.0} | {:.1}% | {:.2} | {:.2} |",
            s.params,
            s.tokens_per_s,
            100.0 * s.mfu.unwrap_or(0.0),
            s.memory_total_peak_bytes as f64 / gib,
            est / gib
        );
        let ratio = s.memory_total_peak_bytes as f64 / est;
        assert!(
            (0.9..=1.1).contains(&ratio),
            "{preset}: ledger/estimate = {ratio:.3}"
        );
    }
}

/// Where a step's time goes on the GPU: the GEMM peaks (f32 and bf16 products), and the step
/// profile (`bench --profile`'s table) of medium in f32 and of the 1B Llama in the bf16 regime
/// with bf16 products (attention in the tiled kernels, then as TF32 products), one
/// micro-batch per step, each kernel
/// timed to the end of the device's work. Rates are against the bf16 dense peak and the
/// device-to-device copy rate seen on an H200 here (4.3 TB/s); MFU counts model FLOPs.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn step_profiles_on_the_gpu() {
    let name = Gpu::open(0)
        .map(|g| g.name().to_string())
        .unwrap_or_default();
    let peak = bf16_dense_peak(&name).unwrap_or(f64::NAN);
    let (n, one) = (4096, 4096 * 4096);
    let bf16 = CudaOptions {
        bf16_products: Some(ferrotron_config::device_bf16_second_operand(one) + 2 * one),
        ..CudaOptions::default()
    };
    for (what, options) in [("f32", CudaOptions::default()), ("bf16-product", bf16)] {
        let gpu = gpu_ranks_with(1, options);
        let measured = ferrotron_bench::peak::measure_device_peak(&*gpu[0], n, 9);
        println!(
            "{name}: {what} GEMM (cuBLASLt, {n}³) {:.1} TFLOP/s",
            measured.unwrap_or(0.0) / 1e12
        );
    }
    for (preset, mut c) in [
        (
            "medium",
            ferrotron_bench::presets::preset("medium").expect("medium"),
        ),
        ("1b", llama_1b()),
        (
            "1b, attention as TF32 products",
            products_attention(llama_1b(), true),
        ),
    ] {
        c.train.grad_accum = 1;
        let gpu = gpu_ranks_with(1, CudaOptions::of(&c));
        let p = ferrotron_bench::profile::profile_on(c, gpu[0].clone(), 1, 2, (peak, 4.3e12))
            .unwrap_or_else(|e| panic!("{preset}: {e}"));
        println!("{preset} on {name}:\n{}", p.table());
        assert!(
            p.step_seconds > 0.0 && p.mfu > 0.0,
            "{preset}: an empty profile"
        );
    }
}

/// `c` with attention as batched products (`train.attention = "products"`), their sums in
/// TF32 when `tf32` (with bf16 products, TF32 changes only attention's products).
fn products_attention(mut c: Config, tf32: bool) -> Config {
    c.train.attention = ferrotron_config::Attention::Products;
    (c.train.tf32, c.train.device) = (tf32, ferrotron_config::Device::Cuda);
    c
}

/// Dense bf16 tensor-core peak of the GPU named `name`, FLOP/s (vendor figures).
fn bf16_dense_peak(name: &str) -> Option<f64> {
    [
        ("H200", 989e12),
        ("H100", 989e12),
        ("A100", 312e12),
        ("L40S", 362e12),
    ]
    .iter()
    .find(|(n, _)| name.contains(n))
    .map(|(_, p)| *p)
}

fn llama_1b() -> Config {
    let mut c = ferrotron_bench::presets::preset("medium").expect("medium");
    (
        c.model.hidden,
        c.model.layers,
        c.model.heads,
        c.model.kv_heads,
    ) = (2048, 16, 32, 8);
    (c.model.ffn, c.model.vocab, c.model.seq_len) = (8192, 32000, 2048);
    c.model.tie_embeddings = true;
    c.train.micro_batch = 4;
    c.train.dtype = DType::Bf16;
    c.train.matmul = ferrotron_config::Matmul::Bf16;
    c
}
