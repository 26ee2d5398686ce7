//! `bench-pipeline`'s measurement: each pipeline rank's idle time inside a step, for every
//! schedule, against the theory of bubble over compute — ranks as threads of this process.

use ferrotron_config::{Config, ConfigError, PpSchedule};
use ferrotron_train::launch::on_thread_ranks;
use ferrotron_train::{Init, TrainError};

/// The schedules measured: the schedule, its virtual stages per rank, its name.
pub const SCHEDULES: [(PpSchedule, usize, &str); 5] = [
    (PpSchedule::Afab, 1, "afab"),
    (PpSchedule::OneFOneB, 1, "1f1b"),
    (PpSchedule::Interleaved, 2, "interleaved v=2"),
    (PpSchedule::ZeroBubble, 1, "zero_bubble"),
    (PpSchedule::DualPipeV, 1, "dualpipev"),
];

/// One measurement's layout: `pp` stages under `schedule` with `virtual_stages`, `m`
/// micro-batches, one warm-up and `steps` timed steps.
#[derive(Debug, Clone, Copy)]
pub struct PipelineCase {
    /// Pipeline stages.
    pub pp: usize,
    /// The schedule.
    pub schedule: PpSchedule,
    /// Virtual stages per rank (interleaved).
    pub virtual_stages: usize,
    /// Micro-batches per step.
    pub m: usize,
    /// Timed steps.
    pub steps: usize,
}

/// The measured model: 8 blocks of hidden 128 on one thread per rank, with `sets` on top.
///
/// # Errors
///
/// An override the configuration refuses.
pub fn base_config(sets: &[String]) -> Result<Config, ConfigError> {
    let mut all = vec![
        "model.hidden=128".to_string(),
        "model.layers=8".into(),
        "model.ffn=384".into(),
        "model.seq_len=64".into(),
        "train.micro_batch=2".into(),
        "train.threads=1".into(),
    ];
    all.extend(sets.iter().cloned());
    Config::load(None, &all)
}

impl PipelineCase {
    /// The run's configuration: `base` ([`base_config`]) laid out as this case says.
    ///
    /// # Errors
    ///
    /// A layout the schedule refuses (e.g. interleaved needs `m` divisible by `pp`,
    /// DualPipeV `m ≥ 2·pp`).
    pub fn config(&self, base: &Config) -> Result<Config, ConfigError> {
        let mut c = base.clone();
        c.parallel.pp = self.pp;
        c.parallel.pp_schedule = self.schedule;
        c.parallel.virtual_stages = self.virtual_stages;
        c.train.grad_accum = self.m;
        c.train.steps = self.steps + 1;
        c.validate()?;
        Ok(c)
    }

    /// Theory's bubble over compute, with backward = 2 × forward (zero bubble and
    /// DualPipeV: B = W = F).
    pub fn bubble(&self) -> f64 {
        let (p, m) = (self.pp as f64 - 1.0, self.m as f64);
        match self.schedule {
            PpSchedule::ZeroBubble => p / (3.0 * m),
            PpSchedule::DualPipeV => p / (6.0 * m),
            _ => p / (self.virtual_stages as f64 * m),
        }
    }
}

/// Each rank's share of its timed steps spent waiting for activations or gradients.
///
/// # Errors
///
/// A rank's failure.
pub fn idle_shares(config: &Config) -> Result<Vec<f64>, TrainError> {
    on_thread_ranks(config, Init::Fresh, |mut t| {
        let stats = t.run(|_| {})?;
        let timed = &stats[1..];
        let wait: f64 = timed.iter().map(|s| s.pipeline_wait_s).sum();
        let total: f64 = timed.iter().map(|s| s.step_time_s).sum();
        Ok(wait / total)
    })
}
