//! FP8 delayed scaling's step end (`train.fp8_amax_history`): every rank's amax of every
//! site, combined into the single rank's, appended to the history every rank keeps.

use ferrotron_comm::{CommBuf, GroupKind, ReduceOp};
use ferrotron_model::Fp8History;
use ferrotron_tensor::{Category, Ledger};

use super::Trainer;
use crate::TrainError;

/// The label of the transfers that carry the amax of every site.
const FP8_AMAX: &str = "fp8 amax history";

/// An f32 buffer of `values` counted as communication.
fn comm_buf(ledger: &Ledger, values: &[f32]) -> CommBuf {
    CommBuf::F32(ledger.upload(Category::Communication, FP8_AMAX, values))
}

/// The f32 elements of a received buffer.
fn values(ledger: &Ledger, buf: CommBuf) -> Vec<f32> {
    let buf = buf
        .into_f32()
        .unwrap_or_else(|_| unreachable!("f32 collectives return f32"));
    ledger.download(FP8_AMAX, &buf)
}

impl Trainer {
    /// This step's largest magnitude of every FP8 site: the largest over the data × context
    /// group (each member saw its own tokens), summed over the pipeline stages (each site
    /// lives on one; the others hold 0), appended to every rank's history. Tensor-parallel
    /// ranks already agree (split operands' maxima are reduced over TP as they are taken).
    pub(super) fn record_fp8_amax(&mut self) -> Result<(), TrainError> {
        let Some(history) = &self.fp8_history else {
            return Ok(());
        };
        let ledger = &self.device.ledger;
        let mut maxima = history.take_step();
        let n = maxima.len();
        if let Some(g) = self.mesh.link(GroupKind::DpCp) {
            let members = g.group.size();
            let h = g
                .comm
                .all_gather(&g.group, comm_buf(ledger, &maxima), vec![n; members]);
            let all = values(ledger, g.comm.wait(h, FP8_AMAX)?);
            for (i, m) in maxima.iter_mut().enumerate() {
                *m = (0..members).map(|r| all[r * n + i]).fold(0.0, f32::max);
            }
        }
        if let Some(g) = self.mesh.link(GroupKind::Pp) {
            let h = g
                .comm
                .all_reduce(&g.group, comm_buf(ledger, &maxima), ReduceOp::Sum);
            maxima = values(ledger, g.comm.wait(h, FP8_AMAX)?);
        }
        if let Some(history) = &mut self.fp8_history {
            history.push(&maxima);
        }
        Ok(())
    }
}

/// The amax history of `config`'s run on this rank's model: empty, or a checkpoint's.
pub(super) fn fp8_history(
    config: &ferrotron_config::Config,
    local: &ferrotron_model::ParamLayout,
    init: crate::Init<'_>,
) -> Result<Option<Fp8History>, TrainError> {
    let len = config.train.fp8_amax_history;
    if len == 0 {
        return Ok(None);
    }
    let global = ferrotron_model::ParamLayout::new(&config.model);
    let mut history = Fp8History::new(&global, local, len);
    if let crate::Init::Checkpoint(ck) = init {
        if let Some(saved) = &ck.manifest.fp8_amax_history {
            history.restore(saved).map_err(TrainError::Checkpoint)?;
        }
    }
    Ok(Some(history))
}
