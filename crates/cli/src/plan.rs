//! `ferrotron plan`: the best layouts of a model on a cluster, with their predicted memory
//! and throughput, and why the close alternatives lost.

use std::path::Path;

use anyhow::Context;
use ferrotron_plan::units::{self, ByteUnit};
use ferrotron_plan::{
    plan_with, ActivationModel, Candidate, Hardware, Job, ModelSpec, Plan, PlanOptions,
    PlanRequest, ShapeFilter, Verdict, GIB,
};

/// Arguments of `plan`.
#[derive(clap::Args)]
pub struct PlanArgs {
    /// A model preset (llama3-1b, llama3-3b, llama3-8b, llama3-70b, llama3-405b,
    /// mixtral-8x7b, tiny) or a TOML run configuration whose `[model]` section (plus
    /// `experts`, `top_k`, `moe_every`) gives the shape.
    #[arg(long)]
    model: String,
    /// Devices.
    #[arg(long)]
    gpus: usize,
    /// Hardware profile (h100, h200, a100, cpu-local) or a TOML profile file.
    #[arg(long, default_value = "h100")]
    hardware: String,
    /// Sequence length.
    #[arg(long, default_value_t = 4096)]
    seq: usize,
    /// Tokens per optimizer step (a multiple of --seq).
    #[arg(long)]
    global_batch_tokens: usize,
    /// Layouts to show.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Fix the data-parallel degree.
    #[arg(long)]
    dp: Option<usize>,
    /// Fix the tensor-parallel degree.
    #[arg(long)]
    tp: Option<usize>,
    /// Fix the pipeline stages.
    #[arg(long)]
    pp: Option<usize>,
    /// Fix the context-parallel degree.
    #[arg(long)]
    cp: Option<usize>,
    /// Fix the expert-parallel degree.
    #[arg(long)]
    ep: Option<usize>,
    /// Fix the ZeRO stage.
    #[arg(long)]
    zero: Option<u8>,
    /// Fraction of device memory a step may use.
    #[arg(long, default_value_t = 0.9)]
    usable_memory: f64,
    /// Fraction of the peak the kernels reach (default: the calibrated constant).
    #[arg(long)]
    kernel_efficiency: Option<f64>,
    /// Count activations with the playbook's formula instead of what the engine saves.
    #[arg(long)]
    playbook: bool,
    /// Predict what the playbook's measurements ran on (nanotron: fp32 gradients reduced
    /// from bucket hooks during the last backward, ZeRO-0/1, AFAB/1F1B, no CP, 0.11 s of
    /// host time per step) instead of this engine.
    #[arg(long)]
    as_measured: bool,
    /// Fixed host time per step in milliseconds, whatever the layout (default: 0, or the
    /// calibrated 110 with --as-measured). Measure yours as a step's time minus its kernels.
    #[arg(long)]
    step_overhead_ms: Option<f64>,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

fn load_model(spec: &str) -> anyhow::Result<ModelSpec> {
    let path = Path::new(spec);
    if spec.ends_with(".toml") || path.is_file() {
        let job = Job::load(Some(path), &[], None)
            .with_context(|| format!("reading the model of {}", path.display()))?;
        return Ok(job.model);
    }
    Ok(ModelSpec::preset(spec)?)
}

/// A built-in profile or a TOML file. For `cpu-local` the per-rank peak comes from
/// `ferrotron bench`'s cache (one thread per rank), and the collectives' bus bandwidth and
/// latency from `ferrotron bench-comm`'s (threads backend, as many ranks as the profile's
/// node), when they have them.
pub(crate) fn load_hardware(spec: &str) -> anyhow::Result<(Hardware, Vec<String>)> {
    if spec.ends_with(".toml") {
        let text = std::fs::read_to_string(spec).with_context(|| format!("reading {spec}"))?;
        return Ok((Hardware::from_toml(&text)?, Vec::new()));
    }
    let mut hw = Hardware::builtin(spec)?;
    let mut notes = Vec::new();
    if hw.name == "cpu-local" {
        if let Some(flops) = ferrotron_train::peak::cached_peak(1) {
            hw.peak_tflops = flops / 1e12;
            notes.push(format!(
                "peak {:.1} GFLOP/s per rank: measured by `ferrotron bench` (1 thread)",
                flops / 1e9
            ));
        }
        // This engine's kernels, timed on this machine (1 thread per rank): the cost model
        // of `validate-cost`; shapes never measured are timed at the peak.
        let mut kernels =
            ferrotron_bench::kernel_times::cached(1, hw.gpus_per_node).unwrap_or_default();
        kernels.threads = 1;
        kernels.cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        kernels.peak_flops = hw.peak_flops();
        notes.push(format!(
            "kernels: {} GEMM and {} attention shapes timed before on this machine (1 thread per rank); the ranked layouts' others are timed now",
            kernels.gemm.len(),
            kernels.attention.len()
        ));
        if kernels.bandwidth <= 0.0 {
            kernels.bandwidth = ferrotron_train::profile::measure_bandwidth(5);
        }
        hw.kernels = Some(kernels);
        let cached = ferrotron_bench::comm_cache::cached(hw.gpus_per_node);
        let usable = |m: &ferrotron_bench::comm_cache::MeasuredComm| {
            [
                m.all_reduce_gbps,
                m.all_gather_gbps,
                m.reduce_scatter_gbps,
                m.all_to_all_gbps,
                m.broadcast_gbps,
            ]
            .iter()
            .all(|b| b.is_finite() && *b > 0.0)
                && m.latency_us.is_finite()
                && m.latency_us >= 0.0
        };
        if let Some(m) = cached.as_ref().filter(|m| !usable(m)) {
            notes.push(format!(
                "ignored the cached collectives in {} (a bandwidth is not positive: {m:?}); rerun `ferrotron bench-comm --ranks {}`",
                ferrotron_bench::comm_cache::cache_path()
                    .map_or("the cache".into(), |p| p.display().to_string()),
                hw.gpus_per_node
            ));
        }
        if let Some(m) = cached.filter(usable) {
            let bw = &mut hw.bus_bandwidth;
            bw.nodes = vec![1];
            bw.all_reduce = vec![m.all_reduce_gbps];
            bw.all_gather = vec![m.all_gather_gbps];
            bw.reduce_scatter = vec![m.reduce_scatter_gbps];
            bw.all_to_all = vec![m.all_to_all_gbps];
            hw.p2p.intra = m.broadcast_gbps;
            hw.p2p.inter = m.broadcast_gbps;
            if m.latency_us > 0.0 {
                hw.latency.intra_us = m.latency_us;
                hw.latency.inter_us = m.latency_us;
            }
            notes.push(format!(
                "bus bandwidth (GB/s) all-reduce {:.2}, all-gather {:.2}, reduce-scatter {:.2}, all-to-all {:.2}, send {:.2}, latency {:.0} µs: measured by `ferrotron bench-comm` ({} ranks, {} MiB)",
                m.all_reduce_gbps,
                m.all_gather_gbps,
                m.reduce_scatter_gbps,
                m.all_to_all_gbps,
                m.broadcast_gbps,
                m.latency_us,
                m.ranks,
                m.bytes >> 20
            ));
        }
    }
    hw.validate()?;
    Ok((hw, notes))
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let model = load_model(&args.model)?;
    let (hardware, measured_notes) = load_hardware(&args.hardware)?;
    let opts = options(&args)?;
    let mut req = PlanRequest {
        model,
        gpus: args.gpus,
        hardware,
        seq: args.seq,
        global_batch_tokens: args.global_batch_tokens,
    };
    let plan = search(&mut req, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    print_plan(&plan, &req, &opts, &measured_notes);
    Ok(())
}

/// The planner's options from the arguments: the playbook's or this engine's system, the
/// degrees fixed, the cost model's overrides.
fn options(args: &PlanArgs) -> anyhow::Result<PlanOptions> {
    let base = if args.as_measured {
        PlanOptions::playbook_measured()
    } else {
        PlanOptions::default()
    };
    let mut opts = PlanOptions {
        top: args.top.max(1),
        usable_memory: args.usable_memory,
        only: ShapeFilter {
            dp: args.dp,
            tp: args.tp,
            pp: args.pp,
            cp: args.cp,
            ep: args.ep,
            zero: args.zero,
            schedule: None,
        },
        ..base
    };
    if args.as_measured && args.cp.is_none() {
        opts.only.cp = Some(1);
    }
    if let Some(e) = args.kernel_efficiency {
        opts.cost.kernel_efficiency = e;
    }
    if let Some(ms) = args.step_overhead_ms {
        anyhow::ensure!(
            ms.is_finite() && ms >= 0.0,
            "--step-overhead-ms must be a finite number of milliseconds, 0 or more (got {ms})"
        );
        opts.cost.step_overhead_s = ms / 1e3;
    }
    if args.playbook {
        opts.assumptions.activations = ActivationModel::Korthikanti;
    }
    Ok(opts)
}

/// The ranked layouts, behind a spinner; on a machine whose kernels are timed, the kernels
/// of the ranked layouts' shapes are timed too and the layouts ranked again.
fn search(req: &mut PlanRequest, opts: &PlanOptions) -> anyhow::Result<Plan> {
    // The search takes about a second even for thousands of GPUs; the spinner shows it is
    // working and for how long.
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} planning {msg} [{elapsed_precise}]")
            .expect("valid template"),
    );
    bar.set_message(format!("{} GPUs", req.gpus));
    bar.enable_steady_tick(std::time::Duration::from_millis(100));
    let mut plan = plan_with(req, opts);
    // On this machine, time the kernels of the layouts it ranks (shapes not timed before),
    // then rank again, until the ranked layouts' shapes are all timed (at most 3 rounds).
    for _ in 0..3 {
        let (Ok(p), Some(k)) = (&plan, &req.hardware.kernels) else {
            break;
        };
        let mut needs = ferrotron_plan::cpu_kernels::Needs::default();
        let ranked = p
            .candidates
            .iter()
            .filter(|c| matches!(c.verdict, Verdict::Best | Verdict::Slower { .. }));
        for c in ranked {
            let mut model = req.model.clone();
            model.config.seq_len = req.seq;
            needs.merge(ferrotron_plan::cpu_kernels::kernel_needs(&model, &c.layout));
        }
        let needs = ferrotron_bench::kernel_times::measurable(needs);
        if k.missing(&needs) == 0 {
            break;
        }
        bar.set_message(format!("{} GPUs: timing kernels", req.gpus));
        let ranks = req.hardware.gpus_per_node;
        let mut timed =
            ferrotron_bench::kernel_times::kernel_times(&needs, k.threads, ranks, false)?;
        timed.peak_flops = k.peak_flops;
        req.hardware.kernels = Some(timed);
        plan = plan_with(req, opts);
    }
    bar.finish_and_clear();
    Ok(plan?)
}

/// The plan as text: the request, what was considered, the candidates, and the best one's
/// breakdown and overrides.
fn print_plan(plan: &Plan, req: &PlanRequest, opts: &PlanOptions, measured_notes: &[String]) {
    let hw = &req.hardware;
    println!(
        "{} ({} parameters) on {} × {} ({} per node, {:.1} of {:.1} GiB usable), seq {}, {} tokens per step",
        plan.model,
        units::count(plan.params),
        plan.gpus,
        hw.name,
        hw.gpus_per_node,
        plan.usable_bytes as f64 / GIB,
        hw.memory_gib,
        plan.seq,
        plan.global_batch_tokens
    );
    println!(
        "{} layouts considered, {} fit and reach the batch; MFU counts attention over the full s×s matrix (nanotron), {}",
        plan.considered,
        plan.fitting,
        match &hw.kernels {
            Some(_) => "kernels timed on this machine".to_string(),
            None => format!("kernels at {:.0}% of peak", 100.0 * opts.cost.kernel_efficiency),
        }
    );
    if opts.engine_only {
        println!(
            "only layouts this engine runs: no pipeline with tied embeddings, ZeRO ≤ 1 with a pipeline{} (--as-measured plans the playbook's system)",
            if plan.refused > 0 {
                format!("; {} of the layouts considered refused by its validation", plan.refused)
            } else {
                String::new()
            }
        );
    }
    for n in measured_notes {
        println!("{n}");
    }
    if plan.fitting == 0 {
        println!("no layout fits and reaches the batch; the closest alternatives:");
    }
    for c in &plan.candidates {
        println!("  {}", c.summary());
    }
    if let Some(best) = plan.candidates.first().filter(|_| plan.fitting > 0) {
        print_breakdown(best);
        let mut model = req.model.clone();
        model.config.seq_len = req.seq;
        let job = Job {
            model,
            layout: best.layout.clone(),
        };
        let sets: Vec<String> = job
            .overrides()
            .iter()
            .map(|o| format!("--set {}", shell_word(o)))
            .collect();
        println!("as overrides: {}", sets.join(" "));
    }
}

/// `word` as one shell word: in single quotes where it holds anything but letters, digits
/// and `_-.=/,:+` (a list's brackets and spaces, say), so the line pastes as it reads.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-.=/,:+".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

fn print_breakdown(best: &Candidate) {
    let c = &best.cost;
    let s = units::seconds;
    println!(
        "best: {} per step = {} compute + {} pipeline bubble + {} exposed communication + {} host",
        s(c.step_s),
        s(c.compute_s),
        s(c.bubble_s),
        s(c.exposed_comm_s),
        s(c.host_s)
    );
    for x in &c.comm {
        println!(
            "  {:<16} {:>9.3} GB moved, {} busy, {} exposed",
            format!("{:?}", x.kind),
            x.bytes / 1e9,
            s(x.seconds),
            s(x.exposed_s)
        );
    }
    let m = &best.memory;
    let all = [
        m.weights,
        m.gradients,
        m.optimizer,
        m.activations,
        m.communication,
        m.workspace,
    ];
    let unit = ByteUnit::for_largest(all.into_iter().max().unwrap_or(0));
    let v = |b: u64| unit.value(b, 1);
    println!(
        "  memory of the peak rank (stage {}): weights {}, gradients {}, optimizer {}, activations {}, communication {}, workspace {} {}",
        best.peak_stage,
        v(m.weights),
        v(m.gradients),
        v(m.optimizer),
        v(m.activations),
        v(m.communication),
        v(m.workspace),
        unit.name
    );
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn overrides_paste_into_a_shell_as_one_word_each() {
        assert_eq!(shell_word("parallel.dp=8"), "parallel.dp=8");
        assert_eq!(
            shell_word("parallel.pp_layers=[11, 10]"),
            "'parallel.pp_layers=[11, 10]'"
        );
        assert_eq!(shell_word("run.dir=it's"), "'run.dir=it'\\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
