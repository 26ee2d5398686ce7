//! A resume continues on the tokens its checkpoint consumed, or says it does not.

use ferrotron_config::Config;
use ferrotron_data::{BlendedData, DataFingerprint};

use super::Checkpoint;
use crate::TrainError;

/// What `config`'s data is: the token file's fingerprint (from its sidecar where recorded),
/// the Megatron dataset's, the blend's, or the synthetic corpus's.
pub fn data_fingerprint(config: &Config) -> Result<DataFingerprint, TrainError> {
    if let Some(path) = &config.data.path {
        return Ok(ferrotron_data::fingerprint_of(path)?);
    }
    if config.data.blend.is_empty() {
        return Ok(DataFingerprint::Synthetic {
            vocab: config.model.vocab,
        });
    }
    let weights: Vec<f64> = config.data.blend.iter().map(|(w, _)| *w).collect();
    let parts = ferrotron_data::blend::shares(&weights)
        .into_iter()
        .zip(&config.data.blend)
        .map(|(weight, (_, path))| {
            Ok(BlendedData {
                weight,
                data: ferrotron_data::fingerprint_of(path)?,
            })
        })
        .collect::<Result<_, TrainError>>()?;
    Ok(DataFingerprint::Blend { parts })
}

/// Whether a resume changes the data, and from what to what.
#[derive(Debug, Clone, PartialEq)]
pub enum DataChange {
    /// The same tokens (or a checkpoint that did not record its data).
    Same,
    /// Other tokens.
    Changed {
        /// What the checkpoint consumed.
        from: DataFingerprint,
        /// What the resumed run would read.
        to: DataFingerprint,
    },
}

impl Checkpoint {
    /// Compares the data the checkpoint consumed with `config`'s.
    pub fn data_change(&self, config: &Config) -> Result<DataChange, TrainError> {
        let Some(from) = &self.manifest.data else {
            return Ok(DataChange::Same);
        };
        let to = data_fingerprint(config)?;
        Ok(if from.same_data(&to) {
            DataChange::Same
        } else {
            DataChange::Changed {
                from: from.clone(),
                to,
            }
        })
    }

    /// Refuses a resume on other data than the checkpoint consumed, naming both, unless
    /// `allow` (then the change is returned for the caller to report).
    pub fn check_data(&self, config: &Config, allow: bool) -> Result<DataChange, TrainError> {
        let change = self.data_change(config)?;
        if let (DataChange::Changed { from, to }, false) = (&change, allow) {
            return Err(TrainError::Checkpoint(format!(
                "checkpoint {} was trained on {}, but this run's data is {}: set data.path \
                 (or data.blend) back to the checkpoint's data, or pass --allow-data-change to continue on \
                 the new data",
                self.dir.display(),
                from.describe(),
                to.describe()
            )));
        }
        Ok(change)
    }
}
