//! The memory estimator: peak bytes per category on every pipeline stage's largest rank.

use ferrotron_config::DType;
use serde::{Deserialize, Serialize};

use crate::activations::{
    block_saved, comm_activations, in_flight, outside, pipeline_messages, recompute_transient,
    workspace,
};
use crate::category::{Category, Memory};
use crate::job::Job;
use crate::layout::{Layout, Recompute, Schedule};
use crate::model::{ModelSpec, Unit};
use crate::shard::{largest_bucket, stage_shard_elems};
use crate::PlanError;

pub use crate::activations::ActivationModel;

/// Bytes per parameter of weights, gradients and optimizer states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteRegime {
    /// Weights used by forward and backward.
    pub weights: u64,
    /// Gradients (including an fp32 accumulation buffer).
    pub gradients: u64,
    /// Optimizer states (fp32 master weights included in mixed precision).
    pub optimizer: u64,
}

impl ByteRegime {
    /// The engine's regimes: f32 4/4/8, bf16 2/2/12, bf16 + fp32 accumulation and fp16 2/6/12.
    pub fn engine(dtype: DType, fp32_grad_accum: bool) -> Self {
        match (dtype, fp32_grad_accum) {
            (DType::F32, _) => ByteRegime {
                weights: 4,
                gradients: 4,
                optimizer: 8,
            },
            (DType::Bf16, false) => ByteRegime {
                weights: 2,
                gradients: 2,
                optimizer: 12,
            },
            (DType::Bf16, true) | (DType::F16, _) => ByteRegime {
                weights: 2,
                gradients: 6,
                optimizer: 12,
            },
        }
    }

    /// The assumption behind the playbook's ZeRO and TP reference figures: bf16 weights and
    /// gradients and 8 bytes of optimizer state (fp32 Adam m and v; the fp32 master copy is
    /// not counted).
    pub fn playbook_figures() -> Self {
        ByteRegime {
            weights: 2,
            gradients: 2,
            optimizer: 8,
        }
    }
}

/// The assumptions an estimate is made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assumptions {
    /// Activation count.
    pub activations: ActivationModel,
    /// Bytes per parameter; `None` = the engine's regime for the layout's dtype.
    pub bytes: Option<ByteRegime>,
}

impl Default for Assumptions {
    /// Engine-exact.
    fn default() -> Self {
        Assumptions {
            activations: ActivationModel::Engine,
            bytes: None,
        }
    }
}

impl Assumptions {
    /// The playbook's mode: Korthikanti activations and the engine's byte regime.
    pub fn playbook() -> Self {
        Assumptions {
            activations: ActivationModel::Korthikanti,
            bytes: None,
        }
    }
}

/// The estimate of one pipeline stage's largest rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageEstimate {
    /// Pipeline rank.
    pub stage: usize,
    /// Blocks it holds.
    pub layers: usize,
    /// Parameters it holds before ZeRO (after TP, PP and EP).
    pub params: u64,
    /// Parameters of its largest ZeRO shard (`params` without ZeRO).
    pub shard: u64,
    /// Micro-batches of activations in flight at its peak.
    pub micro_batches_in_flight: f64,
    /// Activation bytes of its blocks at the peak.
    pub activation_blocks: u64,
    /// Activation bytes outside the blocks (the last stage's head input, or the output being
    /// sent).
    pub activation_outside: u64,
    /// Peak bytes per category.
    pub memory: Memory,
}

/// Per-rank memory of a job, from arithmetic alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Model name.
    pub model: String,
    /// Ψ, every parameter once.
    pub params: u64,
    /// Ranks of the layout.
    pub ranks: usize,
    /// The layout estimated.
    pub layout: Layout,
    /// Assumptions used.
    pub assumptions: Assumptions,
    /// Bytes the first block saves for one micro-batch (the playbook's "per layer").
    pub activation_per_layer: u64,
    /// The stage whose rank needs the most memory.
    pub peak_stage: usize,
    /// That rank's peak bytes per category.
    pub memory: Memory,
    /// Its largest category.
    pub dominant: Category,
    /// Every stage.
    pub stages: Vec<StageEstimate>,
    /// Workspace of a fresh initialisation, before the first step: each rank draws only the
    /// elements it holds, through an f32 scratch of at most [`INIT_SCRATCH_ELEMS`] elements,
    /// while only its weights exist (counted in `memory.workspace` too, the larger of this
    /// and the step's workspace). Loading a checkpoint or a model directory instead holds
    /// the rank's f32 parameters as workspace once.
    pub init_workspace: u64,
    /// Which figures are exact, which follow the playbook's formulas, which are rough.
    pub notes: Vec<String>,
}

impl Estimate {
    /// Total bytes of the peak rank.
    pub fn total(&self) -> u64 {
        self.memory.total()
    }

    /// Whether the peak rank fits in `device_bytes`.
    pub fn fits(&self, device_bytes: u64) -> bool {
        self.total() <= device_bytes
    }
}

/// Weights, gradients and optimizer of one stage: what depends on the model, TP, PP, EP, DP,
/// ZeRO and dtype only (the planner caches it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StageState {
    pub params: u64,
    pub shard: u64,
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub communication: u64,
    pub checkpoint: u64,
}

/// The units of every pipeline rank, in forward order: the embedding on the first, the head
/// on the last (on the first too under DualPipeV).
pub(crate) fn stage_units(model: &ModelSpec, l: &Layout) -> Vec<Vec<Unit>> {
    let stages = l.stage_layers(model.config.layers);
    let head = l.head_rank();
    stages
        .iter()
        .enumerate()
        .map(|(i, layers)| {
            let mut units: Vec<Unit> = layers.iter().map(|&b| Unit::Block(b)).collect();
            if i == 0 {
                units.insert(0, Unit::Embed);
            }
            if i == head {
                units.push(Unit::Head);
            }
            units
        })
        .collect()
}

/// (dense, expert) elements of each unit of a stage on one rank.
pub(crate) fn unit_sizes(model: &ModelSpec, l: &Layout, units: &[Unit]) -> Vec<(u64, u64)> {
    units
        .iter()
        .map(|u| model.unit_elems(*u, l.tp, l.ep, l.pp > 1 && l.head_rank() != 0))
        .collect()
}

/// Bytes per gradient: the regime's, except that the engine's fp16 keeps ZeRO-2/3's shard
/// gradients in fp32 alone (reduced pieces of fp16 gradients, summed without a rounding).
fn grad_bytes(l: &Layout, bytes: ByteRegime) -> u64 {
    let engine_fp16 = ByteRegime::engine(DType::F16, false);
    if l.dtype == DType::F16 && l.zero >= 2 && bytes == engine_fp16 {
        4
    } else {
        bytes.gradients
    }
}

/// The state of every stage.
pub(crate) fn stage_states(model: &ModelSpec, l: &Layout, bytes: ByteRegime) -> Vec<StageState> {
    let elem = l.dtype.size() as u64;
    let bucket_elems = ferrotron_config::bucket_elems(l.bucket_mb, elem as usize) as u64;
    let reducers = l.dp * l.cp;
    stage_units(model, l)
        .iter()
        .map(|units| {
            let elems = unit_sizes(model, l, units);
            let params: u64 = elems.iter().map(|e| e.0 + e.1).sum();
            let shard =
                stage_shard_elems(&elems, bucket_elems, (reducers, reducers / l.ep), l.zero);
            let by = |stage: u8| if l.zero >= stage { shard } else { params };
            let mut communication = 0;
            if reducers > 1 {
                let bucket = largest_bucket(&elems, bucket_elems, l.zero);
                // fp16 buckets (ZeRO-2/3) hold an fp32 accumulation beside the fp16
                // gradient, and fp16 weights travel widened to f32.
                let fp16 = l.dtype == DType::F16;
                let (bucket_bytes, gathered) = if fp16 { (elem + 4, 4) } else { (elem, elem) };
                if l.zero >= 3 {
                    // The bucket being reduced and its copy, the unit in use and the one
                    // prefetched, and this rank's piece of the unit being gathered.
                    let unit = elems.iter().flat_map(|e| [e.0, e.1]).max().unwrap_or(0);
                    communication += 2 * bucket * bucket_bytes
                        + (2 * unit + unit.div_ceil(reducers as u64)) * gathered;
                } else {
                    // Copies of the reductions in flight (about four buckets in the ledger),
                    // in fp32 when an fp32 accumulation buffer is reduced (ZeRO-0/1).
                    let reduced = match l.zero {
                        0 | 1 if l.fp32_grad_accum || fp16 => 4,
                        _ => bucket_bytes,
                    };
                    communication += 4 * bucket * reduced;
                }
            }
            if l.muon_ns_steps.is_some() {
                // Muon's step gathers a bucket's updates and whole matrices, in f32, after
                // the reductions' buffers are gone.
                let bucket = largest_bucket(&elems, bucket_elems, l.zero);
                let (_, muon) = crate::muon::transients(model, l, bucket);
                communication = communication.max(muon);
            }
            StageState {
                params,
                shard,
                weights: bytes.weights * by(3),
                gradients: grad_bytes(l, bytes) * by(2),
                // Aux-loss-free balancing's biases (f32, every block's on every rank).
                optimizer: bytes.optimizer * by(1) + balance_bias_bytes(&model.config),
                communication,
                // f32 master, first and second moments of what the rank owns: its ZeRO shard,
                // or (without ZeRO) everything on data-parallel rank 0, the peak rank.
                checkpoint: if l.async_checkpoint { 12 * by(1) } else { 0 },
            }
        })
        .collect()
}

/// Bytes of aux-loss-free balancing's per-expert biases (`model.moe_balance = "bias"`):
/// one f32 per expert of every mixture-of-experts block, held by every rank.
fn balance_bias_bytes(m: &ferrotron_config::ModelConfig) -> u64 {
    match m.moe_balance {
        ferrotron_config::MoeBalance::Bias => 4 * (m.moe_layers() * m.experts) as u64,
        ferrotron_config::MoeBalance::AuxLoss => 0,
    }
}

/// Engine-exact estimate of `job` (see [`estimate_with`]).
pub fn estimate(job: &Job) -> Result<Estimate, PlanError> {
    estimate_with(job, &Assumptions::default())
}

/// Per-rank peak bytes per category of `job` under `assumptions`, for every pipeline stage;
/// the reported rank is the stage needing the most.
pub fn estimate_with(job: &Job, assumptions: &Assumptions) -> Result<Estimate, PlanError> {
    job.validate()?;
    let l = &job.layout;
    let bytes = assumptions
        .bytes
        .unwrap_or_else(|| ByteRegime::engine(l.dtype, l.fp32_grad_accum));
    let states = stage_states(&job.model, l, bytes);
    Ok(assemble(job, assumptions, &states))
}

/// Elements of the f32 scratch through which the engine writes a rank's initial weights
/// (crates/train `state::INIT_CHUNK`).
pub const INIT_SCRATCH_ELEMS: usize = 1 << 14;

/// Bytes of that scratch on a stage: the chunk, or the weights if fewer.
fn init_scratch(l: &Layout, st: &StageState) -> u64 {
    let held = if l.zero >= 3 { st.shard } else { st.params };
    4 * held.min(INIT_SCRATCH_ELEMS as u64)
}

/// Bytes of Muon's optimizer-step workspace (0 under AdamW).
fn muon_workspace(model: &ModelSpec, l: &Layout) -> u64 {
    match l.muon_ns_steps {
        Some(_) => crate::muon::transients(model, l, 0).0,
        None => 0,
    }
}

/// The blocks' activation peak of pipeline rank `i` holding `chunks` under a schedule that
/// splits backwards (zero bubble, DualPipeV), which also keeps weight-gradient inputs from
/// B to W: its action list replayed. `None` when the list cannot be built.
fn replayed_blocks(
    model: &ModelSpec,
    l: &Layout,
    (i, chunks): (usize, &[Vec<usize>]),
    outside: f64,
) -> Option<f64> {
    let actions = crate::zero_bubble::compute_actions(l, i)?;
    let rank = crate::zero_bubble::Rank { chunks, outside };
    Some(crate::zero_bubble::peak(model, l, &actions, rank) - outside)
}

/// Adds activations, workspace and activation buffers to cached stage states.
pub(crate) fn assemble(job: &Job, assumptions: &Assumptions, states: &[StageState]) -> Estimate {
    let (model, l) = (&job.model, &job.layout);
    let act = assumptions.activations;
    let stages = l.stage_layers(model.config.layers);
    let chunks = l.chunk_layers(model.config.layers);
    let comm_act = comm_activations(model, l);
    let p = stages.len();
    let replay = act == ActivationModel::Engine && l.pp_schedule.splits_backward() && p > 1;
    let per_stage: Vec<StageEstimate> = stages
        .iter()
        .zip(states)
        .enumerate()
        .map(|(i, (layers, st))| {
            let last = i == l.head_rank();
            let flight = in_flight(l, i);
            let out = outside(model, l, act, last);
            let blocks = if replay {
                replayed_blocks(model, l, (i, &chunks[i]), out)
            } else {
                None
            }
            .unwrap_or_else(|| {
                let one: f64 = layers.iter().map(|&b| block_saved(model, l, b, act)).sum();
                one * flight
            });
            let memory = Memory {
                weights: st.weights,
                gradients: st.gradients,
                optimizer: st.optimizer,
                activations: if act == ActivationModel::Engine {
                    (blocks + out)
                        .max(blocks + recompute_transient(model, l, layers))
                        .round() as u64
                } else {
                    (blocks + out).round() as u64
                },
                communication: st.communication
                    + (comm_act + pipeline_messages(model, l, i)).round() as u64,
                workspace: (workspace(model, l, last, layers, act).round() as u64)
                    .max(init_scratch(l, st))
                    .max(muon_workspace(model, l)),
                checkpoint: st.checkpoint,
            };
            StageEstimate {
                stage: i,
                layers: layers.len(),
                params: st.params,
                shard: st.shard,
                micro_batches_in_flight: flight,
                activation_blocks: blocks.round() as u64,
                activation_outside: out.round() as u64,
                memory,
            }
        })
        .collect();
    let peak = per_stage
        .iter()
        .max_by_key(|s| (s.memory.total(), std::cmp::Reverse(s.stage)))
        .map_or(0, |s| s.stage);
    let memory = per_stage.get(peak).map(|s| s.memory).unwrap_or_default();
    Estimate {
        model: model.name.clone(),
        params: model.num_params(),
        ranks: l.world_size(),
        layout: l.clone(),
        assumptions: *assumptions,
        activation_per_layer: block_saved(model, l, 0, act).round() as u64,
        peak_stage: peak,
        memory,
        dominant: memory.dominant(),
        stages: per_stage,
        init_workspace: states.iter().map(|s| init_scratch(l, s)).max().unwrap_or(0),
        notes: notes(model, l, assumptions),
    }
}

fn notes(model: &ModelSpec, l: &Layout, a: &Assumptions) -> Vec<String> {
    // What the engine runs: every dimension, with PP only under ZeRO ≤ 1 and, for tied
    // embeddings, DualPipeV.
    let tied_apart = model.config.tie_embeddings && l.pp_schedule != Schedule::DualPipeV;
    let engine_runs = !(l.pp > 1 && (l.zero >= 2 || tied_apart));
    let mut n = vec![if engine_runs && a.bytes.is_none() {
        "weights, gradients, optimizer: exact (the engine's TP shards, pipeline stages, byte \
         regime and ZeRO bucket shards)"
            .to_string()
    } else {
        "weights, gradients, optimizer: playbook §3 (÷t with norms replicated, blocks per stage, \
         embedding on the first stage and head on the last, experts ÷e), ZeRO shards by the \
         engine's bucket arithmetic"
            .to_string()
    }];
    n.push(
        match (a.activations, engine_runs && l.recompute != Recompute::Full) {
            (ActivationModel::Engine, true) => {
                "activations: exact (the engine's saved tensors and schedule; flash attention, so \
             selective = none)"
                    .into()
            }
            (ActivationModel::Engine, false) => {
                "activations: the engine's per-block count with the \
            playbook's TP/SP/CP/MoE/recompute rules and the schedule's micro-batches in flight"
                    .into()
            }
            (ActivationModel::Korthikanti, _) => {
                "activations: playbook formula s·b·h·(34 + 5·a·s/h) \
            per layer (no flash attention) and fp32 logits"
                    .into()
            }
        },
    );
    n.push(
        "communication and workspace: rough (largest buckets and gathered units, one block's \
        backward transients, one loss chunk)"
            .into(),
    );
    n.push(
        "total: the sum of the categories' peaks, an upper bound on the peak of all categories \
         at once (measured: this sum is 1.00 to 1.50 × that peak)"
            .into(),
    );
    n
}
