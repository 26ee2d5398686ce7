//! The parallel layout of a training step: degrees, ZeRO, schedule, recomputation, batch.

use ferrotron_config::{Attention, DType, Matmul, ParallelConfig};
use serde::{Deserialize, Serialize};

use crate::model::ModelSpec;
use crate::{invalid, PlanError};

/// The run configuration's recomputation policy and pipeline schedule: the estimator reads
/// the same values the engine runs.
pub use ferrotron_config::{PpSchedule as Schedule, Recompute};

/// One step's parallel layout and batch: everything besides the model shape that decides
/// memory and time. Its parallel section is the run configuration's own type, the one the
/// engine runs and validation checks ([`ParallelConfig`]); its fields read through
/// (`layout.dp`, `layout.pp_schedule`, …).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// Degrees (`dp`, `tp`, `pp`, `cp`, `ep`), ZeRO stage, sequence parallelism,
    /// recomputation, pipeline schedule, virtual stages, stage split, gradient bucket size.
    pub parallel: ParallelConfig,
    /// Sequences per micro-batch per data-parallel rank `b`.
    pub micro_batch: usize,
    /// Micro-batches per step `m`.
    pub grad_accum: usize,
    /// Storage dtype (f32, or bf16 mixed precision).
    pub dtype: DType,
    /// bf16 with an fp32 gradient-accumulation buffer.
    pub fp32_grad_accum: bool,
    /// Tokens per LM-head/cross-entropy chunk.
    pub loss_chunk: usize,
    /// The matmuls run on the host (`gemm`, the CPU backend), whose packing scratch the
    /// engine counts as workspace; `false` for a GPU.
    #[serde(default)]
    pub host_matmul: bool,
    /// The host's matmul library (`train.matmul`): `gemm` packs per call, OpenBLAS keeps a
    /// buffer per compute thread.
    #[serde(default)]
    pub matmul: Matmul,
    /// How a GPU runs attention (`train.attention`): with `"products"` the backend holds
    /// score buffers for the whole run.
    #[serde(default)]
    pub attention: Attention,
    /// Compute threads per rank (`train.threads`; 0 = the machine's cores shared among the
    /// ranks of one pipeline stage, as the engine does).
    #[serde(default)]
    pub threads: usize,
    /// Checkpoints written in the background (`checkpoint.async` with saves): each rank holds
    /// a host snapshot of its owned state while the next steps run.
    #[serde(default)]
    pub async_checkpoint: bool,
    /// Document masking (`data.document_mask`): each rank holds its tokens' document starts
    /// for the micro-batch in hand.
    #[serde(default)]
    pub document_mask: bool,
    /// Muon's Newton–Schulz iterations when `train.optimizer = "muon"` (`None`: AdamW): its
    /// optimizer step gathers whole matrices and orthogonalises them (`crates/plan/src/muon.rs`).
    #[serde(default)]
    pub muon_ns_steps: Option<usize>,
    /// FP8 linear layers (`train.fp8`, emulated): each product holds FP8 copies of its two
    /// operands as workspace.
    #[serde(default)]
    pub fp8: bool,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            parallel: ParallelConfig::default(),
            micro_batch: 1,
            grad_accum: 1,
            dtype: DType::Bf16,
            fp32_grad_accum: false,
            loss_chunk: 256,
            host_matmul: false,
            matmul: Matmul::Gemm,
            attention: Attention::Tiles,
            threads: 0,
            async_checkpoint: false,
            document_mask: false,
            muon_ns_steps: None,
            fp8: false,
        }
    }
}

impl std::ops::Deref for Layout {
    type Target = ParallelConfig;
    fn deref(&self) -> &ParallelConfig {
        &self.parallel
    }
}

impl std::ops::DerefMut for Layout {
    fn deref_mut(&mut self) -> &mut ParallelConfig {
        &mut self.parallel
    }
}

impl Layout {
    /// This layout with `f` applied to it.
    pub fn with(mut self, f: impl FnOnce(&mut Layout)) -> Layout {
        f(&mut self);
        self
    }
}

/// Largest degree, micro-batch or accumulation count accepted (keeps every product finite).
const MAX_DEGREE: usize = ferrotron_config::MAX_COUNT;

impl Layout {
    /// Chunks per rank: `virtual_stages` for the interleaved schedule, 2 for DualPipeV, else 1.
    pub fn chunks(&self) -> usize {
        self.pp_schedule.chunks(self.virtual_stages)
    }

    /// The pipeline rank that holds the LM head: the last, or rank 0 under DualPipeV's V.
    pub fn head_rank(&self) -> usize {
        let p = self.pp.max(1);
        let last = p * self.chunks().max(1) - 1;
        self.pp_schedule.placement().owner(p, last).0
    }

    /// The blocks each pipeline rank holds, in forward order: the engine's split
    /// ([`ferrotron_schedule::stage_sizes`]; virtual stage `k` of `p·v` goes to rank `k mod p`,
    /// or to DualPipeV's V).
    pub fn stage_layers(&self, layers: usize) -> Vec<Vec<usize>> {
        self.chunk_layers(layers)
            .into_iter()
            .map(|chunks| chunks.into_iter().flatten().collect())
            .collect()
    }

    /// The blocks of each chunk of each pipeline rank (`[rank][chunk]`), in chunk order.
    pub fn chunk_layers(&self, layers: usize) -> Vec<Vec<Vec<usize>>> {
        let p = self.pp.max(1);
        let sizes = ferrotron_schedule::stage_sizes(
            layers,
            p,
            self.chunks().max(1),
            self.pp_layers.as_deref(),
        );
        let placement = self.pp_schedule.placement();
        (0..p)
            .map(|rank| {
                ferrotron_schedule::rank_chunks(&sizes, p, rank, placement)
                    .into_iter()
                    .map(|r| r.collect())
                    .collect()
            })
            .collect()
    }

    /// A short description, the one every command prints
    /// ([`ferrotron_config::ParallelConfig::describe`]):
    /// `DP4 TP2 PP4(1f1b 9×2/8/6) ZeRO-1 SP b=1 m=64 recompute=full`.
    pub fn describe(&self) -> String {
        self.parallel.describe(self.micro_batch, self.grad_accum)
    }

    /// Checks the layout against `model` (divisibility, schedule, ranges).
    pub fn validate(&self, model: &ModelSpec) -> Result<(), PlanError> {
        self.validate_counts()?;
        let c = &model.config;
        for (what, n) in [("heads", c.heads), ("kv_heads", c.kv_heads), ("ffn", c.ffn)] {
            if n % self.tp != 0 {
                return Err(invalid(
                    "parallel.tp",
                    format!("tp={} does not divide model.{what}={n}", self.tp),
                ));
            }
        }
        if self.fp8 && (self.cp > 1 || model.moe.is_some()) {
            // The run configuration refuses these too (`Config::validate`); the planner's
            // configuration is dense and one rank wide, so they are checked again here.
            return Err(invalid(
                "train.fp8",
                "is emulated for dense blocks without context parallelism: use a dense model \
                 and cp = 1, or train.fp8 = \"off\"",
            ));
        }
        if self.cp > 1 && model.config.moe_capacity_factor.is_some() {
            return Err(invalid(
                "model.moe_capacity_factor",
                format!(
                    "with cp={}: each context-parallel rank routes only its share of a \
                     micro-batch, so the tokens dropped would depend on the layout; use cp = 1",
                    self.cp
                ),
            ));
        }
        if self.cp > 1 && self.cp_kind == ferrotron_config::CpKind::Ulysses {
            let kv = c.kv_heads / self.tp;
            let kv_ok = kv.is_multiple_of(self.cp) || self.cp.is_multiple_of(kv);
            for (what, n, ok) in [
                (
                    "heads",
                    c.heads,
                    (c.heads / self.tp).is_multiple_of(self.cp),
                ),
                ("kv_heads", c.kv_heads, kv_ok),
            ] {
                if !ok {
                    return Err(invalid(
                        "parallel.cp_kind",
                        format!(
                            "\"ulysses\" cannot deal model.{what}={n} / tp={} over cp={}",
                            self.tp, self.cp
                        ),
                    ));
                }
            }
        }
        self.validate_pipeline(c.layers)?;
        self.validate_rest(model)
    }

    /// Degrees, batch counts and ranks within bounds; ZeRO's stage.
    fn validate_counts(&self) -> Result<(), PlanError> {
        for (name, value) in [
            ("parallel.dp", self.dp),
            ("parallel.tp", self.tp),
            ("parallel.pp", self.pp),
            ("parallel.cp", self.cp),
            ("parallel.ep", self.ep),
            ("parallel.virtual_stages", self.virtual_stages),
            ("train.micro_batch", self.micro_batch),
            ("train.grad_accum", self.grad_accum),
            ("train.loss_chunk", self.loss_chunk),
        ] {
            if value == 0 || value > MAX_DEGREE {
                return Err(invalid(
                    name,
                    format!("{value}: must be in 1..={MAX_DEGREE}"),
                ));
            }
        }
        let world = [self.tp, self.pp, self.cp]
            .iter()
            .try_fold(self.dp, |acc, &x| {
                acc.checked_mul(x).filter(|w| *w <= MAX_DEGREE)
            });
        if world.is_none() {
            return Err(invalid("parallel", format!("more than {MAX_DEGREE} ranks")));
        }
        if self.zero > 3 {
            return Err(invalid("parallel.zero", "ZeRO stages are 0, 1, 2 and 3"));
        }
        Ok(())
    }

    /// The pipeline over `layers` blocks: its degree, schedule, stage split and units.
    fn validate_pipeline(&self, layers: usize) -> Result<(), PlanError> {
        if self.pp > layers {
            return Err(invalid(
                "parallel.pp",
                format!("pp={} exceeds the {} layers", self.pp, layers),
            ));
        }
        match self.pp_schedule {
            Schedule::Interleaved if self.pp < 2 || self.virtual_stages < 2 => {
                return Err(invalid(
                    "parallel.virtual_stages",
                    "the interleaved schedule needs pp >= 2 and virtual_stages >= 2",
                ));
            }
            Schedule::Interleaved => {}
            Schedule::DualPipeV if self.virtual_stages != 1 => {
                return Err(invalid(
                    "parallel.virtual_stages",
                    "DualPipeV holds 2 chunks per rank by itself; leave virtual_stages at 1",
                ));
            }
            Schedule::DualPipeV if self.pp > 1 && self.grad_accum < 2 * self.pp => {
                return Err(invalid(
                    "train.grad_accum",
                    format!(
                        "DualPipeV needs at least 2·pp = {} micro-batches, got {}",
                        2 * self.pp,
                        self.grad_accum
                    ),
                ));
            }
            _ if self.virtual_stages != 1 => {
                return Err(invalid(
                    "parallel.virtual_stages",
                    "virtual_stages > 1 needs pp_schedule = \"interleaved\"",
                ));
            }
            _ => {}
        }
        // The engine's stage split and its checks (crates/schedule): what is estimated runs.
        let list = self.pp_layers.as_deref();
        match ferrotron_schedule::check_split(layers, self.pp, self.chunks(), list) {
            Ok(()) => {}
            Err(e @ ferrotron_schedule::ScheduleError::BadStageList { .. }) => {
                return Err(invalid("parallel.pp_layers", e.to_string()))
            }
            Err(e) => return Err(invalid("model.layers", e.to_string())),
        }
        let units = self.pp.saturating_mul(self.grad_accum);
        if self.pp > 1 && units.saturating_mul(self.chunks()) > ferrotron_schedule::MAX_UNITS {
            return Err(invalid(
                "train.grad_accum",
                format!(
                    "pp × grad_accum × virtual_stages above {} pipeline units: lower one of them",
                    ferrotron_schedule::MAX_UNITS
                ),
            ));
        }
        Ok(())
    }

    /// Context parallelism's chunks, expert parallelism, the buckets and the bf16
    /// regime's accumulation.
    fn validate_rest(&self, model: &ModelSpec) -> Result<(), PlanError> {
        let c = &model.config;
        if self.cp > 1 && self.attention == Attention::Products {
            return Err(invalid(
                "train.attention",
                "train.attention = \"products\" runs attention over whole sequences; with parallel.cp > 1 attention runs as ring blocks in the tiled kernels: drop it",
            ));
        }
        if self.cp > 1 && !c.seq_len.is_multiple_of(2 * self.cp) {
            return Err(invalid(
                "parallel.cp",
                format!(
                    "seq_len={} is not divisible by 2·cp={} (zig-zag chunks)",
                    c.seq_len,
                    2 * self.cp
                ),
            ));
        }
        match &model.moe {
            None if self.ep > 1 => {
                return Err(invalid(
                    "parallel.ep",
                    "expert parallelism needs a mixture-of-experts model (model.experts)",
                ));
            }
            Some(m) if m.experts % self.ep != 0 || !self.dp.is_multiple_of(self.ep) => {
                return Err(invalid(
                    "parallel.ep",
                    format!(
                        "ep={} must divide both model.experts={} and parallel.dp={}",
                        self.ep, m.experts, self.dp
                    ),
                ));
            }
            _ => {}
        }
        if !(self.bucket_mb.is_finite() && self.bucket_mb > 0.0) {
            return Err(invalid("parallel.bucket_mb", "must be positive"));
        }
        if self.fp32_grad_accum && self.dtype == DType::F32 {
            return Err(invalid(
                "train.fp32_grad_accum",
                "only meaningful with train.dtype = \"bf16\"",
            ));
        }
        Ok(())
    }
}

/// The LM head's forward compute in blocks: `2·h·v` over the mean forward FLOPs per token
/// of a block (attention over the full `s × s` matrix), the weight [`balanced_pp_layers`]
/// gives the head on the last stage.
pub fn head_blocks(model: &ModelSpec) -> f64 {
    let layers = model.config.layers.max(1);
    let block: f64 = (0..layers)
        .map(|l| model.layer_forward_flops_per_token(l, false))
        .sum::<f64>()
        / layers as f64;
    model.head_forward_flops_per_token() / block
}

/// Blocks per pipeline stage that balance compute (nanotron partitions its pipeline by cost):
/// the LM head counts as `h_eff = 2·h·v / (mean forward FLOPs of a block)` blocks on the last
/// stage, which gets `round((L + h_eff)/p − h_eff)` blocks (at least 1, at most `L − p + 1`);
/// the other stages share the rest, the first ones one more. For `pp_layers` with one chunk
/// per rank.
pub fn balanced_pp_layers(model: &ModelSpec, pp: usize) -> Vec<usize> {
    let layers = model.config.layers;
    let p = pp.clamp(1, layers.max(1));
    if p == 1 {
        return vec![layers];
    }
    let h_eff = head_blocks(model);
    let ideal = (layers as f64 + h_eff) / p as f64 - h_eff;
    let last = (ideal.round().max(1.0) as usize).min(layers - p + 1);
    let rest = layers - last;
    (0..p)
        .map(|i| {
            if i + 1 == p {
                last
            } else {
                rest / (p - 1) + usize::from(i < rest % (p - 1))
            }
        })
        .collect()
}

/// DualPipeV's `pp_layers` (`2p` stages) that balance compute the same way: rank 0, which
/// holds the head, gets the head stage's count of [`balanced_pp_layers`] and the other ranks
/// share the rest; each rank's blocks are split between its stages `r` (one more when odd)
/// and `2p−1−r`. `None` when a rank would hold fewer than 2 blocks (the even split then).
pub fn balanced_v_layers(model: &ModelSpec, pp: usize) -> Option<Vec<usize>> {
    let mut per_rank = balanced_pp_layers(model, pp);
    if per_rank.len() != pp || per_rank.iter().any(|&n| n < 2) {
        return None;
    }
    per_rank.reverse();
    let mut stages = vec![0; 2 * pp];
    for (r, n) in per_rank.into_iter().enumerate() {
        stages[r] = n - n / 2;
        stages[2 * pp - 1 - r] = n / 2;
    }
    Some(stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_follow_pp_layers_or_split_evenly() {
        let l = Layout::default().with(|l| {
            l.pp = 3;
        });
        let s = l.stage_layers(8);
        assert_eq!(s.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 2]);
        let l = Layout::default().with(|l| {
            l.pp = 2;
            l.pp_schedule = Schedule::Interleaved;
            l.virtual_stages = 2;
        });
        assert_eq!(l.stage_layers(8), [vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
        let l = l.clone().with(|l| {
            l.pp_layers = Some(vec![1, 2, 3, 2]);
        });
        assert_eq!(l.stage_layers(8), [vec![0, 3, 4, 5], vec![1, 2, 6, 7]]);
    }

    #[test]
    fn balanced_split_puts_fewer_blocks_with_the_head() {
        // Llama-3 8B: the head is 2.09 blocks of compute, so the last of 4 stages takes 6.
        let l8 = ModelSpec::preset("llama3-8b").unwrap();
        assert_eq!(balanced_pp_layers(&l8, 4), [9, 9, 8, 6]);
        let tiny = ModelSpec::preset("tiny").unwrap();
        assert_eq!(balanced_pp_layers(&tiny, 3), [2, 1, 1]);
        assert_eq!(balanced_pp_layers(&tiny, 1), [4]);
    }
}
