//! `ferrotron train`: one rank (the default), data-parallel ranks as threads, or one MPI
//! process per rank.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ferrotron_config::{CommBackend, Config};
use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::TokenFile;
use ferrotron_train::bench::rss_bytes;
use ferrotron_train::checkpoint::Checkpoint;
use ferrotron_train::hf::{load_model, save_model};
use ferrotron_train::launch::{on_thread_ranks, on_thread_ranks_on, topology};
use ferrotron_train::metrics::{write_summary, MetricsWriter};
use ferrotron_train::trainer::thread_pool;
use ferrotron_train::{
    mfu, peak, CheckpointHook, EvalHook, Init, StepHook, StepStats, TrainError, Trainer,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Mutex;
use std::time::Instant;

pub(crate) mod memory_check;
mod pp_split;
mod process_memory;
mod trace;

use trace::{write_trace, TraceSink};

/// Causal attention work per context-parallel rank (one sequence, all layers' heads): the
/// zig-zag split the engine uses against the contiguous split it avoids.
fn cp_balance(config: &Config) -> anyhow::Result<String> {
    use ferrotron_tensor::ring_attention::{block_flops, contiguous_positions, zigzag_positions};
    let (s, c) = (config.model.seq_len, config.parallel.cp);
    let m = &config.model;
    let mut out =
        String::from("attention FLOPs per context-parallel rank (forward, one sequence):\n");
    for (name, split) in [
        (
            "zig-zag (used)",
            zigzag_positions as fn(usize, usize, usize) -> _,
        ),
        ("contiguous", contiguous_positions),
    ] {
        let ranks = (0..c)
            .map(|r| split(s, c, r))
            .collect::<Result<Vec<_>, _>>()?;
        // Every rank's queries meet every rank's keys once around the ring.
        let work: Vec<f64> = ranks
            .iter()
            .map(|q| {
                let per_head: u64 = ranks
                    .iter()
                    .map(|k| block_flops(q, k, 1, m.head_dim()))
                    .sum();
                (per_head * (m.heads * m.layers) as u64) as f64
            })
            .collect();
        let (lo, hi) = work
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &w| (lo.min(w), hi.max(w)));
        let list: Vec<String> = work.iter().map(|w| format!("{:.3e}", w)).collect();
        out.push_str(&format!(
            "  {name:<15} {}  max/min − 1 = {:.1}%\n",
            list.join(" "),
            100.0 * (hi / lo - 1.0)
        ));
    }
    Ok(out)
}

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
    /// Replace a previous run's results in `run.dir` (without it, a fresh run refuses a
    /// directory that holds a run's metrics; `--resume latest` continues that run instead).
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
        config.checkpoint.dir_for(&config.run.dir)
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

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let rss_baseline = rss_bytes();
    if let Some(dir) = &args.save_model {
        check_output_dir(dir, "--save-model")?;
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
        Some(dir) => {
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
            Some(loaded.weights)
        }
        None => None,
    };
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
            print!("{}", cp_balance(&config)?);
        }
        return Ok(());
    }
    if !args.no_memory_check {
        memory_check::check(&config)?;
    }
    let backends = match config.parallel.backend {
        CommBackend::Threads => {
            crate::device::thread_backends(&config, topo.world_size(), !args.no_memory_check)?
        }
        CommBackend::Mpi => None,
    };
    let fault = parse_fault(args.fail_rank_at.as_deref())?;
    let trace = match (args.trace, &args.trace_steps) {
        (false, _) => None,
        (true, Some(spec)) => Some(parse_steps(spec)?),
        (true, None) if config.train.steps >= 3 => Some((2, 3)),
        (true, None) => Some((1, config.train.steps.max(1))),
    };
    let traces = TraceSink {
        origin: Instant::now(),
        steps: trace,
        ranks: Mutex::new(Vec::new()),
        memory: Mutex::new(Vec::new()),
        timelines: Mutex::new(Vec::new()),
        ledger_peaks: Mutex::new(Vec::new()),
    };
    match config.parallel.backend {
        CommBackend::Threads if backends.is_some() => {
            let backends = backends.unwrap_or_default();
            on_thread_ranks_on(
                &config,
                init,
                &|rank| backends[rank].clone(),
                |mut trainer| {
                    trainer.faults.fail_at_step =
                        fault.and_then(|(r, s)| (r == trainer.rank()).then_some(s));
                    drive(trainer, &args, &traces)
                },
            )?;
        }
        CommBackend::Threads if topo.world_size() == 1 => {
            let mut trainer = match init {
                Init::Checkpoint(c) => Trainer::resume(config.clone(), c)?,
                Init::Weights(w) => Trainer::with_weights(config.clone(), w)?,
                Init::Fresh => Trainer::new(config.clone())?,
            };
            trainer.faults.fail_at_step = fault.and_then(|(r, s)| (r == 0).then_some(s));
            drive(trainer, &args, &traces)?;
        }
        CommBackend::Threads => {
            on_thread_ranks(&config, init, |mut trainer| {
                trainer.faults.fail_at_step =
                    fault.and_then(|(r, s)| (r == trainer.rank()).then_some(s));
                drive(trainer, &args, &traces)
            })?;
        }
        CommBackend::Mpi => crate::mpi::run(&config, init, fault, |t| drive(t, &args, &traces))?,
    }
    let peaks = std::mem::take(&mut *traces.ledger_peaks.lock().expect("peaks lock"));
    // One process holds every rank as threads; under MPI each holds its own, and on a GPU
    // the ledger counts device memory (neither reported).
    let host = config.train.device == ferrotron_config::Device::Cpu;
    if config.parallel.backend == CommBackend::Threads && host {
        if let Err(e) = process_memory::report(&config.run.dir, rss_baseline, &peaks) {
            eprintln!("warning: the process's memory was not added to summary.json: {e}");
        }
    }
    let mut ranks = traces.ranks.into_inner().expect("trace lock");
    if !ranks.is_empty() {
        ranks.sort_by_key(|(r, _)| *r);
        let name = if config.parallel.backend == CommBackend::Mpi {
            format!("trace-rank{}", ranks[0].0)
        } else {
            "trace".into()
        };
        let mut memory = traces.memory.into_inner().expect("trace lock");
        memory.sort_by_key(|(r, _, _)| *r);
        let mut timelines = traces.timelines.into_inner().expect("trace lock");
        timelines.sort_by_key(|(r, _)| *r);
        write_trace(&config, &name, &ranks, &memory, &timelines)?;
    }
    Ok(())
}

/// `--max-shard-size`: a size as transformers' `max_shard_size` takes it.
pub(crate) fn parse_shard_size(text: &str) -> Result<u64, String> {
    ferrotron_train::hf::shards::parse_size(text)
}

fn parse_steps(spec: &str) -> anyhow::Result<(usize, usize)> {
    let (a, b) = spec.split_once('-').unwrap_or((spec, spec));
    let (a, b): (usize, usize) = (
        a.trim().parse().context("--trace-steps FIRST")?,
        b.trim().parse().context("--trace-steps LAST")?,
    );
    anyhow::ensure!(
        a >= 1 && a <= b,
        "--trace-steps {spec}: need 1 ≤ FIRST ≤ LAST"
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

/// The leader's view of the run: metrics lines, the progress bar and a log line every
/// `run.log_every` steps.
struct Progress<'a> {
    metrics: Option<MetricsWriter>,
    bar: &'a ProgressBar,
    quiet: bool,
    log_every: usize,
}

/// Prints `line` above the progress bar (or plainly when quiet).
fn progress_line(bar: &ProgressBar, quiet: bool, line: String) {
    if quiet {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

impl StepHook for Progress<'_> {
    fn after_step(&mut self, trainer: &Trainer, s: &StepStats) -> Result<(), TrainError> {
        let Some(m) = self.metrics.as_mut() else {
            return Ok(());
        };
        m.write_step(s)?;
        let mfu = s
            .mfu
            .map(|m| format!("{:.1}%", m * 100.0))
            .unwrap_or_default();
        self.bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | MFU {mfu}",
            s.loss, s.tokens_per_s
        ));
        self.bar.inc(1);
        if s.step.is_multiple_of(self.log_every) || s.step == trainer.config.train.steps {
            let line = format!(
                "step {:>6} loss {:.4} lr {:.2e} grad_norm {:.3} {:.0} tok/s MFU {mfu}",
                s.step, s.loss, s.lr, s.grad_norm, s.tokens_per_s
            );
            progress_line(self.bar, self.quiet, line);
        }
        Ok(())
    }
}

/// Hands this rank's timeline and memory samples to the trace sink after the last step.
struct CollectTrace<'a> {
    sink: &'a TraceSink,
    tracer: Option<&'a ferrotron_tensor::trace::Tracer>,
}

impl StepHook for CollectTrace<'_> {
    fn after_run(&mut self, trainer: &Trainer, _steps: &[StepStats]) -> Result<(), TrainError> {
        let Some(t) = self.tracer else {
            return Ok(());
        };
        let rank = trainer.rank();
        let lock = "trace lock";
        self.sink.ranks.lock().expect(lock).push((rank, t.take()));
        let stage = trainer.pipeline.as_ref().map(|p| p.rank).unwrap_or(0);
        let memory = (rank, stage, trainer.memory());
        self.sink.memory.lock().expect(lock).push(memory);
        let samples = (rank, t.take_memory());
        self.sink.timelines.lock().expect(lock).push(samples);
        Ok(())
    }
}

/// Runs one rank's steps; rank 0 holds the run directory and reports (progress, metrics,
/// summary, saved model; a failed run's summary says so). Collective where the layout needs
/// it (gathering ZeRO-3 weights), so every rank calls it.
pub fn drive(trainer: Trainer, args: &TrainArgs, traces: &TraceSink) -> Result<(), TrainError> {
    if trainer.rank() != 0 {
        return drive_rank(trainer, args, traces);
    }
    let dir = trainer.config.run.dir.clone();
    let _lock = crate::run_lock::RunLock::acquire(&dir).map_err(TrainError::RunDir)?;
    let metrics = dir.join("metrics.jsonl");
    let used = std::fs::metadata(&metrics).is_ok_and(|m| m.len() > 0);
    if used && trainer.steps_done() == 0 && !args.overwrite {
        return Err(TrainError::RunDir(format!(
            "run.dir {} holds a previous run's {}: pass --overwrite to replace it, \
             --resume latest to continue it, or set run.dir to another directory",
            dir.display(),
            metrics.display()
        )));
    }
    let steps_before = trainer.steps_done();
    let result = drive_rank(trainer, args, traces);
    if let Err(e) = &result {
        let failed = ferrotron_train::metrics::FailedRun {
            status: "failed",
            error: e.to_string(),
            started_at_step: steps_before,
        };
        // The error is what the user needs; a summary that cannot be written adds nothing.
        let _ = ferrotron_train::metrics::write_json(&dir.join("summary.json"), &failed);
    }
    result
}

/// One rank's part of [`drive`].
fn drive_rank(
    mut trainer: Trainer,
    args: &TrainArgs,
    traces: &TraceSink,
) -> Result<(), TrainError> {
    let leader = trainer.rank() == 0;
    let tracer = traces
        .steps
        .map(|(a, b)| trainer.enable_trace(traces.origin, a, b));
    let threads = trainer.threads();
    let cfg = trainer.config.clone();
    // MFU of the whole run: global tokens/s against the peak of every core the run occupies
    // (one definition: `ferrotron_train::mfu`). Only the leader reports it, so only the
    // leader measures, while the others wait.
    let occupancy = mfu::Occupancy {
        ranks: cfg.parallel.world_size(),
        threads_per_rank: threads,
        shared_host: cfg.parallel.backend == CommBackend::Threads,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let (peak_threads, peak_copies) = occupancy.peak_shape();
    // bf16 products are measured against the bf16 products' own peak.
    let products = peak::Products::of(cfg.train.matmul);
    let peak = if leader {
        // The cache is written only by `ferrotron bench`, on a quiet machine; a run without
        // one measures for itself and does not store what it measured under its own load.
        match peak::cached_peak_of(peak_threads, products) {
            Some(p) => Some(p),
            None => Some(
                thread_pool(peak_threads)?.install(|| peak::measure_matmul_peak_of(products, 7)),
            ),
        }
    } else {
        None
    };
    // The other ranks wait, so that they do not compute on the cores being measured.
    trainer.world_barrier()?;
    trainer.metrics.peak_flops = peak.map(|p| p * peak_copies as f64);
    if leader {
        eprintln!(
            "ferrotron: {} parameters, {} layers, hidden {}, {} tokens/step, dtype {:?}, {}, {} threads per rank",
            cfg.model.num_params(),
            cfg.model.layers,
            cfg.model.hidden,
            cfg.tokens_per_step(),
            cfg.train.dtype,
            cfg.describe_layout(),
            threads
        );
        if let Some(note) = pp_split::hint(&cfg) {
            eprintln!("{note}");
        }
        if cfg.train.matmul != ferrotron_config::Matmul::Gemm {
            // Loaded already by the trainer; this names the library it found.
            let mm = ferrotron_tensor::linear::HostMatmul::load(cfg.train.matmul)?;
            eprintln!("matmul: linear layers and LM head on {}", mm.describe());
        }
        if cfg.data.path.is_none() {
            let corpus = SyntheticCorpus::new(cfg.model.vocab, cfg.train.seed);
            eprintln!(
                "data: embedded synthetic corpus (lag-2 Markov); best achievable loss {:.4} nats",
                corpus.optimal_loss(cfg.model.seq_len)
            );
        }
    }
    // Every rank evaluates: tensor, expert and ZeRO-3 shards take part in the collectives.
    // The file is opened and checked before anything is written to the run directory.
    let mut eval = match &cfg.data.eval_path {
        Some(path) => {
            let file = TokenFile::open(path)?;
            file.check_vocab(cfg.model.vocab)?;
            Some(EvalHook::new(file))
        }
        None => None,
    };
    let resumed = trainer.steps_done() > 0;
    trainer.faults.abort_in_save = args.abort_in_save;
    let bar = if args.quiet || !leader {
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
    bar.set_position(trainer.steps_done() as u64);
    let mut progress = Progress {
        metrics: if leader {
            Some(MetricsWriter::open(
                &cfg.run.dir,
                resumed.then_some(trainer.steps_done()),
            )?)
        } else {
            None
        },
        bar: &bar,
        quiet: args.quiet,
        log_every: cfg.run.log_every,
    };
    let mut checkpoints = CheckpointHook {
        root: cfg.checkpoint.dir_for(&cfg.run.dir),
        every: cfg.checkpoint.every,
        keep: cfg.checkpoint.keep,
        on_save: Box::new(|saved: &Path| {
            if leader {
                progress_line(&bar, args.quiet, format!("checkpoint: {}", saved.display()));
            }
        }),
    };
    // The trace is collected before evaluation, so that it shows the training steps only.
    let mut collect = CollectTrace {
        sink: traces,
        tracer: tracer.as_deref(),
    };
    let steps = {
        let mut hooks: Vec<&mut dyn StepHook> = vec![&mut progress, &mut checkpoints, &mut collect];
        if let Some(e) = eval.as_mut() {
            hooks.push(e);
        }
        trainer.run_with(&mut hooks)?
    };
    bar.finish_and_clear();
    let eval_loss = eval.and_then(|e| e.report).map(|report| {
        if leader {
            eprintln!(
                "eval: loss {:.6} over {} tokens of {}",
                report.loss,
                report.tokens,
                cfg.data
                    .eval_path
                    .as_deref()
                    .unwrap_or(Path::new(""))
                    .display()
            );
        }
        report.loss
    });
    // The run's memory, before gathering the model for saving adds its own buffers.
    let memory = trainer.memory();
    traces
        .ledger_peaks
        .lock()
        .expect("peaks lock")
        .push(memory.total_peak);
    let model = match &args.save_model {
        Some(_) => Some(trainer.gather_model()?),
        None => None,
    };
    if !leader {
        return Ok(());
    }
    let summary = trainer.summary(&steps, eval_loss);
    write_summary(&cfg.run.dir, &summary)?;
    if !steps.is_empty() {
        eprintln!(
            "done: final loss {:.4} (mean of last 10% {:.4}); {:.0} tokens/s median; MFU {:.1}% of the measured {} matmul peak of the cores this run occupies ({:.1} GFLOP/s with {peak_threads} threads{}; model FLOPs with full attention, as nanotron and Megatron-LM count them)",
            summary.final_loss,
            summary.tail_loss,
            summary.tokens_per_s,
            summary.mfu.unwrap_or(0.0) * 100.0,
            match products {
                peak::Products::F32 => "f32",
                peak::Products::Bf16 => "bf16-product",
            },
            peak.unwrap_or(0.0) / 1e9,
            if peak_copies > 1 { format!(", × {peak_copies} processes") } else { String::new() }
        );
    }
    if summary.mfu.is_some_and(|m| m > 1.0) {
        let when = match (
            peak::cached_measurement_of(peak_threads, products),
            peak::cached_peak_of(peak_threads, products),
        ) {
            (Some(m), _) => format!("cached peak: {}", m.describe()),
            (None, Some(_)) => "the cached peak does not say how it was measured".into(),
            (None, None) => "no cached peak: this run measured it under its own load".into(),
        };
        eprintln!(
            "warning: MFU above 100% means the matmul peak is stale or was measured while other processes ran ({when}); run `ferrotron bench --configs ''{}` on a quiet machine to measure it again",
            match products {
                peak::Products::F32 => "",
                peak::Products::Bf16 => " --matmul bf16 --dtype bf16",
            }
        );
    }
    if let (Some(h), Some(e)) = (summary.reduce_hidden_share, summary.reduce_exposed_share) {
        eprintln!(
            "gradient reductions (rank 0): {:.1}% of their time hidden behind backward; exposed communication {:.1}% of step time",
            h * 100.0,
            e * 100.0
        );
    }
    eprintln!("memory ledger of rank 0 (per category):\n{memory}");
    if let (Some(dir), Some((layout, weights))) = (&args.save_model, model) {
        save_model(
            dir,
            &trainer.config.model,
            &layout,
            &weights,
            trainer.device().ledger,
            args.max_shard_size,
        )?;
        eprintln!("saved Hugging Face model to {}", dir.display());
    }
    eprintln!("metrics: {}", cfg.run.dir.join("metrics.jsonl").display());
    if !steps.is_empty() {
        match crate::plots::write_run_plots(&cfg.run.dir) {
            Ok(paths) => eprintln!(
                "plots: {}",
                paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Err(e) => eprintln!("warning: {e:#}"),
        }
    }
    Ok(())
}
