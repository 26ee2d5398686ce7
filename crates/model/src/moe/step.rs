//! The mixture-of-experts state of one step: the load-balancing statistics of every
//! micro-batch in flight, summed over the blocks (and, under context parallelism, over the
//! ring), and what the step's blocks measured.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use ferrotron_config::ModelConfig;
use ferrotron_tensor::moe::{aux_loss, AuxStats};

use crate::strategy::ExpertParallel;

/// Load-balancing statistics of one micro-batch: summed over the blocks seen so far, then
/// (after the last block's forward) over all blocks.
#[derive(Default)]
struct MicroAux {
    sum: Option<AuxStats>,
    total: Option<AuxStats>,
}

/// What one step's mixture-of-experts blocks measured on this rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeReport {
    /// Sum of `aux` over the micro-batches whose forward finished on this rank.
    pub aux_sum: f64,
    /// Assignments per expert of every mixture-of-experts block (global index) this rank
    /// routed (before any dropping), summed over micro-batches.
    pub counts: BTreeMap<usize, Vec<f64>>,
    /// Assignments dropped over capacity in every mixture-of-experts block (global index),
    /// summed over micro-batches (none without `model.moe_capacity_factor`).
    pub dropped: BTreeMap<usize, f64>,
}

/// The mixture-of-experts state of one step: the expert-parallel group, the weight of the
/// load-balancing loss and the routing statistics of each micro-batch in flight (keyed by
/// [`crate::StepCtx::micro_batch`]).
pub struct MoeStep<'a> {
    /// The expert-parallel group (None: this rank holds every expert).
    pub ep: Option<&'a dyn ExpertParallel>,
    /// Weight of one micro-batch's `aux` in the training loss: `router_aux_loss_coef /
    /// (data-parallel ranks × micro-batches per step)`.
    pub aux_weight: f64,
    /// Aux-loss-free balancing's bias of each block's experts, by block index (empty for a
    /// dense block); None: routed by the probabilities alone.
    bias: Option<&'a [Vec<f32>]>,
    experts: usize,
    pub(crate) moe_layers: usize,
    micro: Mutex<HashMap<usize, MicroAux>>,
    report: Mutex<MoeReport>,
}

impl<'a> MoeStep<'a> {
    /// The state of a step of `cfg` (any model; inert for a dense one).
    pub fn new(cfg: &ModelConfig, ep: Option<&'a dyn ExpertParallel>, aux_weight: f64) -> Self {
        MoeStep {
            ep,
            aux_weight,
            bias: None,
            experts: cfg.experts,
            moe_layers: cfg.moe_layers(),
            micro: Mutex::new(HashMap::new()),
            report: Mutex::new(MoeReport::default()),
        }
    }

    /// This state with aux-loss-free balancing's per-expert `bias`, by block index.
    pub fn with_bias(self, bias: &'a [Vec<f32>]) -> Self {
        MoeStep {
            bias: Some(bias),
            ..self
        }
    }

    /// The balancing bias of block `layer`'s experts, where there is one.
    pub(crate) fn bias(&self, layer: usize) -> Option<&'a [f32]> {
        self.bias
            .and_then(|b| b.get(layer))
            .map(Vec::as_slice)
            .filter(|b| !b.is_empty())
    }

    fn with<R>(&self, mb: usize, f: impl FnOnce(&mut MicroAux) -> R) -> R {
        let mut map = self.micro.lock().expect("moe state lock");
        f(map.entry(mb).or_default())
    }

    /// Adds block `layer`'s statistics to micro-batch `mb`'s.
    pub(crate) fn add_layer(&self, mb: usize, layer: usize, stats: &AuxStats) {
        self.with(mb, |m| match &mut m.sum {
            Some(s) => s.add(stats),
            None => m.sum = Some(stats.clone()),
        });
        let mut r = self.report.lock().expect("moe report lock");
        let c = r
            .counts
            .entry(layer)
            .or_insert_with(|| vec![0.0; self.experts]);
        c.iter_mut().zip(&stats.counts).for_each(|(a, b)| *a += b);
    }

    /// Block `layer` dropped `n` assignments over capacity.
    pub(crate) fn add_dropped(&self, layer: usize, n: usize) {
        let mut r = self.report.lock().expect("moe report lock");
        *r.dropped.entry(layer).or_default() += n as f64;
    }

    /// Micro-batch `mb`'s statistics summed over the blocks (None for a dense model).
    pub(crate) fn take_sum(&self, mb: usize) -> Option<AuxStats> {
        if self.moe_layers == 0 {
            return None;
        }
        Some(
            self.with(mb, |m| m.sum.take())
                .unwrap_or_else(|| self.zeros()),
        )
    }

    /// Micro-batch `mb` (`tokens` tokens) has passed every block and its statistics over all
    /// of them and all its tokens are `total`: the backward uses them, and its `aux` is added
    /// to the report.
    pub(crate) fn set_total(&self, mb: usize, total: AuxStats, tokens: usize) {
        let aux = aux_loss(&total, self.moe_layers * tokens);
        self.with(mb, |m| m.total = Some(total));
        self.report.lock().expect("moe report lock").aux_sum += aux;
    }

    /// Micro-batch `mb` is done on this rank: forgets its statistics.
    pub fn end_micro_batch(&self, mb: usize) {
        self.micro.lock().expect("moe state lock").remove(&mb);
    }

    /// What this rank measured so far.
    pub fn report(&self) -> MoeReport {
        self.report.lock().expect("moe report lock").clone()
    }

    fn zeros(&self) -> AuxStats {
        AuxStats {
            counts: vec![0.0; self.experts],
            prob_sums: vec![0.0; self.experts],
        }
    }

    /// The all-block statistics of micro-batch `mb` (`tokens = L_moe·T` of them).
    pub(super) fn total(&self, mb: usize, tokens: usize) -> AuxStats {
        let total = self.with(mb, |m| m.total.clone());
        total.unwrap_or_else(|| {
            panic!("micro-batch {mb} ({tokens} tokens): backward before its forward finished")
        })
    }

    /// Floats a pipeline message carries besides the activations or gradients: 0 for a dense
    /// model, else `3E` (counts, and the probability sums as f32 high and low parts).
    pub fn message_len(&self) -> usize {
        if self.moe_layers == 0 {
            0
        } else {
            3 * self.experts
        }
    }

    /// Writes micro-batch `mb`'s statistics into a message tail of [`MoeStep::message_len`]
    /// floats: the running sum after this stage's blocks (`total = false`, sent with the
    /// activations) or the total (`total = true`, sent back with the gradients).
    pub fn write_message(&self, mb: usize, total: bool, out: &mut [f32]) {
        if out.is_empty() {
            return;
        }
        let stats = self.with(mb, |m| {
            if total {
                m.total.clone()
            } else {
                m.sum.clone()
            }
        });
        encode(&stats.unwrap_or_else(|| self.zeros()), out);
    }

    /// Reads a message tail written by [`MoeStep::write_message`] on the neighbouring stage.
    pub fn read_message(&self, mb: usize, total: bool, msg: &[f32]) {
        if msg.is_empty() {
            return;
        }
        let stats = decode(msg);
        self.with(mb, |m| {
            if total {
                m.total = Some(stats);
            } else {
                m.sum = Some(stats);
            }
        });
    }
}

/// `stats` as `3E` floats: the counts (integers, exact in f32), and the probability sums as
/// f32 high and low parts (their sum keeps the f64 to about 2⁻⁴⁸).
pub(crate) fn encode(stats: &AuxStats, out: &mut [f32]) {
    let e = stats.counts.len();
    for i in 0..e {
        out[i] = stats.counts[i] as f32;
        let p = stats.prob_sums[i];
        out[e + i] = p as f32;
        out[2 * e + i] = (p - (p as f32) as f64) as f32;
    }
}

/// The inverse of [`encode`] (also of a sum of encodings).
pub(crate) fn decode(msg: &[f32]) -> AuxStats {
    let e = msg.len() / 3;
    AuxStats {
        counts: msg[..e].iter().map(|&c| c as f64).collect(),
        prob_sums: (0..e)
            .map(|i| msg[e + i] as f64 + msg[2 * e + i] as f64)
            .collect(),
    }
}
