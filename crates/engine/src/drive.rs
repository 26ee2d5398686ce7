//! One rank's run of `ferrotron train` once its trainer exists: the matmul peak for MFU,
//! the leader's header, the step hooks (progress, metrics, checkpoints, trace, evaluation),
//! and the leader's report and saved model.

use std::path::Path;

use ferrotron_config::Config;
use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::{open_tokens, TokenStore};
use ferrotron_train::checkpoint::list_checkpoints;
use ferrotron_train::hf::save_model;
use ferrotron_train::metrics::{write_summary, MetricsWriter};
use ferrotron_train::stop::Stopped;
use ferrotron_train::tensorboard::{EventWriter, TensorBoardHook};
use ferrotron_train::{
    CheckpointHook, EvalHook, SaveReport, StepHook, StepStats, TrainError, Trainer,
};

use crate::peak_report::{report, Peak};
use crate::shared::Shared;
use crate::{pp_split, say, Console};

/// The leader's view of the run: metrics lines, the console's progress and a log line
/// every `run.log_every` steps.
struct Progress<'a> {
    metrics: Option<MetricsWriter>,
    console: &'a dyn Console,
    log_every: usize,
}

impl StepHook for Progress<'_> {
    fn after_step(&mut self, trainer: &Trainer, s: &StepStats) -> Result<(), TrainError> {
        let Some(m) = self.metrics.as_mut() else {
            return Ok(());
        };
        m.write_step(s)?;
        self.console.step(s);
        if s.step.is_multiple_of(self.log_every) || s.step == trainer.config.train.steps {
            let mfu = s
                .mfu
                .map(|m| format!("{:.1}%", m * 100.0))
                .unwrap_or_default();
            let scale = s
                .loss_scale
                .map(|x| format!(" loss_scale {x}"))
                .unwrap_or_default();
            say!(
                self.console,
                "step {:>6} loss {:.4} lr {:.2e} grad_norm {:.3}{scale} {:.0} tok/s MFU {mfu}",
                s.step,
                s.loss,
                s.lr,
                s.grad_norm,
                s.tokens_per_s
            );
        }
        Ok(())
    }
}

/// Hands this rank's timeline and memory samples to the trace sink after the last step.
struct CollectTrace<'a> {
    sink: &'a Shared,
    tracer: Option<&'a ferrotron_train::Tracer>,
}

impl StepHook for CollectTrace<'_> {
    fn after_run(&mut self, trainer: &Trainer, _steps: &[StepStats]) -> Result<(), TrainError> {
        if let Some(t) = self.tracer {
            self.sink.sink.collect(trainer, t);
        }
        Ok(())
    }
}

/// Runs one rank's steps; rank 0 holds the run directory and reports (progress, metrics,
/// summary, saved model; a failed run's summary says so). Collective where the layout needs
/// it (gathering ZeRO-3 weights), so every rank calls it.
/// Returns where the run stopped if a signal stopped it early (on every rank alike).
pub fn drive(trainer: Trainer, shared: &Shared) -> Result<Option<Stopped>, TrainError> {
    if trainer.rank() != 0 {
        return drive_rank(trainer, shared);
    }
    let dir = trainer.config.run.dir.clone();
    let _lock = crate::RunLock::acquire(&dir).map_err(TrainError::RunDir)?;
    let metrics = dir.join("metrics.jsonl");
    let used = std::fs::metadata(&metrics).is_ok_and(|m| m.len() > 0);
    let fresh = trainer.steps_done() == 0;
    let checkpoints = trainer.config.checkpoint.dir_for(&dir);
    if used && fresh && !shared.options.overwrite {
        let resume = if list_checkpoints(&checkpoints).is_empty() {
            ""
        } else {
            " --resume latest to continue it,"
        };
        return Err(TrainError::RunDir(format!(
            "run.dir {} holds a previous run's {}: pass --overwrite to replace it,{resume} \
             or set run.dir to another directory",
            dir.display(),
            metrics.display()
        )));
    }
    if fresh && shared.options.overwrite && shared.options.resume.is_none() {
        crate::overwrite::replace_run(&trainer.config, &checkpoints, &*shared.console)?;
    }
    let steps_before = trainer.steps_done();
    let result = drive_rank(trainer, shared);
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

/// The leader's lines before the first step: the model and layout, a note on the pipeline
/// split, the matmul library, the data.
fn print_header(cfg: &Config, threads: usize, console: &dyn Console) -> Result<(), TrainError> {
    say!(
        console,
        "ferrotron: {} parameters, {} layers, hidden {}, {} tokens/step, dtype {:?}, {}, {} per rank",
        cfg.model.num_params(),
        cfg.model.layers,
        cfg.model.hidden,
        cfg.tokens_per_step(),
        cfg.train.dtype,
        cfg.describe_layout(),
        ferrotron_plan::units::plural(threads, "thread")
    );
    if let Some(note) = pp_split::hint(cfg) {
        console.say(&note);
    }
    if cfg.train.matmul != ferrotron_config::Matmul::Gemm {
        // Loaded already by the trainer; this names the library it found.
        let mm = ferrotron_train::trainer::matmul_description(cfg.train.matmul)?;
        say!(console, "matmul: linear layers and LM head on {mm}");
    }
    if !cfg.data.reads_files() {
        let corpus = SyntheticCorpus::new(cfg.model.vocab, cfg.train.seed);
        say!(
            console,
            "data: embedded synthetic corpus (lag-2 Markov); best achievable loss {:.4} nats",
            corpus.optimal_loss(cfg.model.seq_len)
        );
    }
    Ok(())
}

/// One rank's hooks: the leader's metrics and progress, TensorBoard, checkpoints.
struct Hooks<'a> {
    progress: Progress<'a>,
    tensorboard: TensorBoardHook,
    checkpoints: CheckpointHook<'a>,
}

impl<'a> Hooks<'a> {
    fn of(trainer: &Trainer, console: &'a dyn Console) -> Result<Hooks<'a>, TrainError> {
        let cfg = &trainer.config;
        let leader = trainer.rank() == 0;
        let resumed = trainer.steps_done() > 0;
        let metrics = match leader {
            true => Some(MetricsWriter::open(
                &cfg.run.dir,
                resumed.then_some(trainer.steps_done()),
            )?),
            false => None,
        };
        let checkpoints = CheckpointHook::of(cfg, move |saved: &SaveReport| {
            if leader {
                let path = saved.path.display();
                match saved.write_s {
                    None => say!(console, "checkpoint: {path} ({:.2} s)", saved.blocked_s),
                    Some(w) => say!(
                        console,
                        "checkpoint: {path} (written in the background in {w:.2} s; the steps waited {:.2} s)",
                        saved.blocked_s
                    ),
                }
            }
        });
        let tensorboard = TensorBoardHook(match (leader, cfg.run.tensorboard) {
            (true, true) => {
                let mut w = EventWriter::create(&cfg.run.dir.join("tensorboard"))?;
                if resumed {
                    w.resumed_after(trainer.steps_done())?;
                }
                Some(w)
            }
            _ => None,
        });
        let progress = Progress {
            metrics,
            console,
            log_every: cfg.run.log_every,
        };
        Ok(Hooks {
            progress,
            tensorboard,
            checkpoints,
        })
    }
}

/// One rank's part of [`drive`].
fn drive_rank(mut trainer: Trainer, shared: &Shared) -> Result<Option<Stopped>, TrainError> {
    let console = &*shared.console;
    let leader = trainer.rank() == 0;
    let tracer = shared
        .sink
        .steps()
        .map(|(a, b)| trainer.enable_trace(shared.sink.origin(), a, b));
    trainer.stop_flag = shared.stop.clone();
    let threads = trainer.threads();
    let cfg = trainer.config.clone();
    let peak = Peak::settle(&mut trainer, threads, console)?;
    if leader {
        print_header(&cfg, threads, console)?;
    }
    // Every rank evaluates: tensor, expert and ZeRO-3 shards take part in the collectives.
    // The file is opened and checked before anything is written to the run directory.
    let mut eval = match &cfg.data.eval_path {
        Some(path) => {
            let file = open_tokens(path)?;
            file.check_vocab(cfg.model.vocab)?;
            Some(EvalHook::new(file))
        }
        None => None,
    };
    trainer.faults.abort_in_save = shared.options.abort_in_save;
    let mut hooks = Hooks::of(&trainer, console)?;
    // The trace is collected before evaluation, so that it shows the training steps only.
    let mut collect = CollectTrace {
        sink: shared,
        tracer: tracer.as_deref(),
    };
    if leader {
        console.begin(trainer.steps_done(), cfg.train.steps);
    }
    let steps = {
        let mut list: Vec<&mut dyn StepHook> = vec![
            &mut hooks.progress,
            &mut hooks.tensorboard,
            &mut hooks.checkpoints,
            &mut collect,
        ];
        if let Some(e) = eval.as_mut() {
            list.push(e);
        }
        let steps = trainer.run_with(&mut list);
        if leader {
            console.end();
        }
        steps?
    };
    if let Some(stopped) = trainer.metrics.stopped.clone() {
        stopped_early(&trainer, &steps, &stopped, &hooks.checkpoints, shared)?;
        return Ok(Some(stopped));
    }
    let eval_loss = eval.and_then(|e| e.report).map(|report| {
        if leader {
            let path = cfg.data.eval_path.as_deref().unwrap_or(Path::new(""));
            say!(
                console,
                "eval: loss {:.6} over {} tokens of {}",
                report.loss,
                report.tokens,
                path.display()
            );
        }
        report.loss
    });
    if let (Some(w), Some(loss)) = (hooks.tensorboard.0.as_mut(), eval_loss) {
        let tag = "loss_metrics/eval_loss".to_string();
        w.scalars(trainer.steps_done(), &[(tag, loss)])?;
    }
    finish(
        trainer,
        shared,
        (&steps, eval_loss, &hooks.checkpoints),
        &peak,
    )?;
    Ok(None)
}

/// A run stopped early: the leader writes its `interrupted` summary and says where its
/// checkpoint is (no evaluation, report or saved model: the run did not finish).
fn stopped_early(
    trainer: &Trainer,
    steps: &[StepStats],
    stopped: &Stopped,
    checkpoints: &CheckpointHook,
    shared: &Shared,
) -> Result<(), TrainError> {
    let console = &*shared.console;
    if trainer.rank() != 0 {
        return Ok(());
    }
    let mut summary = trainer.summary(steps, None);
    summary.checkpoint_blocked_s = Some(checkpoints.blocked_s);
    summary.checkpoint_background_s = checkpoints.background.then_some(checkpoints.background_s);
    write_summary(&trainer.config.run.dir, &summary)?;
    if let Ok(mut kept) = shared.summary.lock() {
        *kept = Some(summary);
    }
    let saved = match checkpoints.saved.as_ref().map(|(_, p)| p) {
        Some(path) => format!(
            "checkpoint of step {} in {}; continue with `--resume latest`",
            stopped.step,
            path.display()
        ),
        None => "no checkpoint saved (checkpoint.on_stop = false)".into(),
    };
    say!(
        console,
        "stopped by {} after step {} of {}: {saved}",
        stopped.cause.name(),
        stopped.step,
        trainer.config.train.steps
    );
    Ok(())
}

/// After the last step: this rank's ledger peak for the trace, the model gathered for
/// saving (collective), and on the leader the summary, the report and the saved model.
fn finish(
    trainer: Trainer,
    shared: &Shared,
    (steps, eval_loss, checkpoints): (&[StepStats], Option<f64>, &CheckpointHook),
    peak: &Peak,
) -> Result<(), TrainError> {
    // The run's memory, before gathering the model for saving adds its own buffers.
    let memory = trainer.memory();
    shared.sink.record_peak(memory.total_peak);
    let model = match &shared.options.save_model {
        Some(_) => Some(trainer.gather_model()?),
        None => None,
    };
    if trainer.rank() != 0 {
        return Ok(());
    }
    let cfg = &trainer.config;
    let mut summary = trainer.summary(steps, eval_loss);
    let saves = cfg.checkpoint.every > 0;
    summary.checkpoint_blocked_s = saves.then_some(checkpoints.blocked_s);
    summary.checkpoint_background_s =
        (saves && checkpoints.background).then_some(checkpoints.background_s);
    write_summary(&cfg.run.dir, &summary)?;
    if let Ok(mut kept) = shared.summary.lock() {
        *kept = Some(summary.clone());
    }
    let console = &*shared.console;
    report(&summary, !steps.is_empty(), peak, console);
    say!(console, "memory ledger of rank 0 (per category):\n{memory}");
    if let (Some(dir), Some(model)) = (&shared.options.save_model, model) {
        save(&trainer, dir, &model, shared)?;
    }
    say!(
        console,
        "metrics: {}",
        cfg.run.dir.join("metrics.jsonl").display()
    );
    if !steps.is_empty() {
        match ferrotron_report::write_run_plots(&cfg.run.dir) {
            Ok(paths) => say!(
                console,
                "plots: {}",
                paths
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Err(e) => say!(
                console,
                "warning: cannot draw the charts of run {}: {e}",
                cfg.run.dir.display()
            ),
        }
    }
    Ok(())
}

/// The leader writes the gathered model as a Hugging Face directory `dir` (replacing the
/// model there with `--overwrite`), with its tokenizer.
fn save(
    trainer: &Trainer,
    dir: &Path,
    (layout, weights): &(ferrotron_model::ParamLayout, ferrotron_tensor::Store),
    shared: &Shared,
) -> Result<(), TrainError> {
    let (cfg, options) = (&trainer.config, &shared.options);
    if options.overwrite {
        crate::overwrite::clear_model_dir(
            dir,
            options.init_from.as_deref(),
            cfg.data.path.as_deref(),
        )
        .map_err(|e| TrainError::RunDir(format!("--save-model {}: {e}", dir.display())))?;
    }
    save_model(
        dir,
        &cfg.model,
        layout,
        weights,
        trainer.device().ledger,
        options.max_shard_size,
    )?;
    crate::overwrite::save_tokenizer(options.init_from.as_deref(), cfg, dir, &*shared.console)
        .map_err(TrainError::RunDir)?;
    say!(
        shared.console,
        "saved Hugging Face model to {}",
        dir.display()
    );
    Ok(())
}
