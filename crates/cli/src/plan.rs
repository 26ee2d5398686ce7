//! `ferrotron plan`: the best layouts of a model on a cluster, with their predicted memory
//! and throughput, and why the close alternatives lost.

use ferrotron_plan::units::{self, ByteUnit};
use ferrotron_plan::{
    ActivationModel, Candidate, Job, Plan, PlanOptions, PlanRequest, ShapeFilter, GIB,
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

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let model = ferrotron_bench::hardware::load_model(&args.model)?;
    let (hardware, measured_notes) = ferrotron_bench::hardware::load_hardware(&args.hardware)?;
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

/// The ranked layouts ([`ferrotron_bench::hardware::plan_measured`]), behind a spinner.
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
    let gpus = req.gpus;
    let plan = ferrotron_bench::hardware::plan_measured(req, opts, || {
        bar.set_message(format!("{gpus} GPUs: timing kernels"))
    });
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
            "only layouts this engine runs: tied embeddings pipelined only under DualPipeV, ZeRO ≤ 1 with a pipeline{} (--as-measured plans the playbook's system)",
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
