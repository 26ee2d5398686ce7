//! `ferrotron train`: its flags, the engine's run ([`ferrotron_engine::train`]) and the
//! progress bar.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use ferrotron_engine::{Console, Outcome, TrainOptions};
use ferrotron_train::StepStats;
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
    /// Write the final model as a Hugging Face Llama directory (with `--init-from`, the
    /// tokenizer files of that directory too).
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// Largest weight file of --save-model: bigger models are written as shards with a
    /// `model.safetensors.index.json` (bytes, or 500MB, 5GB, 2GiB …; transformers' default).
    #[arg(long, default_value = "50GB", value_parser = parse_shard_size)]
    max_shard_size: u64,
    /// Print the grid of ranks and each rank's groups, then exit.
    #[arg(long)]
    dry_run: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Skip the check, before any work, that the run fits in this machine's available
    /// memory (by the estimator).
    #[arg(long)]
    no_memory_check: bool,
    /// Replace a previous run's results in `run.dir`, its checkpoints (those inside
    /// `run.dir`) and the model at `--save-model` (without it, a fresh run refuses a
    /// directory that holds a run's metrics, and `--save-model` one that holds a model;
    /// `--resume latest` continues a run instead).
    #[arg(long)]
    overwrite: bool,
    /// Record a per-rank timeline (Chrome trace JSON in `<run.dir>/trace.json`, open it in
    /// Perfetto or chrome://tracing) and write the step report (`report.json`, `report.txt`).
    #[arg(long)]
    trace: bool,
    /// Steps to trace, `FIRST-LAST` (1-based, inclusive); default: steps 2–3 (the first
    /// step warms up), or every step of a shorter run.
    #[arg(long, value_name = "FIRST-LAST", requires = "trace")]
    trace_steps: Option<String>,
    /// Fault injection for failure tests: rank R fails in the middle of step S.
    #[arg(long, hide = true, value_name = "R:S")]
    fail_rank_at: Option<String>,
    /// Continue a run from a checkpoint: a `step_N` folder, a checkpoint root, or `latest`
    /// (the newest under `checkpoint.dir`). It may have been saved under any layout. Without
    /// `--config` the checkpoint's own configuration is used, with `--set` applied on top.
    #[arg(long, value_name = "DIR|latest", conflicts_with = "init_from")]
    resume: Option<PathBuf>,
    /// With `--resume`: continue on other data than the checkpoint consumed (a different
    /// token file, or one whose contents changed); without it such a resume is refused,
    /// naming both.
    #[arg(long, requires = "resume")]
    allow_data_change: bool,
    /// Fault injection for checkpoint tests: the process aborts while saving step S's
    /// checkpoint, after the rank files and before the manifest.
    #[arg(long, hide = true, value_name = "S")]
    abort_in_save: Option<usize>,
}

impl TrainArgs {
    /// The engine's options for these flags.
    fn options(self) -> TrainOptions {
        TrainOptions {
            config: self.config,
            config_toml: None,
            set: self.set,
            init_from: self.init_from,
            save_model: self.save_model,
            max_shard_size: self.max_shard_size,
            dry_run: self.dry_run,
            no_memory_check: self.no_memory_check,
            overwrite: self.overwrite,
            trace: self.trace,
            trace_steps: self.trace_steps,
            fail_rank_at: self.fail_rank_at,
            resume: self.resume,
            allow_data_change: self.allow_data_change,
            abort_in_save: self.abort_in_save,
            signals: true,
        }
    }
}

/// `ferrotron train`: the run, its lines above a progress bar (plain lines when quiet or
/// without a terminal: a log file, a pipe, CI).
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let plain = args.quiet || !std::io::stderr().is_terminal();
    let console = Arc::new(Bar {
        bar: ProgressBar::hidden(),
        plain,
    });
    match ferrotron_engine::train(&args.options(), console)? {
        Outcome::Finished(_) => Ok(()),
        Outcome::DryRun(text) => {
            println!("{text}");
            Ok(())
        }
        Outcome::Interrupted { stop, .. } => Err(stop.into()),
    }
}

/// The terminal's view of a run: its lines above a progress bar of the leader's steps.
struct Bar {
    bar: ProgressBar,
    plain: bool,
}

impl Console for Bar {
    fn say(&self, line: &str) {
        // Before the steps, after them and when plain, no bar is drawn.
        match self.plain || self.bar.is_hidden() || self.bar.is_finished() {
            true => eprintln!("{line}"),
            false => self.bar.println(line),
        }
    }

    fn begin(&self, done: usize, total: usize) {
        if self.plain {
            return;
        }
        // The bar's clock starts with the steps, not with the checks before them.
        self.bar.reset();
        self.bar
            .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        self.bar.set_length(total as u64);
        self.bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("valid template"),
        );
        self.bar.set_position(done as u64);
    }

    fn step(&self, s: &StepStats) {
        let mfu = s
            .mfu
            .map(|m| format!("{:.1}%", m * 100.0))
            .unwrap_or_default();
        self.bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | MFU {mfu}",
            s.loss, s.tokens_per_s
        ));
        self.bar.inc(1);
    }

    fn end(&self) {
        self.bar.finish_and_clear();
    }
}

/// `--max-shard-size`: a size as transformers' `max_shard_size` takes it.
pub(crate) fn parse_shard_size(text: &str) -> Result<u64, String> {
    ferrotron_train::hf::shards::parse_size(text)
}
