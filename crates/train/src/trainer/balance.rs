//! Aux-loss-free balancing (`model.moe_balance = "bias"`, DeepSeek-V3): a bias per expert of
//! every mixture-of-experts block, added to the router's probabilities to choose experts
//! only, and moved after every step by the sign rule from the step's expert loads over the
//! global batch.
//!
//! The loads are the step's [`super::experts::MoeStats`] counts, summed over every data,
//! context and pipeline rank, so every rank applies the same update to the same bias: the
//! biases agree bit for bit across ranks and layouts without a collective of their own.

use ferrotron_config::{Config, MoeBalance};
use ferrotron_tensor::{Category, Held, Ledger};

use crate::TrainError;

/// The balancing biases of one trainer (empty when the run balances with the loss alone).
pub struct ExpertBias {
    /// By block index: the bias of each expert of a mixture-of-experts block, empty for the
    /// others (and for every block when inactive).
    layers: Vec<Vec<f32>>,
    rate: f32,
    _held: Option<Held>,
}

impl ExpertBias {
    /// Zero biases for every mixture-of-experts block of `config` when it balances by bias,
    /// counted in `ledger` as optimizer state.
    pub fn new(config: &Config, ledger: &Ledger) -> ExpertBias {
        let m = &config.model;
        let active = m.moe_balance == MoeBalance::Bias;
        let layers: Vec<Vec<f32>> = (0..m.layers)
            .map(|l| match active && m.is_moe_layer(l) {
                true => vec![0.0; m.experts],
                false => Vec::new(),
            })
            .collect();
        let bytes = 4 * layers.iter().map(Vec::len).sum::<usize>();
        ExpertBias {
            layers,
            rate: m.moe_bias_rate as f32,
            _held: (bytes > 0).then(|| ledger.hold(Category::Optimizer, bytes)),
        }
    }

    /// The biases by block index, when the run balances by bias.
    pub fn layers(&self) -> Option<&[Vec<f32>]> {
        self.layers
            .iter()
            .any(|b| !b.is_empty())
            .then_some(self.layers.as_slice())
    }

    /// The mixture-of-experts blocks' biases, in block order (what checkpoints hold).
    pub fn blocks(&self) -> Vec<Vec<f32>> {
        self.layers
            .iter()
            .filter(|b| !b.is_empty())
            .cloned()
            .collect()
    }

    /// The sign rule, from each mixture-of-experts block's assignments per expert over the
    /// step's global batch (in block order): `b += rate · sign(mean − count)`, so an
    /// overloaded expert's bias falls and an underloaded one's rises (an expert exactly at
    /// the mean keeps its bias).
    pub fn update(&mut self, counts: &[Vec<u64>]) {
        let blocks = self.layers.iter_mut().filter(|b| !b.is_empty());
        for (bias, counts) in blocks.zip(counts) {
            let total: u64 = counts.iter().sum();
            // mean < count  ⇔  total < E·count, in integers.
            let e = counts.len() as u64;
            for (b, &c) in bias.iter_mut().zip(counts) {
                let sign = match total.cmp(&(e * c)) {
                    std::cmp::Ordering::Less => -1.0,
                    std::cmp::Ordering::Equal => 0.0,
                    std::cmp::Ordering::Greater => 1.0,
                };
                *b += self.rate * sign;
            }
        }
    }

    /// Takes the biases a checkpoint saved (in block order).
    ///
    /// # Errors
    ///
    /// [`TrainError::Checkpoint`] when their number or shape does not fit this run's blocks.
    pub fn restore(&mut self, blocks: &[Vec<f32>]) -> Result<(), TrainError> {
        let mine: Vec<&mut Vec<f32>> = self.layers.iter_mut().filter(|b| !b.is_empty()).collect();
        let fits =
            mine.len() == blocks.len() && mine.iter().zip(blocks).all(|(a, b)| a.len() == b.len());
        if !fits {
            return Err(TrainError::Checkpoint(format!(
                "the checkpoint holds expert biases of {} blocks, this run balances {} \
                 (model.moe_balance = \"bias\" needs the checkpoint of such a run)",
                blocks.len(),
                mine.len()
            )));
        }
        for (a, b) in mine.into_iter().zip(blocks) {
            a.copy_from_slice(b);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sign_rule_lowers_the_overloaded_and_raises_the_underloaded() {
        let mut c = Config::default();
        (
            c.model.experts,
            c.model.top_k,
            c.model.moe_every,
            c.model.layers,
        ) = (4, 2, 2, 4);
        c.model.moe_balance = MoeBalance::Bias;
        c.model.moe_bias_rate = 0.5;
        let ledger = Ledger::new();
        let mut b = ExpertBias::new(&c, &ledger);
        // Blocks 1 and 3 are the mixture-of-experts ones: 4 f32 biases each.
        assert_eq!(ledger.snapshot().current(Category::Optimizer), 2 * 4 * 4);
        // Mean 5: expert 0 above it, 1 and 3 below, 2 exactly at it.
        b.update(&[vec![10, 2, 5, 3], vec![5, 5, 5, 5]]);
        assert_eq!(b.blocks(), vec![vec![-0.5, 0.5, 0.0, 0.5], vec![0.0; 4]]);
        b.update(&[vec![10, 2, 5, 3], vec![0, 0, 1, 19]]);
        assert_eq!(
            b.blocks(),
            vec![vec![-1.0, 1.0, 0.0, 1.0], vec![0.5, 0.5, 0.5, -0.5]]
        );
        let layers = b.layers().unwrap();
        assert!(layers[0].is_empty() && layers[2].is_empty() && layers[3].len() == 4);
        let mut other = ExpertBias::new(&c, &ledger);
        other.restore(&b.blocks()).unwrap();
        assert_eq!(other.blocks(), b.blocks());
        assert!(other.restore(&[vec![0.0; 4]]).is_err());
        c.model.moe_balance = MoeBalance::AuxLoss;
        assert!(ExpertBias::new(&c, &ledger).layers().is_none());
    }
}
