//! Mixture-of-experts pieces of a trainer: the groups its buckets are reduced over, and what
//! a step's mixture-of-experts blocks measured.

use ferrotron_config::Config;
use ferrotron_model::MoeReport;
use ferrotron_tensor::{Category, Ledger};

/// The label of the transfers that carry the step's mixture-of-experts statistics.
const MOE_STATISTICS: &str = "moe statistics";
use serde::Serialize;

use super::Trainer;
use crate::optim::all_reduce_f64;
use crate::TrainError;
use ferrotron_parallel::data_parallel::{GroupComm, ReduceGroups};

/// What a mixture-of-experts step measured over its global batch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoeStats {
    /// Mean of the load-balancing loss `aux` (Hugging Face's, over all blocks) over every
    /// (data-parallel rank, micro-batch) pair.
    pub aux_loss: f64,
    /// Assignments per expert of every mixture-of-experts block (in block order), summed over
    /// the global batch: `top_k` per token, as routed (before any dropping).
    pub expert_counts: Vec<Vec<u64>>,
    /// Assignments every mixture-of-experts block dropped over capacity (in block order),
    /// summed over the global batch; empty when dropless.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<u64>,
}

impl Trainer {
    /// The groups this rank's gradient buckets are reduced over.
    pub(crate) fn reduce_groups(&self) -> ReduceGroups<'_> {
        self.mesh.reduce_groups()
    }
}

/// The step's mixture-of-experts figures over the global batch from this rank's report:
/// summed over the pipeline stages (blocks and the last stage's aux) and the data × context
/// parallel ranks of `dp` (their tokens). Tensor-parallel ranks computed identical figures.
/// None for a dense model.
pub(super) fn moe_stats(
    config: &Config,
    report: MoeReport,
    pp: Option<&GroupComm>,
    dp: Option<&GroupComm>,
    ledger: &Ledger,
) -> Result<Option<MoeStats>, TrainError> {
    let m = &config.model;
    if m.moe_layers() == 0 {
        return Ok(None);
    }
    let layers: Vec<usize> = (0..m.layers).filter(|&l| m.is_moe_layer(l)).collect();
    let mut counts: Vec<f32> = Vec::with_capacity(layers.len() * m.experts);
    for l in &layers {
        match report.counts.get(l) {
            Some(c) => counts.extend(c.iter().map(|&x| x as f32)),
            None => counts.extend(std::iter::repeat_n(0.0, m.experts)),
        }
    }
    // The dropped assignments of every block ride behind the counts.
    counts.extend(
        layers
            .iter()
            .map(|l| report.dropped.get(l).copied().unwrap_or(0.0) as f32),
    );
    let mut aux = report.aux_sum;
    for g in [pp, dp].into_iter().flatten() {
        aux = all_reduce_f64(g, ledger, aux, MOE_STATISTICS)?;
        // Counts are integers below 2²⁴: exact in f32.
        let mine = ledger.upload(Category::Communication, MOE_STATISTICS, &counts);
        let h = g.comm.all_reduce(
            &g.group,
            ferrotron_comm::CommBuf::F32(mine),
            ferrotron_comm::ReduceOp::Sum,
        );
        let summed = g.comm.wait(h, MOE_STATISTICS)?;
        let summed = summed
            .into_f32()
            .unwrap_or_else(|_| unreachable!("f32 reductions return f32"));
        counts = ledger.download(MOE_STATISTICS, &summed);
    }
    // Every context-parallel rank of a micro-batch recorded its (whole) aux.
    let pairs = config.train.grad_accum * config.parallel.dp * config.parallel.cp;
    let dropped = counts.split_off(layers.len() * m.experts);
    Ok(Some(MoeStats {
        aux_loss: aux / pairs as f64,
        expert_counts: counts
            .chunks(m.experts)
            .map(|c| c.iter().map(|&x| x as u64).collect())
            .collect(),
        dropped: match m.moe_capacity_factor {
            Some(_) => dropped.iter().map(|&x| x as u64).collect(),
            None => Vec::new(),
        },
    }))
}
