//! Counting the tensor-parallel collectives of a pipeline stage per micro-batch: as this
//! engine makes them (the CPU cost model, checked against the engine's own count in
//! `crates/train/tests/tp_parity.rs`), and as the playbook's measured system is modelled.

use crate::layout::{Layout, Recompute};
use crate::model::Unit;

/// What a pipeline stage holds, for counting its tensor-parallel collectives.
#[derive(Debug, Clone, Copy, Default)]
pub struct TpStage {
    /// Sequence parallelism.
    pub sp: bool,
    /// Full recomputation.
    pub full: bool,
    /// Transformer blocks.
    pub blocks: f64,
    /// Whether the stage holds the embedding.
    pub embed: bool,
    /// Whether the stage holds the head and the loss.
    pub head: bool,
    /// Chunks of the vocabulary-parallel loss (`loss_chunk` tokens each).
    pub head_chunks: f64,
}

/// A stage's tensor-parallel collectives in one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TpCalls {
    /// Bus volume in units of one activation's `(t−1)/t · tokens · hidden` elements (an
    /// all-reduce counts 2, an all-gather or a reduce-scatter 1).
    pub units: f64,
    /// Collectives of activations.
    pub activation: f64,
    /// Collectives of a few kilobytes (norm-weight gradients, the loss's row statistics):
    /// they cost their latency.
    pub small: f64,
}

impl TpStage {
    /// The collectives the playbook's measured system is modelled with (and the §6
    /// calibration fitted on): per block 4 all-reduces (6 with full recomputation), each a
    /// reduce-scatter and an all-gather under SP, at the same volume.
    pub fn playbook_calls(&self) -> TpCalls {
        let per_block = if self.full { 6.0 } else { 4.0 };
        let pairs = if self.sp { 2.0 } else { 1.0 };
        TpCalls {
            units: 2.0 * per_block * self.blocks,
            activation: pairs * per_block * self.blocks,
            small: 0.0,
        }
    }

    /// The collectives as the engine makes them (`crates/model/src/tp.rs`, `block.rs`,
    /// `llama.rs`, `ctx.rs` and the vocabulary-parallel loss), counted in traced runs of
    /// tiny tp2 (22 all-reduces and 4 all-gathers per step) and tp2 with SP (30
    /// all-gathers, 18 reduce-scatters, 13 all-reduces).
    /// - A block without SP: `f̄` all-reduces attention's and the MLP's output forward,
    ///   `f` their input gradients backward (2 + 2; full recomputation: +2).
    /// - A block with SP: `g` gathers and `ḡ` scatters forward (2 + 2); backward, `ḡ`'s
    ///   gathers (2), the forward's gathers again for the weight gradients (2) and `g`'s
    ///   scatters (2); full recomputation repeats the forward's 4; and the two norm
    ///   weights' gradients, all-reduced (small).
    /// - The vocabulary-parallel embedding: its output all-reduced (SP: scattered forward,
    ///   its gradient gathered backward).
    /// - The head: its input gradient all-reduced (SP: the input gathered, its gradient
    ///   scattered, the final norm's gradient all-reduced), and per loss chunk the row
    ///   maxima gathered and the exponential sums all-reduced (small).
    pub fn engine_calls(&self) -> TpCalls {
        let again = if self.full { 1.0 } else { 0.0 };
        let (per_block, ends) = if self.sp {
            (10.0 + 4.0 * again, 2.0)
        } else {
            (4.0 + 2.0 * again, 1.0)
        };
        let edges = (self.embed as u8 + self.head as u8) as f64;
        let activation = self.blocks * per_block + edges * ends;
        let units = if self.sp {
            activation
        } else {
            2.0 * activation
        };
        let mut small = if self.head {
            2.0 * self.head_chunks
        } else {
            0.0
        };
        if self.sp {
            small += 2.0 * self.blocks + if self.head { 1.0 } else { 0.0 };
        }
        TpCalls {
            units,
            activation,
            small,
        }
    }
}

impl TpStage {
    /// The stage holding `units` under layout `l`, whose micro-batch gives each rank
    /// `tokens` tokens (`b·s/cp`).
    pub fn of(l: &Layout, units: &[Unit], tokens: usize) -> Self {
        let mut st = TpStage {
            sp: l.sequence_parallel,
            full: l.recompute == Recompute::Full,
            head_chunks: tokens.div_ceil(l.loss_chunk.max(1)) as f64,
            ..TpStage::default()
        };
        for u in units {
            match u {
                Unit::Embed => st.embed = true,
                Unit::Head => st.head = true,
                Unit::Block(_) => st.blocks += 1.0,
            }
        }
        st
    }
}
