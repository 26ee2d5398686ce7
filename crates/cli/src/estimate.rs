//! `ferrotron estimate`: the memory of every rank of a configuration, before running it.

use std::path::PathBuf;

use ferrotron_plan::units::{self, ByteUnit};
use ferrotron_plan::{estimate_with, Assumptions, Category, Estimate, Job, GIB};

/// Arguments of `estimate`.
#[derive(clap::Args)]
pub struct EstimateArgs {
    /// TOML configuration file (defaults for every missing key). Besides the keys `train`
    /// accepts, it reads `parallel.{tp, pp, cp, ep, pp_schedule, virtual_stages,
    /// sequence_parallel, recompute}` and `model.{experts, top_k, moe_every}`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a configuration value, e.g. `--set parallel.tp=8` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Model preset as the base of the `[model]` section (llama3-1b, llama3-3b, llama3-8b,
    /// llama3-70b, llama3-405b, mixtral-8x7b, tiny); the file's keys and `--set` apply on top.
    #[arg(long)]
    preset: Option<String>,
    /// Device memory in GiB: say whether the peak rank fits.
    #[arg(long, value_name = "GIB")]
    device_memory_gib: Option<f64>,
    /// Count activations with the playbook's formula `s·b·h·(34 + 5·a·s/h)` per layer instead
    /// of what the engine saves.
    #[arg(long)]
    playbook: bool,
    /// Print the estimate as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: EstimateArgs) -> anyhow::Result<()> {
    let job = Job::load(args.config.as_deref(), &args.set, args.preset.as_deref())?;
    let assumptions = if args.playbook {
        Assumptions::playbook()
    } else {
        Assumptions::default()
    };
    let est = estimate_with(&job, &assumptions)?;
    let device = match args.device_memory_gib {
        Some(g) if g.is_finite() && g > 0.0 => Some((g * GIB) as u64),
        Some(g) => anyhow::bail!("--device-memory-gib must be positive, got {g}"),
        None => None,
    };
    let fits = device.map(|d| est.fits(d));
    if args.json {
        let mut value = serde_json::to_value(&est)?;
        if let Some(obj) = value.as_object_mut() {
            obj.insert("total".into(), est.total().into());
            obj.insert("device_memory_bytes".into(), device.into());
            obj.insert("fits".into(), fits.into());
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    print_human(&job, &est, device);
    Ok(())
}

/// `bytes` in `unit`, right-aligned with the unit's name.
fn show(unit: ByteUnit, bytes: u64) -> String {
    format!("{:>9} {}", unit.value(bytes, 2), unit.name)
}

fn print_human(job: &Job, est: &Estimate, device: Option<u64>) {
    let l = &job.layout;
    let c = &job.model.config;
    println!(
        "{}: {} parameters, {}: {}, {:?}, seq {}",
        est.model,
        units::count(est.params),
        units::plural(est.ranks, "rank"),
        l.describe(),
        l.dtype,
        c.seq_len
    );
    let peak = &est.stages[est.peak_stage];
    let unit = ByteUnit::for_largest(est.total());
    println!(
        "peak rank: pipeline stage {} of {} ({} blocks, {:.2} micro-batches of activations in flight)",
        est.peak_stage,
        est.stages.len(),
        peak.layers,
        peak.micro_batches_in_flight
    );
    for cat in Category::ALL {
        // A background checkpoint's snapshot only where `checkpoint.async` holds one.
        if cat == Category::Checkpoint && est.memory.get(cat) == 0 {
            continue;
        }
        let rough = matches!(cat, Category::Communication | Category::Workspace);
        println!(
            "  {:<14}{}{}",
            cat.name(),
            show(unit, est.memory.get(cat)),
            if rough { "  (rough)" } else { "" }
        );
    }
    println!("  {:<14}{}", "total", show(unit, est.total()));
    println!("dominant: {}", est.dominant.name());
    if let Some(d) = device {
        let used = 100.0 * est.total() as f64 / d as f64;
        let verdict = if est.fits(d) { "fits" } else { "does NOT fit" };
        println!("{verdict} in {:.1} GiB ({used:.0}% used)", d as f64 / GIB);
    }
    if est.stages.len() > 1 {
        println!("per stage (total): ");
        for s in &est.stages {
            println!(
                "  stage {:>3}: {:>3} blocks {}",
                s.stage,
                s.layers,
                show(unit, s.memory.total())
            );
        }
    }
    println!(
        "before the first step a fresh initialisation uses {:.0} KiB of workspace",
        est.init_workspace as f64 / 1024.0
    );
    for n in &est.notes {
        println!("note: {n}");
    }
}
