//! Trains the built-in tiny Llama from Rust and prints each step's metrics as it arrives:
//! the library call that `ferrotron train` is the command-line face of.
//!
//! ```sh
//! cargo run --release -p ferrotron-train --example train_from_rust
//! ```

use ferrotron_config::Config;
use ferrotron_train::Run;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The embedded default: the tiny Llama on the synthetic corpus; 60 steps on two ranks of
    // data parallelism, ranks as threads.
    let mut config = Config::default();
    config.train.steps = 60;
    config.parallel.dp = 2;
    let mut run = Run::new(config).start()?;
    for step in run.by_ref() {
        if step.step % 10 == 0 {
            println!(
                "step {:>3}  loss {:.4}  grad norm {:.3}  {:.0} tokens/s",
                step.step, step.loss, step.grad_norm, step.tokens_per_s
            );
        }
    }
    let summary = run.wait()?;
    println!(
        "{} steps: final loss {:.4}, tail loss {:.4}, {:.0} tokens/s (median)",
        summary.steps, summary.final_loss, summary.tail_loss, summary.tokens_per_s
    );
    Ok(())
}
