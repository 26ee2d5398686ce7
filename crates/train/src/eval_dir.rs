//! `ferrotron eval` as a library call: the mean next-token loss of a Hugging Face model
//! directory on a token file or Megatron dataset, on any backend.

use std::path::Path;
use std::sync::Arc;

use ferrotron_data::{open_tokens, TokenStore};
use ferrotron_tensor::Backend;

use crate::hf::load_model;
use crate::on_device::DeviceModel;
use crate::trainer::thread_pool;
use crate::{EvalReport, EvalShape, TrainError};

/// What to evaluate, and how.
#[derive(Debug, Clone, Copy)]
pub struct EvalDir<'a> {
    /// The model directory (config.json and weights).
    pub model: &'a Path,
    /// The token file or Megatron prefix.
    pub data: &'a Path,
    /// Tokens per window (None: the model's `max_position_embeddings`).
    pub seq: Option<usize>,
    /// Windows per forward (does not change the result).
    pub batch: usize,
    /// Compute threads (0: one per core).
    pub threads: usize,
    /// Document masking's end-of-document token, as the model was trained with
    /// `data.document_mask` (None: each window attends causally as a whole).
    pub document_eos: Option<u32>,
}

/// An evaluation's report and what it warned about (windows past the model's positions).
#[derive(Debug, Clone)]
pub struct EvalOutcome {
    /// The loss and what it covered.
    pub report: EvalReport,
    /// Warnings for the caller to show.
    pub warnings: Vec<String>,
}

/// Evaluates `call.model` on `call.data` with `backend`'s kernels (see [`crate::evaluate`]
/// for the windowing). The data's vocabulary and length are checked before any work.
///
/// # Errors
///
/// The model's and the data's errors, and [`TrainError::Arguments`] for a `seq` of 0, data of
/// another vocabulary or shorter than one window.
pub fn evaluate_dir(
    call: EvalDir<'_>,
    backend: Arc<dyn Backend>,
) -> Result<EvalOutcome, TrainError> {
    let bad = |m: String| Err(TrainError::Arguments(m));
    let loaded = load_model(call.model)?;
    let mut cfg = loaded.config;
    let loaded_seq = cfg.seq_len;
    let mut warnings = Vec::new();
    if let Some(seq) = call.seq {
        if seq == 0 {
            return bad("--seq must be at least 1".into());
        }
        if seq > cfg.seq_len {
            warnings.push(format!(
                "--seq {seq} uses positions beyond the model's max_position_embeddings = {}: \
                 its loss there is untested",
                cfg.seq_len
            ));
        }
        cfg.seq_len = seq;
    }
    if let Some(eos) = call.document_eos.filter(|&e| e as usize >= cfg.vocab) {
        return bad(format!(
            "--document-eos {eos} is outside the model's vocabulary of {} ids",
            cfg.vocab
        ));
    }
    let file = open_tokens(call.data)?;
    if file.vocab_size() > cfg.vocab {
        return bad(format!(
            "--data {}: its vocab_size {} exceeds the model's vocabulary of {} (vocab_size in \
             {}): evaluate on data tokenized with this model's tokenizer",
            call.data.display(),
            file.vocab_size(),
            cfg.vocab,
            call.model.join("config.json").display()
        ));
    }
    if file.len() <= cfg.seq_len {
        return bad(format!(
            "--data {} holds {} tokens, fewer than one window of {} + 1: pass a smaller --seq \
             (the model's own is {loaded_seq})",
            call.data.display(),
            file.len(),
            cfg.seq_len,
        ));
    }
    let model = DeviceModel::new(&cfg, &loaded.weights, loaded.dtype, backend);
    drop(loaded.weights);
    let pool = thread_pool(call.threads)?;
    let shape = EvalShape {
        seq_len: cfg.seq_len,
        batch: call.batch,
        loss_chunk: 256,
        document_eos: call.document_eos,
    };
    let report = pool.install(|| model.evaluate(&file, shape))?;
    Ok(EvalOutcome { report, warnings })
}

/// Errors when `report`'s loss is not finite: the weights of `model` hold NaN or infinite
/// values (or values too large for f32).
///
/// # Errors
///
/// [`TrainError::Arguments`] naming the model, the data and the loss.
pub fn check_finite(report: &EvalReport, call: EvalDir<'_>) -> Result<(), TrainError> {
    if report.loss.is_finite() {
        return Ok(());
    }
    Err(TrainError::Arguments(format!(
        "the loss of {} on {} is not finite ({}): its weights hold NaN or infinite values, or \
         are too large for f32",
        call.model.display(),
        call.data.display(),
        report.loss
    )))
}
