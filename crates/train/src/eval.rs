//! Evaluation: the mean next-token loss of a model on a token file.
//!
//! The file is cut into consecutive, non-overlapping windows of `seq_len + 1` tokens with
//! stride `seq_len` (window `w` covers tokens `w·s .. w·s + s + 1`; its first `s` tokens are
//! inputs and its last `s` the targets, so every token but the first is predicted exactly
//! once). Trailing tokens that do not fill a window are dropped. Windows are taken in file
//! order, `batch` at a time; the loss is the mean over every predicted token.

use ferrotron_data::{eval_window, eval_windows, TokenStore};
use ferrotron_model::{ExpertParallel, TensorParallel};
use ferrotron_model::{Llama, StepCtx};
use ferrotron_tensor::{Category, Device, Store, StoreDType};
use serde::Serialize;

use crate::TrainError;

/// The label of the transfers that bring evaluation windows' token ids to the device.
pub const EVALUATION: &str = "evaluation";

/// Result of [`evaluate`].
#[derive(Debug, Clone, Copy, Serialize)]
pub struct EvalReport {
    /// Mean next-token loss (nats).
    pub loss: f64,
    /// Tokens predicted.
    pub tokens: usize,
    /// Windows evaluated.
    pub sequences: usize,
    /// Tokens per window.
    pub seq_len: usize,
}

/// How an evaluation cuts its windows: `seq_len` tokens predicted per window, `batch`
/// windows per forward, `loss_chunk` tokens per LM-head chunk.
#[derive(Debug, Clone, Copy)]
pub struct EvalShape {
    /// Tokens predicted per window.
    pub seq_len: usize,
    /// Windows per forward.
    pub batch: usize,
    /// Tokens per LM-head/cross-entropy chunk.
    pub loss_chunk: usize,
    /// Document masking's end-of-document token (None: each window attends causally as a
    /// whole), as the model was trained.
    pub document_eos: Option<u32>,
}

/// The strategies of a split model: its tensor-parallel and expert-parallel groups.
#[derive(Clone, Copy, Default)]
pub struct EvalGroups<'a> {
    /// The tensor-parallel group (None: the model is not split over one).
    pub tp: Option<&'a dyn TensorParallel>,
    /// The expert-parallel group (None: every expert is here).
    pub ep: Option<&'a dyn ExpertParallel>,
    /// Aux-loss-free balancing's biases by block index (None: routed by probability alone).
    pub expert_bias: Option<&'a [Vec<f32>]>,
}

/// Mean next-token loss of `weights` on `file` (see the module docs for the windowing), with
/// the tensor-parallel and expert-parallel groups of `groups` when the model is split.
pub fn evaluate(
    (model, weights): (&Llama, &Store),
    dev: Device<'_>,
    file: &dyn TokenStore,
    shape: EvalShape,
    groups: EvalGroups<'_>,
) -> Result<EvalReport, TrainError> {
    let EvalShape {
        seq_len,
        batch,
        loss_chunk,
        document_eos,
    } = shape;
    let EvalGroups {
        tp,
        ep,
        expert_bias,
    } = groups;
    let moe = ferrotron_model::MoeStep::new(&model.cfg, ep, 0.0);
    let moe = match expert_bias {
        Some(b) => moe.with_bias(b),
        None => moe,
    };
    let ledger = dev.ledger;
    file.check_vocab(model.cfg.vocab)?;
    let windows = eval_windows(file, seq_len)?;
    let act_dtype = match weights {
        Store::F32(_) => StoreDType::F32,
        Store::Bf16(_) => StoreDType::Bf16,
        Store::F16(_) => StoreDType::F16,
    };
    let documents = ferrotron_model::Documents::new();
    let ctx = StepCtx {
        ledger,
        backend: dev.backend,
        act_dtype,
        loss_chunk,
        tp,
        cp: None,
        trace: None,
        micro_batch: Default::default(),
        recompute: ferrotron_config::Recompute::None,
        moe,
        documents: document_eos.map(|_| &documents),
        fp8: ferrotron_config::Fp8::Off,
        fp8_history: None,
    };
    let mut window = vec![0u32; seq_len + 1];
    let _window = ledger.hold(Category::Workspace, 4 * (seq_len + 1));
    let mut total = 0.0;
    for first in (0..windows).step_by(batch.max(1)) {
        let n = batch.max(1).min(windows - first);
        // [inputs | targets] of the n windows, staged on the host and sent in one transfer.
        let mut ids = vec![0u32; 2 * n * seq_len];
        let mut starts = vec![0; document_eos.map_or(0, |_| n * seq_len)];
        for row in 0..n {
            eval_window(file, seq_len, first + row, &mut window)?;
            ids[row * seq_len..(row + 1) * seq_len].copy_from_slice(&window[..seq_len]);
            let t = n * seq_len + row * seq_len;
            ids[t..t + seq_len].copy_from_slice(&window[1..]);
            if let Some(eos) = document_eos {
                let row_starts = &mut starts[row * seq_len..(row + 1) * seq_len];
                ferrotron_data::document_starts(&window[..seq_len], eos, row_starts);
            }
        }
        if document_eos.is_some() {
            documents.set(ledger, 0, starts);
        }
        let ids = ledger.upload(Category::Workspace, EVALUATION, &ids);
        let (inputs, targets) = ids.split_at(n * seq_len);
        total += model.forward_backward(&ctx, weights, None, inputs, targets, 1.0)?;
    }
    let tokens = windows * seq_len;
    Ok(EvalReport {
        loss: total / tokens as f64,
        tokens,
        sequences: windows,
        seq_len,
    })
}
