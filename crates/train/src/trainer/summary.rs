//! The end-of-run summary (`summary.json`).

use ferrotron_tensor::Category;
use serde::Serialize;

use super::{StepStats, Trainer};

/// The end-of-run summary written to `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// `completed`, or `interrupted` for a run stopped early (a signal, a caller's stop);
    /// a failed run's summary is [`crate::metrics::FailedRun`].
    pub status: &'static str,
    /// What stopped an interrupted run: `SIGTERM`, `SIGINT`, `SIGUSR1`… or `requested`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_by: Option<String>,
    /// The last step an interrupted run took (its checkpoint, where saved, is of this step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_at_step: Option<usize>,
    /// Steps run.
    pub steps: usize,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Mean loss over the last 10% of steps (at least one).
    pub tail_loss: f64,
    /// Mean next-token loss on `data.eval_path`, when set.
    pub eval_loss: Option<f64>,
    /// Median tokens per second over the steps after the first.
    pub tokens_per_s: f64,
    /// MFU at that throughput, against `peak_gflops`.
    pub mfu: Option<f64>,
    /// The MFU denominator: the measured matmul peak of the cores the run occupies (GFLOP/s).
    pub peak_gflops: Option<f64>,
    /// Whether `peak_gflops` is the run's own products' best rate per thread times the
    /// threads it occupies, above the measured peak (taken while the machine was busy, or
    /// stale): MFU never counts the run faster than its own products.
    pub peak_from_products: bool,
    /// Model FLOPs per token, the MFU numerator (see [`crate::mfu`]).
    pub flops_per_token: f64,
    /// Document masking: the keys per token the numerator's attention counts (each
    /// document's full matrix, averaged over the run's tokens); absent without masking,
    /// where it is the window's `seq_len`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_span: Option<f64>,
    /// Parameters Ψ of the whole model (every rank's shards together).
    pub params: usize,
    /// Share of the gradient reductions' execution time that ran while backward was still
    /// computing (steps after the first; None without data parallelism).
    pub reduce_hidden_share: Option<f64>,
    /// Time blocked on gradient reductions after backward, as a share of step time.
    pub reduce_exposed_share: Option<f64>,
    /// Seconds the step loop waited for checkpoint saves, all together (None where the
    /// caller does not save checkpoints).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_blocked_s: Option<f64>,
    /// Seconds rank 0's background checkpoint writes took, all together, while the steps
    /// went on (`checkpoint.async`; None where saves are synchronous).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_background_s: Option<f64>,
    /// Peak bytes per ledger category.
    pub memory_peak_bytes: std::collections::BTreeMap<String, usize>,
    /// Peak bytes of all categories together.
    pub memory_total_peak_bytes: usize,
    /// The run's whole configuration, as resolved (file, overrides and defaults): what
    /// `ferrotron report` compares between runs.
    pub config: ferrotron_config::Config,
}

impl Trainer {
    /// Builds the run summary from the steps' statistics.
    pub fn summary(&self, steps: &[StepStats], eval_loss: Option<f64>) -> RunSummary {
        let mut tps: Vec<f64> = steps.iter().skip(1).map(|s| s.tokens_per_s).collect();
        if tps.is_empty() {
            tps = steps.iter().map(|s| s.tokens_per_s).collect();
        }
        tps.sort_by(|a, b| a.total_cmp(b));
        let median = tps.get(tps.len() / 2).copied().unwrap_or(0.0);
        let tail = (steps.len() / 10).max(1).min(steps.len().max(1));
        let tail_loss = if steps.is_empty() {
            f64::NAN
        } else {
            steps[steps.len() - tail..]
                .iter()
                .map(|s| s.loss)
                .sum::<f64>()
                / tail as f64
        };
        let mem = self.memory();
        let timed: Vec<&StepStats> = steps.iter().skip(1).collect();
        let busy: f64 = timed.iter().map(|s| s.reduce_busy_s).sum();
        let (reduce_hidden_share, reduce_exposed_share) =
            if self.mesh.link(ferrotron_comm::GroupKind::DpCp).is_some() && busy > 0.0 {
                let hidden: f64 = timed.iter().map(|s| s.reduce_hidden_s).sum();
                let exposed: f64 = timed.iter().map(|s| s.reduce_exposed_s).sum();
                let total: f64 = timed.iter().map(|s| s.step_time_s).sum();
                (Some(hidden / busy), Some(exposed / total))
            } else {
                (None, None)
            };
        let stopped = self.metrics.stopped.as_ref();
        RunSummary {
            status: if stopped.is_some() {
                "interrupted"
            } else {
                "completed"
            },
            stopped_by: stopped.map(|s| s.cause.name()),
            stopped_at_step: stopped.map(|s| s.step),
            reduce_hidden_share,
            reduce_exposed_share,
            steps: steps.len(),
            final_loss: steps.last().map(|s| s.loss).unwrap_or(f64::NAN),
            tail_loss,
            eval_loss,
            tokens_per_s: median,
            mfu: self
                .metrics
                .peak_flops
                .map(|p| crate::mfu::mfu(median, self.flops_per_token(), p)),
            peak_gflops: self.metrics.peak_flops.map(|p| p / 1e9),
            peak_from_products: self.metrics.peak_raised,
            checkpoint_blocked_s: None,
            checkpoint_background_s: None,
            flops_per_token: self.flops_per_token(),
            attention_span: self.metrics.spans.mean(),
            params: self.config.model.num_params(),
            memory_peak_bytes: Category::ALL
                .iter()
                .map(|c| (c.name().to_string(), mem.peak(*c)))
                .collect(),
            memory_total_peak_bytes: mem.total_peak,
            config: self.config.clone(),
        }
    }
}
