//! Activation, workspace and communication-buffer bytes of one micro-batch on one rank, and
//! how many micro-batches a pipeline stage keeps in flight.
//!
//! Two activation models:
//! - **engine** (`crates/model/src/llama.rs`): per block `T·(4h + 2·a·d + 2·a_kv·d + 2·h_ff)`
//!   stored elements (dtype bytes) + `T·2 + b·a·s` f32 statistics, `T = b·s` tokens; flash-style
//!   attention keeps no `s × s` scores, so selective recomputation saves nothing. Outside the
//!   blocks: the last block's output (`T·h` stored) and the final norm's statistics (`T` f32);
//!   the LM head runs in chunks and keeps no logits. Other pipeline stages hold the output of
//!   the forward being sent (`T·h`) next to their saved blocks. Under zero bubble the engine
//!   also keeps the weight-gradient inputs from B to W (the `zero_bubble` module). TP splits
//!   heads and the MLP width (÷t), SP also the replicated `4h` and norm statistics, CP the
//!   tokens (÷c: every saved tensor, the log-sum-exp included, is per token). A
//!   mixture-of-experts block replaces the MLP's gate and up by what `moe_saved` counts.
//! - **Korthikanti** (playbook §3, bf16 mixed precision, no flash attention): per block
//!   `s·b·h·(34 + 5·a·s/h)` bytes; with TP `s·b·h·(10 + 24/t + 5·a·s/(h·t))`, with SP all ÷t;
//!   selective drops the `5·a·s/h` term; full keeps `2·s·b·h`. MoE blocks scale the MLP's
//!   19 of the 34 by `top_k`. Outside: fp32 logits `4·s·b·v/t`.

use crate::layout::{Layout, Recompute, Schedule};
use crate::model::ModelSpec;
use serde::{Deserialize, Serialize};

/// Which activation count to use (see the `activations` module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationModel {
    /// What the engine saves (flash-style attention, chunked loss): exact where it runs.
    Engine,
    /// The playbook's `s·b·h·(34 + 5·a·s/h)` per layer (Korthikanti et al. 2022).
    Korthikanti,
}

/// Per-rank shape of one micro-batch.
struct Shape {
    /// Tokens per rank `b·s/c`.
    tokens: f64,
    h: f64,
    /// Tensor-parallel split of heads and MLP width.
    t: f64,
    /// Split of the replicated regions: `t` with sequence parallelism, else 1.
    tsp: f64,
    /// Bytes of a stored activation element.
    act: f64,
}

fn shape(model: &ModelSpec, l: &Layout) -> Shape {
    let c = &model.config;
    let t = l.tp as f64;
    Shape {
        tokens: (l.micro_batch * c.seq_len) as f64 / l.cp as f64,
        h: c.hidden as f64,
        t,
        tsp: if l.sequence_parallel { t } else { 1.0 },
        act: l.dtype.size() as f64,
    }
}

/// Bytes block `layer` keeps for backward without recomputation, one micro-batch.
fn block_full(model: &ModelSpec, l: &Layout, layer: usize, act_model: ActivationModel) -> f64 {
    let c = &model.config;
    let sh = shape(model, l);
    let (a, akv, d, ff) = (
        c.heads as f64,
        c.kv_heads as f64,
        c.head_dim() as f64,
        c.ffn as f64,
    );
    let moe = model.moe.filter(|_| model.is_moe_layer(layer));
    let k = moe.map_or(1.0, |m| m.top_k as f64);
    match act_model {
        ActivationModel::Engine => {
            let mlp = if moe.is_some() { 0.0 } else { 2.0 * ff };
            let split = 2.0 * a * d + 2.0 * akv * d + mlp;
            let stored = 4.0 * sh.h / sh.tsp + split / sh.t;
            let stats = 2.0 / sh.tsp + a / sh.t;
            let dense = sh.tokens * (stored * sh.act + stats * 4.0);
            let kept = slots_per_token(model, sh.tokens);
            dense + moe.map_or(0.0, |m| moe_saved(&sh, (ff, kept), m, l.ep))
        }
        ActivationModel::Korthikanti => {
            let base = 15.0 + 19.0 * k;
            let scores = 5.0 * a * c.seq_len as f64 / sh.h;
            let sbh = sh.tokens * sh.h;
            if l.sequence_parallel || sh.t == 1.0 {
                sbh * (base + scores) / sh.t
            } else {
                sbh * (10.0 + (base - 10.0) / sh.t + scores / sh.t)
            }
        }
    }
}

/// Bytes a mixture-of-experts block keeps besides attention (`crates/model/src/moe.rs`),
/// one micro-batch. Routers and experts are replicated over tensor parallelism and see every
/// token of the micro-batch (gathered under SP): per token its `k` dispatched rows and their
/// results (`2k·h`), the experts' gate and up outputs at full width (`2k·h_ff`) — assuming
/// balanced routing, so a rank's experts process `T·k` rows — and the routing tables: `k`
/// expert ids, `k` gates, `E` probabilities and the dispatch's token, slot and row indices;
/// per block the expert counts and offsets and the exchange's row counts.
fn moe_saved(sh: &Shape, (ff, kept): (f64, f64), m: crate::Moe, ep: usize) -> f64 {
    let (k, e) = (m.top_k as f64, m.experts as f64);
    let idx = std::mem::size_of::<usize>() as f64;
    let rows = sh.tokens * (2.0 * kept * sh.h + 2.0 * kept * ff) * sh.act;
    let tables = sh.tokens * (k * idx + 4.0 * k + 4.0 * e + 3.0 * k * idx);
    let per_block = idx * (2.0 * e + 1.0 + ep as f64 + e);
    rows + tables + per_block
}

/// Dispatched rows per routed token of a mixture-of-experts block whose micro-batch routes
/// `tokens`: `top_k`, or fewer where `model.moe_capacity_factor` caps every expert below the
/// balanced load (`E·capacity / tokens`).
fn slots_per_token(model: &ModelSpec, tokens: f64) -> f64 {
    let Some(m) = model.moe else {
        return 1.0;
    };
    let k = m.top_k as f64;
    match model.config.moe_capacity_factor {
        Some(cf) if tokens > 0.0 => {
            let cap = ferrotron_config::expert_capacity(cf, tokens as usize, m.top_k, m.experts);
            k.min((m.experts * cap) as f64 / tokens)
        }
        _ => k,
    }
}

/// Bytes of the FP8 copies of one linear layer's two operands (`train.fp8`; 0 without): the
/// largest over the blocks' products of `x` and `w` (forward), `dy` and `w` (input
/// gradient), or `dy` and `x` (weight gradient), each of `tokens` rows, in f32.
fn fp8_copies(model: &ModelSpec, l: &Layout, tokens: f64) -> f64 {
    if !l.fp8 {
        return 0.0;
    }
    let c = &model.config;
    let (h, q, kv, f) = (
        c.hidden,
        c.heads * c.head_dim(),
        c.kv_heads * c.head_dim(),
        c.ffn,
    );
    [(h, q), (h, kv), (q, h), (h, f), (f, h)]
        .iter()
        .map(|&(d_in, d_out)| {
            let (d_in, d_out) = (d_in as f64, d_out as f64);
            let w = d_in * d_out;
            (tokens * d_in + w)
                .max(tokens * d_out + w)
                .max(tokens * (d_in + d_out))
        })
        .fold(0.0, f64::max)
        * 4.0
}

/// Bytes block `layer` keeps for backward under the layout's recomputation policy.
pub(crate) fn block_saved(model: &ModelSpec, l: &Layout, layer: usize, m: ActivationModel) -> f64 {
    let sh = shape(model, l);
    match (l.recompute, m) {
        (Recompute::Full, ActivationModel::Engine) => sh.tokens * sh.h / sh.tsp * sh.act,
        (Recompute::Full, ActivationModel::Korthikanti) => 2.0 * sh.tokens * sh.h / sh.tsp,
        (Recompute::Selective, ActivationModel::Engine) => {
            // The engine drops both normed inputs (this rank's tokens) and the attention output
            // (this rank's heads), recomputing them in backward.
            let c = &model.config;
            let dropped = 2.0 * sh.h / sh.tsp + (c.heads * c.head_dim()) as f64 / sh.t;
            block_full(model, l, layer, m) - sh.tokens * dropped * sh.act
        }
        (Recompute::Selective, ActivationModel::Korthikanti) => {
            // Drop the `5·a·s²·b` score terms (÷c, ÷t like the rest).
            let c = &model.config;
            let scores = 5.0 * c.heads as f64 * c.seq_len as f64 * sh.tokens / sh.t;
            block_full(model, l, layer, m) - scores
        }
        _ => block_full(model, l, layer, m),
    }
}

/// Engine, with recomputation: the peak while one block holds its full set of activations
/// (being computed in forward, or rematerialised in backward) next to its output, on top of
/// what every block keeps — the largest block's `full − kept` plus one `T·h` output.
pub(crate) fn recompute_transient(model: &ModelSpec, l: &Layout, layers: &[usize]) -> f64 {
    if l.recompute == Recompute::None {
        return 0.0;
    }
    let sh = shape(model, l);
    let m = ActivationModel::Engine;
    let extra = layers
        .iter()
        .map(|&b| block_full(model, l, b, m) - block_saved(model, l, b, m))
        .fold(0.0, f64::max);
    extra + sh.tokens * sh.h / sh.tsp * sh.act
}

/// Bytes kept outside the blocks. Engine: on the last stage the last block's output and the
/// final norm's statistics; on the other stages of a pipeline the output of the forward
/// being sent (the engine copies it into a send buffer, then frees it). Korthikanti: the
/// fp32 logits on the last stage.
pub(crate) fn outside(model: &ModelSpec, l: &Layout, m: ActivationModel, last: bool) -> f64 {
    let sh = shape(model, l);
    match (m, last) {
        (ActivationModel::Engine, true) => sh.tokens * (sh.h * sh.act + 4.0) / sh.tsp,
        (ActivationModel::Engine, false) => sh.tokens * sh.h * sh.act / sh.tsp,
        (ActivationModel::Korthikanti, true) => 4.0 * sh.tokens * model.config.vocab as f64 / sh.t,
        (ActivationModel::Korthikanti, false) => 0.0,
    }
}

/// Micro-batches whose activations pipeline rank `stage` holds at its peak, in units of the
/// rank's whole set of blocks: 1 without pipelining (accumulation runs micro-batches one
/// after another), `m` for AFAB, `min(p − i, m)` for 1F1B and zero bubble (ZB-H1), for
/// the interleaved schedule
/// Megatron's `min(2(p−i−1) + (v−1)·p + 1, m·v)` chunks of `1/v` of the rank's blocks, and
/// for DualPipeV `2p + 1` chunks of half of them.
pub(crate) fn in_flight(l: &Layout, stage: usize) -> f64 {
    let (p, m) = (l.pp, l.grad_accum);
    if p <= 1 {
        return 1.0;
    }
    match l.pp_schedule {
        Schedule::Afab => m as f64,
        Schedule::OneFOneB | Schedule::ZeroBubble => (p - stage).min(m) as f64,
        Schedule::Interleaved => {
            let v = l.virtual_stages;
            let chunks = (2 * (p - stage - 1) + (v - 1) * p + 1).min(m * v);
            chunks as f64 / v as f64
        }
        // Every rank's peak is 2p + 1 chunks of half its blocks (crates/schedule tests).
        Schedule::DualPipeV => p as f64 + 0.5,
    }
}

/// Rough peak of transient buffers, bytes: the larger of one block's backward (f32 input
/// gradients of its widest half plus, in bf16, f32 views of the saved tensors it reads) and,
/// on the last stage, the head's (a loss chunk of logits and three `T × h` f32 buffers);
/// with full recomputation, plus one block's rematerialised activations.
pub(crate) fn workspace(
    model: &ModelSpec,
    l: &Layout,
    last: bool,
    layers: &[usize],
    m: ActivationModel,
) -> f64 {
    let c = &model.config;
    let sh = shape(model, l);
    let k = model.moe.map_or(1.0, |m| m.top_k as f64);
    let ffl = k * c.ffn as f64 / sh.t;
    let (qd, kd) = (
        (c.heads * c.head_dim()) as f64 / sh.t,
        (c.kv_heads * c.head_dim()) as f64 / sh.t,
    );
    let views = if l.dtype.size() < 4 { 1.0 } else { 0.0 };
    let mlp = 3.0 * ffl + sh.h + views * (2.0 * ffl + sh.h);
    let attn = 2.0 * qd + 2.0 * kd + sh.h + views * (2.0 * qd + 2.0 * kd + sh.h);
    // In bf16 the weights are widened to f32 one matrix at a time (experts are whole on every
    // tensor-parallel rank), and one more `T × h` view is live.
    let widest = if model.moe.is_some() {
        c.ffn as f64
    } else {
        c.ffn as f64 / sh.t
    }
    .max(qd);
    let block = 4.0 * sh.tokens * (views * sh.h + mlp.max(attn))
        + views * 4.0 * widest * sh.h
        + fp8_copies(model, l, sh.tokens);
    // The step's token ids: a sample window and the micro-batch's inputs and targets (u32);
    // under document masking, each window token's document start (a usize) of the
    // micro-batch in hand (a pipeline stage holds those of its micro-batches in flight, a
    // few KiB more, not counted).
    let ids = 4.0 * (c.seq_len + 1 + 2 * l.micro_batch * c.seq_len) as f64;
    let starts = if l.document_mask {
        (std::mem::size_of::<usize>() * l.micro_batch * c.seq_len) as f64
    } else {
        0.0
    };
    let head = if last {
        let chunk = l.loss_chunk.min(l.micro_batch * c.seq_len) as f64;
        // The logits of rank 0's real vocabulary rows (padded ones are never computed).
        let vocab = c.vocab_valid_rows(l.tp, 0) as f64;
        4.0 * (chunk * vocab + 3.0 * sh.tokens * sh.h)
    } else {
        0.0
    };
    // The engine counts rematerialised activations as activations (see `recompute_transient`).
    let remat = match (l.recompute, m) {
        (_, ActivationModel::Engine) => 0.0,
        (Recompute::Full, _) => layers
            .iter()
            .map(|&layer| block_full(model, l, layer, m))
            .fold(0.0, f64::max),
        _ => 0.0,
    };
    block.max(head) + remat + ids + starts + gemm_pack(model, l)
}

/// The host matmul library's scratch, which the engine counts for the whole run on the CPU
/// (`ferrotron_config::step_matmul_scratch_bytes`: `gemm`'s largest packing in a step, its
/// MoE from the model's, or OpenBLAS's buffer per compute thread); on a GPU, the bf16
/// products' scratch for their rounded operands where there are such products
/// (`ferrotron_config::device_bf16_operand_bytes`) and, with attention as products, the
/// score buffers (`ferrotron_config::device_attention_score_bytes`).
fn gemm_pack(model: &ModelSpec, l: &Layout) -> f64 {
    let mut config = model.config.clone();
    if let Some(m) = model.moe {
        (config.experts, config.top_k, config.moe_every) = (m.experts, m.top_k, m.every);
    }
    if !l.host_matmul {
        let scores =
            ferrotron_config::device_attention_score_bytes(&config, &l.parallel, l.attention);
        let operands = match l.matmul {
            ferrotron_config::Matmul::Bf16 => ferrotron_config::device_bf16_operand_bytes(
                &config,
                &l.parallel,
                (l.micro_batch, l.loss_chunk),
            ),
            _ => 0,
        };
        return (scores + operands) as f64;
    }
    let threads = if l.threads > 0 {
        l.threads.min(cores())
    } else {
        l.parallel.default_threads_per_rank(cores())
    };
    ferrotron_config::step_matmul_scratch_bytes(
        l.matmul,
        threads,
        &config,
        &l.parallel,
        (l.micro_batch, l.loss_chunk),
    ) as f64
}

/// This machine's cores, which the engine's compute threads default to.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Rough communication buffers tied to activations, bytes. Measured against the engine's
/// ledger: TP collectives hold about 1.5 f32 buffers of `T·h` (pipeline messages are per
/// stage: [`pipeline_messages`]); the CP ring about four packed f32
/// key/value blocks `[k | v]` of the rank's tokens (held, sent, received, and in backward
/// the `dk`/`dv` accumulator; more when ranks drift apart, since sends are buffered),
/// Ulysses its head-sharded copies and exchange buffers, MoE its
/// dispatch and combine buffers (formula, not measured).
/// Pipeline message buffers of `stage`, bytes. Sends are buffered and stay on the sender's
/// ledger until the peer takes them, so a stage can be as many messages ahead as it has
/// micro-batches in flight (every forward of AFAB before the next stage's first), plus the
/// one it is receiving; one f32 `T·h` (÷t with SP) each.
pub(crate) fn pipeline_messages(model: &ModelSpec, l: &Layout, stage: usize) -> f64 {
    if l.pp <= 1 {
        return 0.0;
    }
    let sh = shape(model, l);
    let messages = in_flight(l, stage) * l.chunks().max(1) as f64 + 1.0;
    messages * sh.tokens * sh.h / sh.tsp * 4.0
}

pub(crate) fn comm_activations(model: &ModelSpec, l: &Layout) -> f64 {
    let c = &model.config;
    let sh = shape(model, l);
    let mut bytes = 0.0;
    if l.tp > 1 {
        bytes += 1.5 * sh.tokens * sh.h * 4.0;
        if l.sequence_parallel {
            // The per-token losses gathered from the sequence-parallel ranks.
            bytes += sh.tokens * 4.0;
        }
    }
    if l.cp > 1 {
        let (qd, kd) = (
            (c.heads * c.head_dim()) as f64 / sh.t,
            (c.kv_heads * c.head_dim()) as f64 / sh.t,
        );
        bytes += match l.cp_kind {
            ferrotron_config::CpKind::Ring => 4.0 * 2.0 * sh.tokens * kd * 4.0,
            // Ulysses (formula, bounded by the ledger in `estimate_vs_ledger`): while
            // attention's backward runs, the head-sharded q, k, v, output and its gradient and
            // the gradients dq, dk, dv; then one exchange in flight (send and receive buffers).
            ferrotron_config::CpKind::Ulysses => {
                // Shared key/value heads arrive once per rank that reads them. Its gathers'
                // tables: four of `b·s` rows (five when shared), three usizes a row.
                let share = (l.cp / (c.kv_heads / l.tp).max(1)).max(1) as f64;
                let tables = if share > 1.0 { 5.0 } else { 4.0 } * 24.0 * sh.tokens * l.cp as f64;
                sh.tokens * (4.0 * qd + 4.0 * share * kd) * 4.0 + tables
            }
        };
    }

    if model.moe.is_some() {
        bytes += 2.0 * sh.tokens * slots_per_token(model, sh.tokens) * sh.h / sh.tsp * sh.act;
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_follows_the_schedules() {
        let mut l = Layout::default().with(|l| {
            l.pp = 4;
            l.grad_accum = 8;
            l.pp_schedule = Schedule::Afab;
        });
        assert_eq!(in_flight(&l, 0), 8.0);
        l.pp_schedule = Schedule::OneFOneB;
        assert_eq!((in_flight(&l, 0), in_flight(&l, 3)), (4.0, 1.0));
        l.pp_schedule = Schedule::Interleaved;
        l.virtual_stages = 2;
        // Rank 0: 2·3 + 1·4 + 1 = 11 chunks of half its blocks.
        assert_eq!(in_flight(&l, 0), 5.5);
        l.grad_accum = 2;
        assert_eq!(in_flight(&l, 0), 2.0);
    }

    /// The closed forms above are the schedule crate's action lists, counted: the peak
    /// number of live `(micro-batch, chunk)` sets of every rank, over many shapes.
    #[test]
    fn in_flight_is_the_schedule_crates_peak() {
        use ferrotron_schedule::{schedule, ScheduleKind};
        for (kind, vs) in [
            (ScheduleKind::Afab, &[1][..]),
            (ScheduleKind::OneFOneB, &[1]),
            (ScheduleKind::Interleaved, &[2, 3, 4]),
        ] {
            for p in 2..=6 {
                for m in 1..=12 {
                    for &v in vs {
                        if kind == ScheduleKind::Interleaved && m % p != 0 {
                            continue;
                        }
                        let s = schedule(kind, p, m, v).unwrap();
                        let l = Layout::default().with(|l| {
                            l.pp = p;
                            l.grad_accum = m;
                            l.virtual_stages = v;
                            l.pp_schedule = kind;
                        });
                        for rank in 0..p {
                            let listed = s.peak_in_flight(rank).unwrap() as f64 / v as f64;
                            assert_eq!(
                                in_flight(&l, rank),
                                listed,
                                "{kind} p={p} m={m} v={v} rank {rank}"
                            );
                        }
                    }
                }
            }
        }
    }
}
