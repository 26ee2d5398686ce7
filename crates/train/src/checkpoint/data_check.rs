//! A resume continues on the tokens its checkpoint consumed, or says it does not.

use ferrotron_config::Config;
use ferrotron_data::DataFingerprint;

use super::Checkpoint;
use crate::TrainError;

/// What `config`'s data is: the token file's fingerprint (from its sidecar where recorded),
/// or the synthetic corpus's.
pub fn data_fingerprint(config: &Config) -> Result<DataFingerprint, TrainError> {
    Ok(match &config.data.path {
        Some(path) => ferrotron_data::fingerprint_of(path)?,
        None => DataFingerprint::Synthetic {
            vocab: config.model.vocab,
        },
    })
}

/// Whether a resume changes the data, and from what to what.
#[derive(Debug, Clone, PartialEq, Eq)]
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
                 back to the checkpoint's data, or pass --allow-data-change to continue on \
                 the new data",
                self.dir.display(),
                from.describe(),
                to.describe()
            )));
        }
        Ok(change)
    }
}
