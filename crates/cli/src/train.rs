//! `ferrotron train`.

use std::path::PathBuf;

use anyhow::Context;
use ferrotron_config::Config;
use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::TokenFile;
use ferrotron_train::hf::{load_model, save_model};
use ferrotron_train::metrics::{write_summary, MetricsWriter};
use ferrotron_train::{peak, Trainer};
use indicatif::{ProgressBar, ProgressStyle};

/// Arguments of `train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// TOML configuration file (defaults for every missing key).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a configuration value, e.g. `--set train.steps=100` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Start from a Hugging Face Llama directory; its config.json gives the model shape
    /// (model.seq_len stays the run's).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Write the final model as a Hugging Face Llama directory.
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let mut config = Config::load(args.config.as_deref(), &args.set)?;
    let mut trainer = match &args.init_from {
        Some(dir) => {
            let loaded = load_model(dir)?;
            let seq_len = config.model.seq_len;
            config.model = ferrotron_config::ModelConfig {
                seq_len,
                ..loaded.config
            };
            Trainer::with_weights(config, &loaded.weights)?
        }
        None => Trainer::new(config)?,
    };
    let threads = trainer.threads();
    let peak = match peak::cached_peak(threads) {
        Some(p) => p,
        None => {
            let p = trainer.in_pool(|| peak::measure_matmul_peak(7));
            peak::store_peak(threads, p);
            p
        }
    };
    trainer.peak_flops = Some(peak);
    let cfg = trainer.config.clone();
    eprintln!(
        "ferrotron: {} parameters, {} layers, hidden {}, {} tokens/step, dtype {:?}, {} threads",
        trainer.model.layout.total,
        cfg.model.layers,
        cfg.model.hidden,
        cfg.tokens_per_step(),
        cfg.train.dtype,
        threads
    );
    if cfg.data.path.is_none() {
        let corpus = SyntheticCorpus::new(cfg.model.vocab, cfg.train.seed);
        eprintln!(
            "data: embedded synthetic corpus (lag-2 Markov); best achievable loss {:.4} nats",
            corpus.optimal_loss(cfg.model.seq_len)
        );
    }
    let mut metrics = MetricsWriter::create(&cfg.run.dir)?;
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cfg.train.steps as u64)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("valid template"),
    );
    let mut steps = Vec::with_capacity(cfg.train.steps);
    while trainer.steps_done() < cfg.train.steps {
        let s = trainer.step()?;
        metrics.write_step(&s)?;
        let mfu = s
            .mfu
            .map(|m| format!("{:.1}%", m * 100.0))
            .unwrap_or_default();
        bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | MFU {mfu}",
            s.loss, s.tokens_per_s
        ));
        bar.inc(1);
        if s.step % cfg.run.log_every == 0 || s.step == cfg.train.steps {
            let line = format!(
                "step {:>6} loss {:.4} lr {:.2e} grad_norm {:.3} {:.0} tok/s MFU {mfu}",
                s.step, s.loss, s.lr, s.grad_norm, s.tokens_per_s
            );
            if args.quiet {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
        steps.push(s);
    }
    bar.finish_and_clear();
    let eval_loss = match &cfg.data.eval_path {
        Some(path) => {
            let file = TokenFile::open(path)?;
            let report = trainer.evaluate(&file)?;
            eprintln!(
                "eval: loss {:.6} over {} tokens of {}",
                report.loss,
                report.tokens,
                path.display()
            );
            Some(report.loss)
        }
        None => None,
    };
    let summary = trainer.summary(&steps, eval_loss);
    write_summary(&cfg.run.dir, &summary)?;
    if !steps.is_empty() {
        eprintln!(
            "done: final loss {:.4} (mean of last 10% {:.4}); {:.0} tokens/s median; MFU {:.1}% of this machine's measured f32 matmul peak ({:.1} GFLOP/s, {threads} threads; attention FLOPs counted over the causal half)",
            summary.final_loss,
            summary.tail_loss,
            summary.tokens_per_s,
            summary.mfu.unwrap_or(0.0) * 100.0,
            peak / 1e9
        );
    }
    eprintln!("memory ledger (bytes per category):\n{}", trainer.memory());
    if let Some(dir) = &args.save_model {
        save_model(
            dir,
            &trainer.config.model,
            &trainer.model.layout,
            &trainer.state.weights,
        )
        .with_context(|| format!("saving the model to {}", dir.display()))?;
        eprintln!("saved Hugging Face model to {}", dir.display());
    }
    eprintln!("metrics: {}", cfg.run.dir.join("metrics.jsonl").display());
    Ok(())
}
