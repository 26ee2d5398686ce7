//! Muon's optimizer step (`train.optimizer = "muon"`) in the estimate and the cost model, as
//! the engine runs it (`crates/train/src/optim/muon.rs`): every rank holding part of a
//! projection matrix gathers it whole — ZeRO pieces over the bucket's data-parallel group,
//! tensor-parallel slices over the TP group, both in f32 — and runs the Newton–Schulz
//! iteration on it.

use ferrotron_config::{newton_schulz_flops, newton_schulz_scratch_elems};

use crate::layout::Layout;
use crate::model::ModelSpec;

/// One of a block's Muon matrices: its full shape, and whether tensor parallelism splits it
/// (experts are whole on every TP rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub split: bool,
}

/// The Muon matrices of block `b` on one expert-parallel rank (its `experts / ep` experts;
/// the planner's configuration is dense, its experts are `model.moe`'s).
pub(crate) fn block_matrices(model: &ModelSpec, ep: usize, b: usize) -> Vec<Matrix> {
    let cfg = &model.config;
    let (h, f) = (cfg.hidden, cfg.ffn);
    let (q, kv) = (cfg.heads * cfg.head_dim(), cfg.kv_heads * cfg.head_dim());
    let m = |rows, cols, split| Matrix { rows, cols, split };
    let mut out = vec![m(q, h, true), m(kv, h, true), m(kv, h, true), m(h, q, true)];
    if let Some(moe) = model.moe.filter(|_| model.is_moe_layer(b)) {
        for _ in 0..moe.experts / ep {
            out.extend([m(f, h, false), m(h, f, false), m(f, h, false)]);
        }
    } else {
        out.extend([m(f, h, true), m(f, h, true), m(h, f, true)]);
    }
    out
}

/// Floating-point operations of the step's Newton–Schulz iterations on one rank holding
/// `blocks` (every rank of the stage runs them on the whole matrices).
pub(crate) fn flops(model: &ModelSpec, l: &Layout, blocks: &[usize], steps: usize) -> f64 {
    blocks
        .iter()
        .flat_map(|&b| block_matrices(model, l.ep, b))
        .map(|m| newton_schulz_flops(m.rows, m.cols, steps))
        .sum()
}

/// Bytes one rank receives in the step's gathers of `blocks`' matrices, as
/// `(data-parallel, tensor-parallel)`: the other ranks' ZeRO pieces (under ZeRO ≥ 1 with
/// more than one data × context rank; experts over their `dp·cp / ep` replicas) and the other
/// TP slices of each split matrix, in f32.
pub(crate) fn gathered_bytes(model: &ModelSpec, l: &Layout, blocks: &[usize]) -> (f64, f64) {
    let t = l.tp as f64;
    let (reducers, experts) = ((l.dp * l.cp) as f64, (l.dp * l.cp / l.ep) as f64);
    let sharded = l.zero >= 1;
    let share = |n: f64| if n > 1.0 { (n - 1.0) / n } else { 0.0 };
    let (mut dp, mut tp) = (0.0, 0.0);
    for m in blocks.iter().flat_map(|&b| block_matrices(model, l.ep, b)) {
        let whole = 4.0 * (m.rows * m.cols) as f64;
        let local = if m.split { whole / t } else { whole };
        if sharded {
            dp += local * share(if m.split { reducers } else { experts });
        }
        if m.split {
            tp += whole * share(t);
        }
    }
    (dp, tp)
}

/// Bytes of the step's transients on one rank, `(workspace, communication)`: the largest
/// matrix whole, with the iteration's scratch or (after it) this rank's slice of the result;
/// the largest bucket's update gathered (with this rank's piece of it, an expert bucket's
/// over fewer ranks), and a split matrix's slices gathered besides.
pub(crate) fn transients(model: &ModelSpec, l: &Layout, bucket_elems: u64) -> (u64, u64) {
    let t = l.tp;
    let layers: Vec<usize> = (0..model.config.layers).collect();
    let (mut workspace, mut gather) = (0usize, 0usize);
    for m in layers.iter().flat_map(|&b| block_matrices(model, l.ep, b)) {
        let whole = m.rows * m.cols;
        let split = m.split && t > 1;
        let slice = if split { whole / t } else { 0 };
        let scratch = newton_schulz_scratch_elems(m.rows, m.cols);
        workspace = workspace.max(whole + scratch.max(slice));
        gather = gather.max(if split { slice + whole } else { 0 });
    }
    // An expert bucket is split over its `dp·cp / ep` replicas: the larger piece.
    let reducers = (l.dp * l.cp / l.ep.max(1)) as u64;
    let piece = if l.zero >= 1 && l.dp * l.cp > 1 {
        bucket_elems.div_ceil(reducers.max(1))
    } else {
        0
    };
    let communication = bucket_elems + piece.max(gather as u64);
    (4 * workspace as u64, 4 * communication)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's test model (hidden 64, 4 heads of 16, 2 kv heads, ffn 128): 14 matrices
    /// over two blocks; a 64×128 matrix's five iterations cost 5·(4·64²·128 + 2·64³).
    #[test]
    fn matrices_flops_and_gathers_follow_the_shapes() {
        let cfg = ferrotron_config::ModelConfig {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            ..Default::default()
        };
        let model = ModelSpec::dense("test", cfg);
        let mats = block_matrices(&model, 1, 0);
        assert_eq!(mats.len(), 7);
        assert_eq!(
            mats[1],
            Matrix {
                rows: 32,
                cols: 64,
                split: true
            }
        );
        assert_eq!(
            newton_schulz_flops(64, 128, 5),
            5.0 * (4.0 * 64.0 * 64.0 * 128.0 + 2.0 * 64f64.powi(3))
        );
        let l = Layout {
            parallel: ferrotron_config::ParallelConfig {
                dp: 2,
                tp: 2,
                zero: 1,
                ..Default::default()
            },
            ..Layout::default()
        };
        let elems: usize = mats.iter().map(|m| m.rows * m.cols).sum();
        let (dp, tp) = gathered_bytes(&model, &l, &[0]);
        // Half of this TP rank's slice from the other DP rank; half of each matrix from the
        // other TP rank.
        assert_eq!(dp, 4.0 * elems as f64 / 2.0 / 2.0);
        assert_eq!(tp, 4.0 * elems as f64 / 2.0);
    }
}
