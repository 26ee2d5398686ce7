//! `ferrotron`: train, evaluate, prepare data and benchmark Llama models.

mod bench;
mod bench_comm;
mod eval;
mod mpi;
mod prepare;
mod train;

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
    /// Mean next-token loss of a Hugging Face model directory on a token file, as JSON.
    Eval(eval::EvalArgs),
    /// Turn text or JSON-lines into a token file.
    PrepareData(prepare::PrepareArgs),
    /// Measure the matmul peak (cached for MFU) and training throughput.
    Bench(bench::BenchArgs),
    /// Measure collective bandwidth (nccl-tests' bus bandwidth), 1 KiB to 256 MiB.
    BenchComm(bench_comm::BenchCommArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Train(a) => train::run(a),
        Command::Eval(a) => eval::run(a),
        Command::PrepareData(a) => prepare::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchComm(a) => bench_comm::run(a),
    }
}
