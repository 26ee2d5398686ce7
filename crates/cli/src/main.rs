//! `ferrotron`: train, evaluate, prepare data and benchmark Llama models.

mod bench;
mod bench_comm;
mod bench_pipeline;
mod convert;
mod device;
mod estimate;
mod eval;
mod generate;
mod plan;
mod prepare;
mod report_page;
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
    /// Turn text, JSON lines or Parquet (also .gz, .zst) into a token file.
    PrepareData(prepare::PrepareArgs),
    /// Memory of every rank of a configuration per category, from arithmetic alone.
    Estimate(estimate::EstimateArgs),
    /// The best layouts for a model on a cluster, with predicted memory and throughput.
    Plan(plan::PlanArgs),
    /// Train every layout of a grid one after another; results in sweep.csv and sweep.svg.
    Sweep(sweep::SweepArgs),
    /// One self-contained HTML page comparing runs and sweeps (loss, lr, tokens/s, MFU,
    /// memory, summaries, configuration differences, sweep grids).
    Report(report_page::ReportArgs),
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

/// The error as the user reads it: its message, then each cause the message does not
/// already quote. No backtrace, whatever `RUST_BACKTRACE` says: a user's error is not a
/// crash (a panic still prints its own).
fn report(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    let mut causes: Vec<String> = Vec::new();
    for cause in e.chain().skip(1).map(|c| c.to_string()) {
        if !out.contains(&cause) && !causes.iter().any(|c| c.contains(&cause)) {
            causes.push(cause);
        }
    }
    if !causes.is_empty() {
        out.push_str("\n\nCaused by:");
        for c in causes {
            out.push_str(&format!("\n    {c}"));
        }
    }
    out
}

fn main() -> std::process::ExitCode {
    keep_freed_memory();
    match run(Cli::parse().command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<ferrotron_engine::Interrupted>() {
            // Not a failure of ferrotron's: the run saved its state and says so.
            Some(stopped) => {
                eprintln!("{stopped}");
                std::process::ExitCode::from(stopped.exit_status())
            }
            None => {
                eprintln!("Error: {}", report(&e));
                std::process::ExitCode::FAILURE
            }
        },
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Train(a) => train::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Generate(a) => generate::run(a),
        Command::PrepareData(a) => prepare::run(a),
        Command::Estimate(a) => estimate::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Sweep(a) => sweep::run(a),
        Command::Report(a) => report_page::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchComm(a) => bench_comm::run(a),
        Command::ValidateCost(a) => validate_cost::run(a),
        Command::BenchPipeline(a) => bench_pipeline::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::report;
    use anyhow::Context;

    /// An error whose message quotes its source (as `thiserror`'s `{source}` does).
    #[derive(Debug)]
    struct Quoting(std::io::Error);

    impl std::fmt::Display for Quoting {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "config a.toml: {}", self.0)
        }
    }

    impl std::error::Error for Quoting {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn not_found() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "No such file")
    }

    #[test]
    fn a_cause_the_message_quotes_is_not_repeated() {
        let quoted = anyhow::Error::new(Quoting(not_found()));
        assert_eq!(report(&quoted), "config a.toml: No such file");
        let wrapped = Err::<(), _>(Quoting(not_found()))
            .context("loading the configuration")
            .unwrap_err();
        assert_eq!(
            report(&wrapped),
            "loading the configuration\n\nCaused by:\n    config a.toml: No such file"
        );
        let plain = Err::<(), _>(not_found())
            .context("config a.toml")
            .unwrap_err();
        assert_eq!(
            report(&plain),
            "config a.toml\n\nCaused by:\n    No such file"
        );
    }
}
