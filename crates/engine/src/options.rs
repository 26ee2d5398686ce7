//! What a run is asked to do beyond its configuration: `ferrotron train`'s flags, as a
//! library caller sets them.

use std::path::PathBuf;

use crate::{ensure, EngineError, Result};

/// A run's options (the command line's flags of `ferrotron train`).
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// TOML configuration file (defaults for every missing key).
    pub config: Option<PathBuf>,
    /// The configuration as TOML text instead of a file (a library caller's, e.g. Python's
    /// dict); it takes the place of `config`.
    pub config_toml: Option<String>,
    /// Overrides applied on top, `SECTION.KEY=VALUE` each.
    pub set: Vec<String>,
    /// Start from a Hugging Face Llama directory; its config.json gives the model shape
    /// (model.seq_len stays the run's).
    pub init_from: Option<PathBuf>,
    /// Write the final model as a Hugging Face directory here.
    pub save_model: Option<PathBuf>,
    /// Largest weight file of `save_model`, in bytes; bigger models are sharded.
    pub max_shard_size: u64,
    /// Describe the grid of ranks and each rank's groups, and train nothing.
    pub dry_run: bool,
    /// Skip the check, before any work, that the run fits the memory available.
    pub no_memory_check: bool,
    /// Replace a previous run's results in `run.dir`, its checkpoints there and the model
    /// at `save_model`.
    pub overwrite: bool,
    /// Record a per-rank timeline and write the step report.
    pub trace: bool,
    /// Steps to trace, `FIRST-LAST` (1-based, inclusive); default: steps 2–3, or every step
    /// of a shorter run.
    pub trace_steps: Option<String>,
    /// Fault injection for failure tests: `RANK:STEP`, that rank fails in that step.
    pub fail_rank_at: Option<String>,
    /// Continue from a checkpoint: a `step_N` folder, a checkpoint root, or `latest`.
    pub resume: Option<PathBuf>,
    /// With `resume`: continue on other data than the checkpoint consumed.
    pub allow_data_change: bool,
    /// Fault injection for checkpoint tests: abort while saving this step's checkpoint.
    pub abort_in_save: Option<usize>,
    /// Catch SIGTERM, SIGINT and SIGUSR1: the run stops after the step every rank agrees
    /// on, saves a checkpoint of it, and the process exits `run.signal_grace_s` later if
    /// that has not finished; a second signal exits at once. Off by default for a library
    /// caller (the handlers are the process's); `ferrotron train` sets it.
    pub signals: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            config: None,
            config_toml: None,
            set: Vec::new(),
            init_from: None,
            save_model: None,
            max_shard_size: 50_000_000_000,
            dry_run: false,
            no_memory_check: false,
            overwrite: false,
            trace: false,
            trace_steps: None,
            fail_rank_at: None,
            resume: None,
            allow_data_change: false,
            abort_in_save: None,
            signals: false,
        }
    }
}

impl TrainOptions {
    /// The configuration these options name (the file or text, and the overrides).
    pub(crate) fn load_config(&self) -> Result<ferrotron_config::Config> {
        let config = match &self.config_toml {
            Some(text) => ferrotron_config::Config::from_toml_with_overrides(text, &self.set)?,
            None => ferrotron_config::Config::load(self.config.as_deref(), &self.set)?,
        };
        Ok(config)
    }

    /// Whether the configuration is the caller's (a file or text), not a checkpoint's.
    pub(crate) fn gives_config(&self) -> bool {
        self.config.is_some() || self.config_toml.is_some()
    }

    /// The traced steps of a run that trains steps `first..=last`, if it is traced.
    pub(crate) fn traced_steps(&self, first: usize, last: usize) -> Result<Option<(usize, usize)>> {
        Ok(match (self.trace, &self.trace_steps) {
            (false, _) => None,
            (true, Some(spec)) => Some(parse_steps(spec, first..=last)?),
            (true, None) if last >= 3 => Some((2, 3)),
            (true, None) => Some((1, last.max(1))),
        })
    }

    /// The injected failure, `(rank, step)`.
    pub(crate) fn fault(&self) -> Result<Option<(usize, usize)>> {
        let Some(spec) = self.fail_rank_at.as_deref() else {
            return Ok(None);
        };
        let bad = || EngineError::Refused(format!("--fail-rank-at {spec}: takes RANK:STEP"));
        let (r, s) = spec.split_once(':').ok_or_else(bad)?;
        Ok(Some((
            r.parse().map_err(|_| bad())?,
            s.parse().map_err(|_| bad())?,
        )))
    }
}

/// `--trace-steps FIRST-LAST` (or one step), within the steps `run` this run trains.
fn parse_steps(spec: &str, run: std::ops::RangeInclusive<usize>) -> Result<(usize, usize)> {
    let (a, b) = spec.split_once('-').unwrap_or((spec, spec));
    let number = |text: &str, which: &str| {
        text.trim()
            .parse::<usize>()
            .map_err(|e| EngineError::Refused(format!("--trace-steps {spec}: {which}: {e}")))
    };
    let (a, b) = (number(a, "FIRST")?, number(b, "LAST")?);
    ensure(a >= 1 && a <= b, || {
        format!("--trace-steps {spec}: need 1 ≤ FIRST ≤ LAST")
    })?;
    ensure(run.contains(&a) && run.contains(&b), || {
        format!(
            "--trace-steps {spec}: this run trains steps {}–{} (train.steps = {}{}): trace \
             steps within them",
            run.start(),
            run.end(),
            run.end(),
            if *run.start() > 1 {
                ", resumed after the checkpoint's"
            } else {
                ""
            }
        )
    })?;
    Ok((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default largest weight file is the command line's default, transformers' 50GB.
    #[test]
    fn the_default_shard_size_is_the_command_lines() {
        let cli = ferrotron_train::hf::shards::parse_size("50GB").unwrap();
        assert_eq!(TrainOptions::default().max_shard_size, cli);
    }

    #[test]
    fn trace_steps_outside_the_run_are_refused() {
        assert_eq!(parse_steps("2-3", 1..=5).unwrap(), (2, 3));
        assert_eq!(parse_steps("4", 1..=5).unwrap(), (4, 4));
        let late = parse_steps("5-9", 1..=3).unwrap_err().to_string();
        assert!(late.contains("trains steps 1–3"), "{late}");
        let resumed = parse_steps("2-3", 3..=5).unwrap_err().to_string();
        assert!(resumed.contains("resumed"), "{resumed}");
        assert!(parse_steps("3-2", 1..=5).is_err());
        assert!(parse_steps("x", 1..=5).is_err());
    }
}
