//! `ferrotron bench`: the matmul peak (cached as the MFU denominator) and training
//! throughput of the preset models, each preset in its own process so its peak RSS is its own.

use std::process::Command;

use ferrotron_config::{DType, Matmul};
use ferrotron_train::bench::{peak_rss_bytes, preset, PRESETS};
use ferrotron_train::profile::{measure_bandwidth, profile, StepProfile};
use ferrotron_train::trainer::thread_pool;
use ferrotron_train::{mfu, peak, Trainer};
use serde::{Deserialize, Serialize};

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

/// What every preset of one `bench` runs on: compute threads, matmul library, precision.
#[derive(Clone, Copy)]
struct Host {
    threads: usize,
    matmul: Matmul,
    dtype: DType,
}

impl Host {
    /// `args`' settings with `threads` threads.
    fn of(args: &BenchArgs, threads: usize) -> Host {
        Host {
            threads,
            matmul: args.matmul,
            dtype: args.dtype,
        }
    }

    /// Preset `name` set up for this host: threads, library, precision.
    fn preset(&self, name: &str) -> anyhow::Result<ferrotron_config::Config> {
        let mut config = preset(name)
            .ok_or_else(|| anyhow::anyhow!("unknown preset `{name}`: use tiny, small or medium"))?;
        config.train.threads = self.threads;
        config.train.matmul = self.matmul;
        config.train.dtype = self.dtype;
        Ok(config)
    }
}

#[derive(Serialize, Deserialize)]
struct PresetResult {
    config: String,
    threads: usize,
    params: usize,
    tokens_per_s: f64,
    mfu: f64,
    peak_gflops: f64,
    peak_rss_mib: f64,
}

fn run_one(name: &str, host: Host, steps: usize) -> anyhow::Result<PresetResult> {
    let threads = host.threads;
    let mut config = host.preset(name)?;
    config.train.steps = steps + 1;
    let mut trainer = Trainer::new(config)?;
    // One rank of `threads` threads on this machine (one MFU definition: `mfu::Occupancy`).
    let occupancy = mfu::Occupancy {
        ranks: 1,
        threads_per_rank: threads,
        shared_host: true,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let (peak_threads, _) = occupancy.peak_shape();
    let products = peak::Products::of(host.matmul);
    let peak = match peak::cached_peak_of(peak_threads, products) {
        Some(p) => p,
        None => thread_pool(peak_threads)?.install(|| peak::measure_matmul_peak_of(products, 7)),
    };
    trainer.metrics.peak_flops = Some(peak);
    let stats = trainer.run(|_| {})?;
    let summary = trainer.summary(&stats, None);
    Ok(PresetResult {
        config: name.into(),
        threads,
        params: summary.params,
        tokens_per_s: summary.tokens_per_s,
        mfu: summary.mfu.unwrap_or(0.0),
        peak_gflops: peak / 1e9,
        peak_rss_mib: peak_rss_bytes().unwrap_or(0) as f64 / (1 << 20) as f64,
    })
}

/// The step profile of preset `name` on `threads` threads (after 2 warm-up steps).
fn profile_one(name: &str, host: Host, steps: usize) -> anyhow::Result<StepProfile> {
    let config = host.preset(name)?;
    let pool = thread_pool(host.threads)?;
    let limits = pool.install(|| {
        let products = peak::Products::of(host.matmul);
        let peak = peak::cached_peak_of(pool.current_num_threads(), products)
            .unwrap_or_else(|| peak::measure_matmul_peak_of(products, 7));
        (peak, measure_bandwidth(9))
    });
    Ok(profile(config, 2, steps, limits)?)
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.steps >= 1, "--steps {}: time at least 1 step", a.steps);
    // --matmul and --dtype checked together before any work (bf16 products need bf16).
    Host::of(&a, 0).preset(PRESETS[0])?.validate()?;
    if let (Some(name), true) = (&a.one, a.profile) {
        let threads = *a.threads.first().unwrap_or(&0);
        let p = profile_one(name, Host::of(&a, threads), a.steps)?;
        println!("{}", serde_json::to_string(&p)?);
        return Ok(());
    }
    if let Some(name) = &a.one {
        let threads = *a.threads.first().unwrap_or(&0);
        println!(
            "{}",
            serde_json::to_string(&run_one(name, Host::of(&a, threads), a.steps)?)?
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
            let r: PresetResult = child(&exe, name, Host::of(&a, t), a.steps, false)?;
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
        let pool = thread_pool(t)?;
        let threads = pool.current_num_threads();
        let m = pool.install(|| peak::measure_peak_of(products, 15));
        let verdict = match peak::store_peak_of(threads, products, m) {
            peak::Stored::Kept => "cached as the MFU denominator".to_string(),
            peak::Stored::BetterCached => format!(
                "a better quiet measurement stays cached ({:.1} GFLOP/s)",
                peak::cached_peak_of(threads, products).unwrap_or(0.0) / 1e9
            ),
            peak::Stored::NotQuiet => "NOT cached: other processes competed for the cores or the repeats disagree; rerun on a quiet machine".into(),
        };
        println!(
            "matmul peak ({} {n}×{n}×{n}): {:.1} GFLOP/s with {threads} threads, {} — {verdict}",
            match products {
                peak::Products::F32 => "f32 gemm",
                peak::Products::Bf16 => "bf16 products",
            },
            m.gflops,
            m.describe(),
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
            let p: StepProfile = child(&exe, name, Host::of(a, t), a.steps, true)?;
            println!("\n### {name}\n\n{}", p.table());
        }
    }
    Ok(())
}
