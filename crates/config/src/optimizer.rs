//! The optimizer: AdamW for every parameter, or Muon for the hidden weight matrices with
//! AdamW for the rest (`train.optimizer`, `[train.muon]`).

use serde::{Deserialize, Serialize};

use crate::{invalid, ConfigError};

/// Which optimizer steps the weights (`train.optimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    /// AdamW (decoupled weight decay, bias correction) on every parameter.
    #[default]
    AdamW,
    /// Muon on the blocks' projection matrices (attention Q, K, V, O; the MLP's or each
    /// expert's gate, up, down): momentum orthogonalised by a Newton–Schulz iteration. AdamW,
    /// with the `train` settings, on the rest: embedding, LM head, norms, biases, routers.
    Muon,
}

impl Optimizer {
    /// The value as `train.optimizer` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Optimizer::AdamW => "adamw",
            Optimizer::Muon => "muon",
        }
    }
}

/// How Muon scales an orthogonalised update of an `[rows, cols]` matrix
/// (`train.muon.scale`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MuonScale {
    /// `√max(1, rows/cols)`, as Keller Jordan's reference implementation: pair it with its
    /// own learning rate (`train.muon.lr`, 0.02 there).
    #[default]
    Reference,
    /// `0.2·√max(rows, cols)` (Moonlight): the update's RMS matches AdamW's, so
    /// `train.muon.lr` and `train.muon.weight_decay` can take AdamW's values.
    AdamwRms,
}

/// Muon's settings (`[train.muon]`), read when `train.optimizer = "muon"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MuonConfig {
    /// Peak learning rate of the Muon matrices; it follows the same warmup and cosine decay
    /// as `train.lr`, scaled by `muon.lr / train.lr`.
    pub lr: f64,
    /// Momentum coefficient β: `m ← β·m + (1 − β)·g`.
    pub momentum: f64,
    /// Nesterov momentum: orthogonalise `(1 − β)·g + β·m` instead of `m`.
    pub nesterov: bool,
    /// Newton–Schulz iterations (quintic, coefficients 3.4445, −4.7750, 2.0315).
    pub ns_steps: usize,
    /// Decoupled weight decay of the Muon matrices: `w ← w·(1 − lr·wd)`.
    pub weight_decay: f64,
    /// How the orthogonalised update is scaled by the matrix's shape.
    pub scale: MuonScale,
}

impl Default for MuonConfig {
    fn default() -> Self {
        MuonConfig {
            lr: 0.02,
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            weight_decay: 0.0,
            scale: MuonScale::Reference,
        }
    }
}

/// Elements of the scratch `ferrotron_tensor::muon::newton_schulz` allocates for a `[rows, cols]` matrix: two
/// Gram-sized buffers (`min(rows, cols)²` each) and one the size of the matrix.
pub fn newton_schulz_scratch_elems(rows: usize, cols: usize) -> usize {
    let p = rows.min(cols);
    2 * p * p + rows * cols
}

/// Floating-point operations of `ferrotron_tensor::muon::newton_schulz` on a `[rows, cols]` matrix: per iteration
/// the Gram product (`2p²q`), its square (`2p³`) and the update product (`2p²q`), with
/// `p = min(rows, cols)`, `q = max(rows, cols)`.
pub fn newton_schulz_flops(rows: usize, cols: usize, steps: usize) -> f64 {
    let (p, q) = (rows.min(cols) as f64, rows.max(cols) as f64);
    steps as f64 * (4.0 * p * p * q + 2.0 * p * p * p)
}

/// The most Newton–Schulz iterations accepted (the reference uses 5).
pub const MAX_NS_STEPS: usize = 100;

impl MuonConfig {
    /// Ranges of every field, each refused by name.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(invalid(
                "train.muon.lr",
                format!(
                    "{}: must be a finite number above 0 (0.02 in the reference)",
                    self.lr
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(invalid(
                "train.muon.momentum",
                format!(
                    "{}: must be in [0, 1) (0.95 in the reference)",
                    self.momentum
                ),
            ));
        }
        if self.ns_steps == 0 || self.ns_steps > MAX_NS_STEPS {
            return Err(invalid(
                "train.muon.ns_steps",
                format!(
                    "{}: must be in 1..={MAX_NS_STEPS} (5 in the reference)",
                    self.ns_steps
                ),
            ));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(invalid(
                "train.muon.weight_decay",
                "must be a finite number, 0 or more",
            ));
        }
        Ok(())
    }

    /// The factor an orthogonalised update of a `[rows, cols]` matrix is multiplied by.
    pub fn shape_scale(&self, rows: usize, cols: usize) -> f64 {
        let (r, c) = (rows as f64, cols as f64);
        match self.scale {
            MuonScale::Reference => (r / c).max(1.0).sqrt(),
            MuonScale::AdamwRms => 0.2 * r.max(c).sqrt(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_scales_follow_the_two_conventions() {
        let reference = MuonConfig::default();
        // Tall matrices grow by √(rows/cols), wide ones are left alone.
        assert_eq!(reference.shape_scale(512, 128), 2.0);
        assert_eq!(reference.shape_scale(128, 512), 1.0);
        let rms = MuonConfig {
            scale: MuonScale::AdamwRms,
            ..MuonConfig::default()
        };
        assert!((rms.shape_scale(128, 400) - 4.0).abs() < 1e-12);
        assert!((rms.shape_scale(400, 128) - 4.0).abs() < 1e-12);
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        for (bad, field) in [
            (
                MuonConfig {
                    lr: 0.0,
                    ..Default::default()
                },
                "train.muon.lr",
            ),
            (
                MuonConfig {
                    momentum: 1.0,
                    ..Default::default()
                },
                "train.muon.momentum",
            ),
            (
                MuonConfig {
                    ns_steps: 0,
                    ..Default::default()
                },
                "train.muon.ns_steps",
            ),
            (
                MuonConfig {
                    weight_decay: f64::NAN,
                    ..Default::default()
                },
                "train.muon.weight_decay",
            ),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        MuonConfig::default().validate().unwrap();
    }

    /// A Muon setting under AdamW would be silently ignored: refused, naming the fix.
    #[test]
    fn muon_settings_under_adamw_are_refused() {
        let mut c = crate::Config::default();
        c.train.muon.lr = 0.01;
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("train.muon") && e.contains("optimizer = \"muon\""),
            "{e}"
        );
        c.train.optimizer = Optimizer::Muon;
        c.validate().unwrap();
        let c = crate::Config::from_toml_with_overrides("", &["train.optimizer=sgd".into()]);
        assert!(c.unwrap_err().to_string().contains("adamw"));
    }
}
