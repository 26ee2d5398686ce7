//! Document masking's share of the MFU numerator. Masked windows do each document's attention
//! only, so the model FLOPs count every document's full matrix, as if it were a sequence of
//! its own ([`ferrotron_config::ModelConfig::model_flops_with_span`]): per token, the
//! documents' squared lengths summed over the global batch, divided by its tokens.

use ferrotron_comm::GroupKind;

use super::Trainer;
use crate::optim::all_reduce_f64;
use crate::TrainError;

/// The label of the transfer that carries a step's document spans to and from its reduction.
pub const DOCUMENT_SPANS: &str = "document spans";

/// The attention spans of the steps so far.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DocumentSpans {
    /// The last step's keys per token.
    last: Option<f64>,
    /// Squared document lengths and tokens of every step so far.
    pairs: f64,
    tokens: f64,
}

impl DocumentSpans {
    /// The last step's mean span (None: documents are not masked, or no step yet).
    pub fn last(&self) -> Option<f64> {
        self.last
    }

    /// The mean span over every step so far.
    pub fn mean(&self) -> Option<f64> {
        (self.tokens > 0.0).then(|| self.pairs / self.tokens)
    }

    fn record(&mut self, pairs: f64, tokens: f64) {
        self.last = Some(pairs / tokens);
        self.pairs += pairs;
        self.tokens += tokens;
    }
}

/// Σ L² over the documents of one window, from each token's document start.
pub(crate) fn squared_lengths(starts: &[usize]) -> u64 {
    let mut total = 0u64;
    let mut i = 0;
    while i < starts.len() {
        let len = starts[i..].iter().take_while(|&&s| s == starts[i]).count() as u64;
        total += len * len;
        i += len as usize;
    }
    total
}

impl Trainer {
    /// Records a step's spans from this rank's squared document lengths (`pairs`, over the
    /// windows it sampled) and the global batch's `tokens`: summed over the data-parallel
    /// replicas (context-parallel ranks of a replica sample the same windows).
    pub(super) fn record_spans(&mut self, pairs: u64, tokens: usize) -> Result<(), TrainError> {
        let (ledger, mesh) = (&self.device.ledger, &self.mesh);
        let mut total = pairs as f64;
        if let Some(group) = mesh.link(GroupKind::DpCp) {
            total = all_reduce_f64(group, ledger, total, DOCUMENT_SPANS)?;
            total /= self.config.parallel.cp as f64;
        }
        self.metrics.spans.record(total, tokens as f64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squared_lengths_sum_each_documents() {
        assert_eq!(squared_lengths(&[0, 0, 0, 3, 3, 5, 6, 6]), 9 + 4 + 1 + 4);
        assert_eq!(squared_lengths(&[0; 5]), 25);
        let mut s = DocumentSpans::default();
        assert_eq!((s.last(), s.mean()), (None, None));
        s.record(18.0, 8.0);
        s.record(64.0, 8.0);
        assert_eq!((s.last(), s.mean()), (Some(8.0), Some(82.0 / 16.0)));
    }
}
