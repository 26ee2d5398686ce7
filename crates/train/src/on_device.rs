//! A model on a device for inference (`eval`, `generate`): the ledger its buffers are
//! counted in, the whole model on one rank, and its weights uploaded in a storage dtype.
//! The command line builds one from a Hugging Face directory and a backend, then evaluates
//! or decodes through it without touching the kernels' crate.

use std::sync::Arc;

use ferrotron_config::{DType, ModelConfig};
use ferrotron_data::TokenStore;
use ferrotron_model::decode::Decoder;
use ferrotron_model::Llama;
use ferrotron_tensor::{Backend, Category, Device, Ledger, Store};

use crate::{evaluate, EvalGroups, EvalReport, EvalShape, TrainError};

/// The label of the transfer that brings a model's weights to the device.
pub const WEIGHTS: &str = "weights";

/// A whole model on one device, for inference.
pub struct DeviceModel {
    backend: Arc<dyn Backend>,
    ledger: Ledger,
    model: Llama,
    weights: Store,
}

impl DeviceModel {
    /// `weights` (full layout order) of a model of `config`, uploaded to `backend`'s memory and
    /// stored in `dtype` (counted as weights).
    pub fn new(
        config: &ModelConfig,
        weights: &[f32],
        dtype: DType,
        backend: Arc<dyn Backend>,
    ) -> DeviceModel {
        let ledger = backend.memory().map_or_else(Ledger::new, Ledger::on);
        let up = ledger.upload(Category::Weights, WEIGHTS, weights);
        let dev = Device {
            ledger: &ledger,
            backend: &*backend,
        };
        let weights = Store::keep(dev, Category::Weights, crate::state::store_dtype(dtype), up);
        DeviceModel {
            model: Llama::new(config),
            backend,
            ledger,
            weights,
        }
    }

    /// The device: the ledger and the kernels.
    pub fn device(&self) -> Device<'_> {
        Device {
            ledger: &self.ledger,
            backend: &*self.backend,
        }
    }

    /// A decoder over positions below `max_len` ([`Decoder`]).
    pub fn decoder(&self, max_len: usize) -> Decoder<'_> {
        Decoder::new(&self.model, &self.weights, self.device(), max_len)
    }

    /// The mean next-token loss on `file` ([`crate::evaluate`]), the model's `seq_len` per
    /// window.
    pub fn evaluate(
        &self,
        file: &dyn TokenStore,
        shape: EvalShape,
    ) -> Result<EvalReport, TrainError> {
        let groups = EvalGroups::default();
        evaluate(
            (&self.model, &self.weights),
            self.device(),
            file,
            shape,
            groups,
        )
    }
}
