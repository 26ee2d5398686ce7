//! Hardware profiles as the planner uses them on this machine: the built-in ones, TOML
//! files, and `cpu-local` completed by what this machine measured (peak, kernel times,
//! collectives); and the planner's search, timing the ranked layouts' kernels as it goes.

use std::path::Path;

use ferrotron_plan::{
    plan_with, Hardware, Job, ModelSpec, Plan, PlanOptions, PlanRequest, Verdict,
};

use crate::BenchError;

/// The model `spec` names: a preset (llama3-1b, llama3-8b, mixtral-8x7b, tiny, …) or a TOML
/// run configuration whose `[model]` section gives the shape.
///
/// # Errors
///
/// [`BenchError::Plan`]: an unknown preset, or a configuration that does not read.
pub fn load_model(spec: &str) -> Result<ModelSpec, BenchError> {
    let path = Path::new(spec);
    if spec.ends_with(".toml") || path.is_file() {
        return Ok(Job::load(Some(path), &[], None)?.model);
    }
    Ok(ModelSpec::preset(spec)?)
}

/// A built-in profile or a TOML file. For `cpu-local` the per-rank peak comes from
/// `ferrotron bench`'s cache (one thread per rank), and the collectives' bus bandwidth and
/// latency from `ferrotron bench-comm`'s (threads backend, as many ranks as the profile's
/// node), when they have them.
///
/// Returns the profile and one note per measured figure it took.
///
/// # Errors
///
/// [`BenchError::Io`] for a profile file that does not read, [`BenchError::Plan`] for an
/// unknown profile or invalid figures.
pub fn load_hardware(spec: &str) -> Result<(Hardware, Vec<String>), BenchError> {
    if spec.ends_with(".toml") {
        let text = std::fs::read_to_string(spec).map_err(|source| BenchError::Io {
            action: "read",
            path: spec.into(),
            source,
        })?;
        return Ok((Hardware::from_toml(&text)?, Vec::new()));
    }
    let mut hw = Hardware::builtin(spec)?;
    let mut notes = Vec::new();
    if hw.name == "cpu-local" {
        measured_cpu(&mut hw, &mut notes);
        measured_comm(&mut hw, &mut notes);
    }
    hw.validate()?;
    Ok((hw, notes))
}

/// `cpu-local`'s peak and kernel times from this machine's caches (`ferrotron bench`,
/// `validate-cost`), where measured.
fn measured_cpu(hw: &mut Hardware, notes: &mut Vec<String>) {
    if let Some(flops) = crate::peak::cached_peak(1) {
        hw.peak_tflops = flops / 1e12;
        notes.push(format!(
            "peak {:.1} GFLOP/s per rank: measured by `ferrotron bench` (1 thread)",
            flops / 1e9
        ));
    }
    // This engine's kernels, timed on this machine (1 thread per rank): the cost model
    // of `validate-cost`; shapes never measured are timed at the peak.
    let mut kernels = crate::kernel_times::cached(1, hw.gpus_per_node).unwrap_or_default();
    kernels.threads = 1;
    kernels.cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    kernels.peak_flops = hw.peak_flops();
    notes.push(format!(
        "kernels: {} GEMM and {} attention shapes timed before on this machine (1 thread per rank); the ranked layouts' others are timed now",
        kernels.gemm.len(),
        kernels.attention.len()
    ));
    if kernels.bandwidth <= 0.0 {
        kernels.bandwidth = crate::profile::measure_bandwidth(5);
    }
    hw.kernels = Some(kernels);
}

/// `cpu-local`'s collectives from `ferrotron bench-comm`'s cache, where measured and usable.
fn measured_comm(hw: &mut Hardware, notes: &mut Vec<String>) {
    let cached = crate::comm_cache::cached(hw.gpus_per_node);
    let usable = |m: &crate::comm_cache::MeasuredComm| {
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
            crate::comm_cache::cache_path()
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

/// The planner's ranked layouts for `req`; on a machine whose kernels are timed
/// (`cpu-local`), the kernels of the ranked layouts' shapes not timed before are timed now
/// and the layouts ranked again, until all are timed (at most 3 rounds). `timing` is called
/// before each round of timing (e.g. to say so).
///
/// # Errors
///
/// [`BenchError::Plan`] when no layout can be planned, and the errors of
/// [`crate::kernel_times::kernel_times`].
pub fn plan_measured(
    req: &mut PlanRequest,
    opts: &PlanOptions,
    timing: impl Fn(),
) -> Result<Plan, BenchError> {
    let mut plan = plan_with(req, opts);
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
        let needs = crate::kernel_times::measurable(needs);
        if k.missing(&needs) == 0 {
            break;
        }
        timing();
        let ranks = req.hardware.gpus_per_node;
        let mut timed = crate::kernel_times::kernel_times(&needs, k.threads, ranks, false)?;
        timed.peak_flops = k.peak_flops;
        req.hardware.kernels = Some(timed);
        plan = plan_with(req, opts);
    }
    Ok(plan?)
}
