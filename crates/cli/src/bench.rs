//! `ferrotron bench`: the matmul peak (cached as the MFU denominator) and training
//! throughput of the preset models, each preset in its own process so its peak RSS is its own.

use std::process::Command;

use ferrotron_bench::peak;
use ferrotron_bench::presets::{
    measure_peak, profile_preset, run_preset, Host, PresetResult, PRESETS,
};
use ferrotron_bench::profile::StepProfile;
use ferrotron_config::{DType, Matmul};

/// Arguments of `bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Thread counts to measure, comma separated.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    threads: Vec<usize>,
    /// Presets to train, comma separated (tiny, small, medium); empty = peak only.
    #[arg(long, default_value = "tiny,small,medium", value_delimiter = ',')]
    configs: Vec<String>,
    /// Timed steps per preset (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Instead of throughput, print each preset's step profile: time per kernel class
    /// (GEMMs by shape, attention, norms, …) against the measured GEMM peak and memory
    /// bandwidth of the thread count.
    #[arg(long)]
    profile: bool,
    /// The host's matmul library for the linear layers' products: `gemm` or `openblas`
    /// (`train.matmul`).
    #[arg(long, default_value = "gemm", value_parser = parse_matmul)]
    matmul: Matmul,
    /// Storage precision of the runs (`train.dtype`): `f32` or `bf16` (`--matmul bf16`
    /// needs `bf16`). MFU stays against the f32 peak.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: DType,
    /// Internal: run one preset in this process and print its result as JSON.
    #[arg(long, hide = true)]
    one: Option<String>,
}

/// `--matmul`'s value, as `train.matmul` spells it.
fn parse_matmul(s: &str) -> Result<Matmul, String> {
    [Matmul::Gemm, Matmul::OpenBlas, Matmul::Bf16]
        .into_iter()
        .find(|m| m.name() == s)
        .ok_or_else(|| format!("`{s}`: use gemm, openblas or bf16"))
}

/// `--dtype`'s value, as `train.dtype` spells it.
fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::Bf16),
        _ => Err(format!("`{s}`: use f32 or bf16")),
    }
}

/// `args`' host with `threads` threads.
fn host(args: &BenchArgs, threads: usize) -> Host {
    Host {
        threads,
        matmul: args.matmul,
        dtype: args.dtype,
    }
}

/// `ferrotron bench`: the matmul peaks, then each preset's throughput (or step profile)
/// on each thread count, each in a process of its own.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.steps >= 1, "--steps {}: time at least 1 step", a.steps);
    // --matmul and --dtype checked together before any work (bf16 products need bf16).
    host(&a, 0).preset(PRESETS[0])?.validate()?;
    if let (Some(name), true) = (&a.one, a.profile) {
        let threads = *a.threads.first().unwrap_or(&0);
        let p = profile_preset(name, host(&a, threads), a.steps)?;
        println!("{}", serde_json::to_string(&p)?);
        return Ok(());
    }
    if let Some(name) = &a.one {
        let threads = *a.threads.first().unwrap_or(&0);
        println!(
            "{}",
            serde_json::to_string(&run_preset(name, host(&a, threads), a.steps)?)?
        );
        return Ok(());
    }
    if a.profile {
        return profile_presets(&a);
    }
    measure_peaks(&a.threads, peak::Products::F32)?;
    if a.matmul == Matmul::Bf16 {
        measure_peaks(&a.threads, peak::Products::Bf16)?;
    }
    let configs: Vec<&String> = a.configs.iter().filter(|c| !c.is_empty()).collect();
    if configs.is_empty() {
        return Ok(());
    }
    let matmul = ferrotron_train::trainer::matmul_description(a.matmul)?;
    println!("\nlinear layers on {matmul}");
    println!("\n| config | threads | params | tokens/s | MFU | peak RSS (MiB) |\n|---|---|---|---|---|---|");
    let exe = std::env::current_exe()?;
    for name in configs {
        anyhow::ensure!(
            PRESETS.contains(&name.as_str()),
            "unknown preset `{name}`: use tiny, small or medium"
        );
        for &t in &a.threads {
            let r: PresetResult = child(&exe, name, host(&a, t), a.steps, false)?;
            println!(
                "| {} | {} | {:.1}M | {:.0} | {:.1}% | {:.0} |",
                r.config,
                r.threads,
                r.params as f64 / 1e6,
                r.tokens_per_s,
                r.mfu * 100.0,
                r.peak_rss_mib
            );
        }
    }
    println!("\nMFU: model FLOPs per token (attention over the full s × s matrix, as nanotron and Megatron-LM count it) × tokens/s ÷ the cached matmul peak of the same thread count and products (f32; the bf16 products' own with --matmul bf16) (the best quiet measurement, which the lines above may have replaced; measured by the preset's process when none is cached).");
    Ok(())
}

/// Runs preset `name` on `threads` threads in a child process of `exe` (`bench --one`, with
/// `--profile` when `profile`), so that its peak RSS is its own; its JSON result.
fn child<T: serde::de::DeserializeOwned>(
    exe: &std::path::Path,
    name: &str,
    host: Host,
    steps: usize,
    profile: bool,
) -> anyhow::Result<T> {
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "--one", name]);
    if profile {
        cmd.arg("--profile");
    }
    let out = cmd
        .args([
            "--threads",
            &host.threads.to_string(),
            "--steps",
            &steps.to_string(),
            "--matmul",
            host.matmul.name(),
            "--dtype",
            host.dtype.name(),
        ])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "bench of {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Measures the matmul peak of `products` for each thread count, caching the quiet ones.
fn measure_peaks(threads: &[usize], products: peak::Products) -> anyhow::Result<()> {
    for &t in threads {
        let p = measure_peak(t, products)?;
        println!(
            "matmul peak ({} {n}×{n}×{n}): {:.1} GFLOP/s with {} threads, {} — {}",
            match products {
                peak::Products::F32 => "f32 gemm",
                peak::Products::Bf16 => "bf16 products",
            },
            p.measurement.gflops,
            p.threads,
            p.measurement.describe(),
            p.verdict(),
            n = peak::PEAK_SIZE
        );
    }
    Ok(())
}

/// `bench --profile`: each preset's step profile, each in its own process.
fn profile_presets(a: &BenchArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let matmul = ferrotron_train::trainer::matmul_description(a.matmul)?;
    println!("linear layers on {matmul}");
    for name in a.configs.iter().filter(|c| !c.is_empty()) {
        anyhow::ensure!(
            PRESETS.contains(&name.as_str()),
            "unknown preset `{name}`: use tiny, small or medium"
        );
        for &t in &a.threads {
            let p: StepProfile = child(&exe, name, host(a, t), a.steps, true)?;
            println!("\n### {name}\n\n{}", p.table());
        }
    }
    Ok(())
}
