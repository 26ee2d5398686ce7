//! A full run from Rust, as `ferrotron train` makes it: a run directory with metrics,
//! checkpoints and `summary.json`, the MFU peak, the memory check; each step's metrics
//! printed as it arrives.
//!
//! ```sh
//! cargo run --release -p ferrotron-engine --example full_run
//! ```

use std::sync::Arc;

use ferrotron_engine::{start, Outcome, Stderr, TrainOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join("ferrotron-full-run");
    let options = TrainOptions {
        set: vec![
            "train.steps=40".into(),
            "parallel.dp=2".into(),
            "checkpoint.every=20".into(),
            format!("run.dir={:?}", dir.display().to_string()),
        ],
        // This example's directory holds only its own previous run.
        overwrite: true,
        ..TrainOptions::default()
    };
    let mut run = start(&options, Arc::new(Stderr))?;
    for step in run.by_ref() {
        if step.step % 10 == 0 {
            println!(
                "step {:>3}  loss {:.4}  {:.0} tokens/s  MFU {:.1}%",
                step.step,
                step.loss,
                step.tokens_per_s,
                100.0 * step.mfu.unwrap_or(0.0)
            );
        }
    }
    match run.wait()? {
        Outcome::Finished(Some(summary)) => println!(
            "final loss {:.4}; metrics, checkpoints and summary.json in {}",
            summary.final_loss,
            dir.display()
        ),
        Outcome::Interrupted { stop, .. } => println!("{stop}"),
        _ => {}
    }
    Ok(())
}
