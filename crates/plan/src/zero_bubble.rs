//! The engine's activation peak under the schedules that split backwards, zero bubble
//! (ZB-H1) and DualPipeV, replayed action by action.
//!
//! The schedule of rank `r` of `p` over `m` micro-batches (crates/schedule `build.rs`):
//! `w = min(p−r−1, m)` forwards, then `min(r, m−w)` pairs (F, B), then triples (F, B, W)
//! while forwards remain, pairs (B, W) while input backwards remain, and the remaining W.
//! A forward adds the stage's saved activations (and briefly the output being sent, or the
//! head's input on the last stage). `BackwardInput` walks the blocks in reverse; each block
//! copies the inputs of its seven linear layers' weight gradients (`dy` and `x`, f32) and
//! frees its saved tensors in two halves, the MLP's after the first three copies, the
//! attention's after the fourth, the rest at its end (crates/model `block.rs`). The copies
//! live until `BackwardWeight`. DualPipeV runs whole backwards too, and its two chunks hold
//! different blocks: the replay follows each action's chunk.

use ferrotron_schedule::Action;

use crate::activations::{block_saved, ActivationModel};
use crate::layout::Layout;
use crate::model::ModelSpec;

/// Bytes of one block's backward, per micro-batch: saved, deferred copies, and the highest
/// point above the starting level inside its `BackwardInput`.
struct BlockBytes {
    saved: f64,
    deferred: f64,
    peak: f64,
}

fn block_bytes(model: &ModelSpec, l: &Layout, layer: usize) -> BlockBytes {
    let c = &model.config;
    let t = l.tp as f64;
    let tokens = (l.micro_batch * c.seq_len) as f64 / l.cp as f64;
    let tokens_r = if l.sequence_parallel {
        tokens / t
    } else {
        tokens
    };
    let e = l.dtype.size() as f64;
    let h = c.hidden as f64;
    let (qd, kd) = (
        (c.heads * c.head_dim()) as f64 / t,
        (c.kv_heads * c.head_dim()) as f64 / t,
    );
    let k = model
        .moe
        .filter(|_| model.is_moe_layer(layer))
        .map_or(1.0, |m| m.top_k as f64);
    let ft = k * c.ffn as f64 / t;
    let a = c.heads as f64 / t;
    // down, gate, up: (dy, x) = (T·h, T·f/t), (T·f/t, T·h), (T·f/t, T·h).
    let mlp_copies = 4.0 * tokens * (3.0 * h + 3.0 * ft);
    // gate, up, xn2, x_mid (stored), rstd2 (f32).
    let mlp_freed = tokens * 2.0 * ft * e + tokens_r * (2.0 * h * e + 4.0);
    let o_copy = 4.0 * tokens * (h + qd);
    // q, k, v, attention output (stored), log-sum-exp (f32).
    let attn_freed = tokens * ((2.0 * qd + 2.0 * kd) * e + 4.0 * a);
    let qkv_copies = 4.0 * tokens * (qd + 2.0 * kd + 3.0 * h);
    let after_qkv = mlp_copies - mlp_freed + o_copy - attn_freed + qkv_copies;
    BlockBytes {
        saved: block_saved(model, l, layer, ActivationModel::Engine),
        deferred: mlp_copies + o_copy + qkv_copies,
        peak: mlp_copies.max(after_qkv),
    }
}

/// The compute actions of pipeline rank `stage` under the engine's schedule when it splits
/// backwards (zero bubble, DualPipeV; crates/schedule), as `(letter, chunk)`: `'F'`, `'B'`
/// (a whole backward), `'I'` (an input half) and `'W'` (a weight half). `None` when the
/// schedule cannot be built (a layout [`Layout::validate`] refuses).
pub fn compute_actions(l: &Layout, stage: usize) -> Option<Vec<(char, usize)>> {
    let kind = l.pp_schedule;
    let list =
        ferrotron_schedule::compute_actions(kind, l.pp, l.grad_accum, l.chunks(), stage).ok()?;
    let letter = |a: &Action| match a {
        Action::Forward { .. } => Some('F'),
        Action::Backward { .. } => Some('B'),
        Action::BackwardInput { .. } => Some('I'),
        Action::BackwardWeight { .. } => Some('W'),
        _ => None,
    };
    Some(
        list.iter()
            .filter_map(|a| Some((letter(a)?, a.chunk())))
            .collect(),
    )
}

/// What one pipeline rank holds for the replay: its chunks' blocks, and the bytes alive at
/// the end of each forward besides the saved activations (the output being sent, or the
/// head's input).
pub(crate) struct Rank<'a> {
    /// The blocks of each chunk, in chunk order.
    pub chunks: &'a [Vec<usize>],
    /// Bytes alive at the end of a forward.
    pub outside: f64,
}

/// Peak activation bytes of a pipeline rank that runs `actions` (its list from
/// [`compute_actions`]).
pub(crate) fn peak(model: &ModelSpec, l: &Layout, actions: &[(char, usize)], rank: Rank) -> f64 {
    let blocks: Vec<Vec<BlockBytes>> = rank
        .chunks
        .iter()
        .map(|layers| layers.iter().map(|&b| block_bytes(model, l, b)).collect())
        .collect();
    let sum = |c: usize, f: fn(&BlockBytes) -> f64| blocks[c].iter().map(f).sum::<f64>();
    let (mut live, mut top) = (0.0f64, 0.0f64);
    for &(action, c) in actions {
        match action {
            'F' => {
                live += sum(c, |b| b.saved);
                top = top.max(live + rank.outside);
            }
            'I' => {
                for b in blocks[c].iter().rev() {
                    top = top.max(live + b.peak);
                    live += b.deferred - b.saved;
                }
            }
            // A whole backward's transients are the step's workspace.
            'B' => live -= sum(c, |b| b.saved),
            _ => live -= sum(c, |b| b.deferred),
        }
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_schedule::ScheduleKind;

    fn zb(p: usize, m: usize) -> Layout {
        Layout::default().with(|l| {
            l.pp = p;
            l.grad_accum = m;
            l.pp_schedule = ScheduleKind::ZeroBubble;
        })
    }

    #[test]
    fn action_lists_are_the_schedule_crates() {
        // ZB-H1 by hand (Qi et al.): warm-up forwards, (F, B) pairs, (F, B, W) triples, the
        // remaining (B, W) and W.
        let text = |l: &Layout, r: usize| -> String {
            compute_actions(l, r)
                .unwrap()
                .into_iter()
                .map(|a| a.0)
                .collect()
        };
        assert_eq!(text(&zb(2, 4), 1), "FIFIWFIWFIWW");
        assert_eq!(text(&zb(2, 4), 0), "FFIWFIWFIWIW");
        assert_eq!(text(&zb(4, 2), 0), "FFIWIW");
    }
}
