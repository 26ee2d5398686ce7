//! `ferrotron`: train, evaluate, prepare data and benchmark Llama models.

mod bench;
mod bench_comm;
mod bench_pipeline;
mod convert;
mod device;
mod estimate;
mod eval;
mod generate;
mod kernel_times;
mod mpi;
mod plan;
mod plots;
mod prepare;
mod run_lock;
mod sweep;
mod train;
mod validate_cost;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferrotron",
    version,
    about = "Train Llama models with 5D parallelism, from a laptop to a cluster"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no config: the built-in tiny Llama on the embedded synthetic corpus).
    Train(train::TrainArgs),
    /// Checkpoint → Hugging Face model directory, or Hugging Face directory → checkpoint.
    Convert(convert::ConvertArgs),
    /// Mean next-token loss of a Hugging Face model directory on a token file, as JSON.
    Eval(eval::EvalArgs),
    /// Continue a prompt with a model directory, token by token (greedy or sampled).
    Generate(generate::GenerateArgs),
    /// Turn text or JSON-lines into a token file.
    PrepareData(prepare::PrepareArgs),
    /// Memory of every rank of a configuration per category, from arithmetic alone.
    Estimate(estimate::EstimateArgs),
    /// The best layouts for a model on a cluster, with predicted memory and throughput.
    Plan(plan::PlanArgs),
    /// Train every layout of a grid one after another; results in sweep.csv and sweep.svg.
    Sweep(sweep::SweepArgs),
    /// Measure the matmul peak (cached for MFU) and training throughput.
    Bench(bench::BenchArgs),
    /// Measure collective bandwidth (nccl-tests' bus bandwidth), 1 KiB to 256 MiB.
    BenchComm(bench_comm::BenchCommArgs),
    /// Measure each pipeline rank's idle time per schedule against theory.
    BenchPipeline(bench_pipeline::BenchPipelineArgs),
    /// Train layouts on this machine and compare their speed with the cost model's
    /// prediction (the model `plan --hardware cpu-local` uses).
    ValidateCost(validate_cost::ValidateCostArgs),
}

/// Keeps freed buffers in the heap instead of returning them to the kernel. A training step
/// frees and reallocates the same activation and workspace sizes every micro-batch; with
/// glibc's defaults each large buffer is a fresh `mmap`, and touching it again costs a page
/// fault per 4 KiB (measured: 1.35 M faults and 15 s of system time in 3 steps of the medium
/// benchmark). 32 MiB is the largest mmap threshold glibc accepts.
///
/// One heap (arena) for every thread: a step runs on pool threads, and glibc gives each
/// thread its own arena, whose 64 MiB heaps it unmaps when they empty and maps again on the
/// next allocation (measured on the medium preset: about 200 such maps per step, the page
/// faults growing with the steps, and a peak RSS 24% above the ledger's peak, from freed
/// memory held in one arena while another grows). With one arena the faults are start-up's
/// only, and the peak RSS is the ledger's plus 2%.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters; called before any threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

fn main() -> anyhow::Result<()> {
    keep_freed_memory();
    match Cli::parse().command {
        Command::Train(a) => train::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Generate(a) => generate::run(a),
        Command::PrepareData(a) => prepare::run(a),
        Command::Estimate(a) => estimate::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Sweep(a) => sweep::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchComm(a) => bench_comm::run(a),
        Command::ValidateCost(a) => validate_cost::run(a),
        Command::BenchPipeline(a) => bench_pipeline::run(a),
    }
}
