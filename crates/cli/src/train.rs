//! `ferrotron train`: one rank (the default), data-parallel ranks as threads, or one MPI
//! process per rank.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ferrotron_config::{CommBackend, Config};
use ferrotron_train::bench::rss_bytes;
use ferrotron_train::checkpoint::Checkpoint;
use ferrotron_train::hf::load_model;
use ferrotron_train::launch::{on_thread_ranks, on_thread_ranks_on, topology};
use ferrotron_train::stop::Stopped;
use ferrotron_train::{Init, Trainer};
use std::time::Instant;

mod drive;
mod peak_report;
mod pp_split;
mod process_memory;

use drive::drive;
use ferrotron_train::trace_files::TraceSink;

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

/// Opens (and verifies) the checkpoint `--resume` names and returns it with the run's
/// configuration: `--config` if given, else the checkpoint's; `--set` applies on top.
fn open_resume(
    args: &TrainArgs,
    config: Config,
    spec: &std::path::Path,
) -> anyhow::Result<(Config, Checkpoint)> {
    let path = if spec == std::path::Path::new("latest") {
        let root = config.checkpoint.dir_for(&config.run.dir);
        anyhow::ensure!(
            !ferrotron_train::checkpoint::list_checkpoints(&root).is_empty(),
            "--resume latest: there is no checkpoint in {} (checkpoint.dir of run.dir {}); \
             a run saves checkpoints only with checkpoint.every = N (0, the default, saves \
             none). Start a fresh run, or pass --resume a step_N folder or a checkpoint root",
            root.display(),
            config.run.dir.display()
        );
        root
    } else {
        spec.to_path_buf()
    };
    let checkpoint = Checkpoint::open(&path)?;
    let config = if args.config.is_some() {
        config
    } else {
        checkpoint.manifest.config.with_overrides(&args.set)?
    };
    anyhow::ensure!(
        checkpoint.manifest.step < config.train.steps,
        "--resume {}: the checkpoint is at step {}, and train.steps = {} leaves nothing to train; \
         set train.steps above {} to continue",
        checkpoint.dir.display(),
        checkpoint.manifest.step,
        config.train.steps,
        checkpoint.manifest.step,
    );
    let change = checkpoint.check_data(&config, args.allow_data_change)?;
    if let ferrotron_train::checkpoint::DataChange::Changed { from, to } = change {
        eprintln!(
            "note: --allow-data-change: continuing on {} (the checkpoint consumed {}); the \
             data position carries over as a sample index",
            to.describe(),
            from.describe()
        );
    }
    eprintln!(
        "resuming from {} (step {}, {} samples consumed, saved as {})",
        checkpoint.dir.display(),
        checkpoint.manifest.step,
        checkpoint.manifest.samples_done,
        checkpoint.manifest.config.describe_layout(),
    );
    Ok((config, checkpoint))
}

/// Checks, before any work, that `dir` can be created (or is a directory) and written:
/// the nearest existing ancestor must be a writable directory.
fn check_output_dir(dir: &std::path::Path, flag: &str) -> anyhow::Result<()> {
    let existing = dir
        .ancestors()
        .find(|a| a.as_os_str().is_empty() || a.exists())
        .map(|a| {
            if a.as_os_str().is_empty() {
                std::path::Path::new(".")
            } else {
                a
            }
        })
        .unwrap_or(std::path::Path::new("."));
    anyhow::ensure!(
        existing.is_dir(),
        "{flag} {}: {} is a file, not a directory; choose another path",
        dir.display(),
        existing.display()
    );
    let probe = existing.join(format!(".ferrotron-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| {
            anyhow::anyhow!(
                "{flag} {}: cannot write in {} ({e}); choose a writable path",
                dir.display(),
                existing.display()
            )
        })
}

/// `ferrotron train`: the configuration (resumed or initialised from a saved model), checks
/// before any work, the ranks' runs, then the process's memory and the trace.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let rss_baseline = rss_bytes();
    if let Some(dir) = &args.save_model {
        check_output_dir(dir, "--save-model")?;
        crate::overwrite::check_model_dir(dir, "--save-model", args.overwrite)?;
    }
    let mut config = Config::load(args.config.as_deref(), &args.set)?;
    let resume = match &args.resume {
        Some(spec) => {
            let (c, checkpoint) = open_resume(&args, config, spec)?;
            config = c;
            Some(checkpoint)
        }
        None => None,
    };
    let weights = match &args.init_from {
        Some(dir) => Some(init_from(dir, &mut config)?),
        None => None,
    };
    if args.overwrite && resume.is_none() {
        let root = config.checkpoint.dir_for(&config.run.dir);
        crate::overwrite::check_checkpoint_root(&config.run.dir, &root)?;
    }
    let init = match (&resume, &weights) {
        (Some(c), _) => Init::Checkpoint(c),
        (None, Some(w)) => Init::Weights(w),
        (None, None) => Init::Fresh,
    };
    let topo = topology(&config)?;
    if args.dry_run {
        println!("{topo}");
        if let Some(note) = pp_split::hint(&config) {
            println!("{note}");
        }
        if config.parallel.cp > 1 {
            print!(
                "{}",
                ferrotron_train::launch::cp_balance_report(&config.model, config.parallel.cp)?
            );
        }
        return Ok(());
    }
    check_output_dir(&config.run.dir, "run.dir")?;
    // The data's vocabulary, from the sidecars, before the ranks start (each rank opens
    // and checks the files again).
    for path in config
        .data
        .training_paths()
        .into_iter()
        .chain(config.data.eval_path.as_deref())
    {
        ferrotron_data::check_vocab_of(path, config.model.vocab)?;
    }
    if !args.no_memory_check {
        ferrotron_devices::memory_check::check(&config)?;
    }
    // The steps this run trains: after a resumed checkpoint's, up to train.steps.
    let first = resume.as_ref().map_or(0, |c| c.manifest.step) + 1;
    let trace = match (args.trace, &args.trace_steps) {
        (false, _) => None,
        (true, Some(spec)) => Some(parse_steps(spec, first..=config.train.steps)?),
        (true, None) if config.train.steps >= 3 => Some((2, 3)),
        (true, None) => Some((1, config.train.steps.max(1))),
    };
    let grace = std::time::Duration::from_secs_f64(config.run.signal_grace_s);
    let stop = crate::signals::watch(grace).context("installing the signal handlers")?;
    let traces = Shared {
        stop: Some(stop),
        sink: TraceSink::new(Instant::now(), trace),
    };
    let stopped = launch(&config, init, &args, &traces)?;
    report_process(&config, rss_baseline, traces)?;
    match stopped {
        Some(stopped) => Err(crate::signals::Interrupted {
            cause: stopped.cause,
            message: format!(
                "the run stopped after step {} ({}); summary.json says \"interrupted\"",
                stopped.step,
                stopped.cause.name()
            ),
        }
        .into()),
        None => Ok(()),
    }
}

/// The weights of the Hugging Face model in `dir`, its shape taking the place of
/// `config`'s model (the configured sequence length kept, with a warning past the model's).
fn init_from(dir: &Path, config: &mut Config) -> anyhow::Result<Vec<f32>> {
    let loaded = load_model(dir)?;
    let seq_len = config.model.seq_len;
    let trained = loaded.config.seq_len;
    if seq_len > trained {
        eprintln!(
            "warning: model.seq_len = {seq_len} uses positions beyond the model's \
             max_position_embeddings = {trained}: its quality there is untested"
        );
    }
    config.model = ferrotron_config::ModelConfig {
        seq_len,
        ..loaded.config
    };
    config.validate()?;
    Ok(loaded.weights)
}

/// Runs every rank of this process: the ranks as threads (on the devices' backends where
/// the run has them), the one rank, or this MPI process's rank.
/// Returns where the run stopped if a signal stopped it early.
fn launch(
    config: &Config,
    init: Init<'_>,
    args: &TrainArgs,
    traces: &Shared,
) -> anyhow::Result<Option<Stopped>> {
    let world = topology(config)?.world_size();
    let backends = match config.parallel.backend {
        CommBackend::Threads => {
            ferrotron_devices::thread_backends(config, world, !args.no_memory_check)?
        }
        CommBackend::Mpi => None,
    };
    let fault = parse_fault(args.fail_rank_at.as_deref())?;
    let fail_at = |rank: usize| fault.and_then(|(r, s)| (r == rank).then_some(s));
    let stopped = match config.parallel.backend {
        CommBackend::Threads if backends.is_some() => {
            let backends = backends.unwrap_or_default();
            on_thread_ranks_on(
                config,
                init,
                &|rank| backends[rank].clone(),
                |mut trainer| {
                    trainer.faults.fail_at_step = fail_at(trainer.rank());
                    drive(trainer, args, traces)
                },
            )?
        }
        CommBackend::Threads if world == 1 => {
            let mut trainer = match init {
                Init::Checkpoint(c) => Trainer::resume(config.clone(), c)?,
                Init::Weights(w) => Trainer::with_weights(config.clone(), w)?,
                Init::Fresh => Trainer::new(config.clone())?,
            };
            trainer.faults.fail_at_step = fail_at(0);
            vec![drive(trainer, args, traces)?]
        }
        CommBackend::Threads => on_thread_ranks(config, init, |mut trainer| {
            trainer.faults.fail_at_step = fail_at(trainer.rank());
            drive(trainer, args, traces)
        })?,
        CommBackend::Mpi => vec![crate::mpi::run(config, init, fault, |t| {
            drive(t, args, traces)
        })?],
    };
    // Every rank agreed on the step: any rank's answer is the run's.
    Ok(stopped.into_iter().flatten().next())
}

/// After the ranks: the process's memory against the ledgers (ranks as threads on the host)
/// into the summary, and the trace of the traced steps.
fn report_process(
    config: &Config,
    rss_baseline: Option<u64>,
    traces: Shared,
) -> anyhow::Result<()> {
    let peaks = traces.sink.take_peaks();
    // One process holds every rank as threads; under MPI each holds its own, and on a GPU
    // the ledger counts device memory (neither reported).
    let host = config.train.device == ferrotron_config::Device::Cpu;
    if config.parallel.backend == CommBackend::Threads && host {
        if let Err(e) = process_memory::report(&config.run.dir, rss_baseline, &peaks) {
            eprintln!("warning: the process's memory was not added to summary.json: {e}");
        }
    }
    let per_process = config.parallel.backend == CommBackend::Mpi;
    if let Some(report) = traces.sink.write(config, per_process)? {
        eprintln!("{report}");
    }
    Ok(())
}

/// What this process's ranks share while they run: the request to stop early and where
/// they leave their traces and ledger peaks.
pub struct Shared {
    /// Raised by a signal (see [`crate::signals`]); every rank stops after the same step.
    pub(crate) stop: Option<ferrotron_train::stop::StopFlag>,
    /// The traced ranks' timelines and every rank's ledger peak.
    pub(crate) sink: TraceSink,
}

/// `--max-shard-size`: a size as transformers' `max_shard_size` takes it.
pub(crate) fn parse_shard_size(text: &str) -> Result<u64, String> {
    ferrotron_train::hf::shards::parse_size(text)
}

/// `--trace-steps FIRST-LAST` (or one step), within the steps `run` this run trains.
fn parse_steps(spec: &str, run: std::ops::RangeInclusive<usize>) -> anyhow::Result<(usize, usize)> {
    let (a, b) = spec.split_once('-').unwrap_or((spec, spec));
    let (a, b): (usize, usize) = (
        a.trim().parse().context("--trace-steps FIRST")?,
        b.trim().parse().context("--trace-steps LAST")?,
    );
    anyhow::ensure!(
        a >= 1 && a <= b,
        "--trace-steps {spec}: need 1 ≤ FIRST ≤ LAST"
    );
    anyhow::ensure!(
        run.contains(&a) && run.contains(&b),
        "--trace-steps {spec}: this run trains steps {}–{} (train.steps = {}{}): trace steps \
         within them",
        run.start(),
        run.end(),
        run.end(),
        if *run.start() > 1 {
            ", resumed after the checkpoint's"
        } else {
            ""
        }
    );
    Ok((a, b))
}

fn parse_fault(spec: Option<&str>) -> anyhow::Result<Option<(usize, usize)>> {
    let Some(spec) = spec else { return Ok(None) };
    let (r, s) = spec
        .split_once(':')
        .context("--fail-rank-at takes RANK:STEP")?;
    Ok(Some((
        r.parse().context("--fail-rank-at RANK")?,
        s.parse().context("--fail-rank-at STEP")?,
    )))
}
