//! `train.fp8`: the blocks' linear layers with FP8 operands.

use serde::{Deserialize, Serialize};

use crate::{invalid, Config, ConfigError};

/// FP8 linear layers (`train.fp8`): E4M3 forward operands, E5M2 gradients, scaled by the
/// current tensor's largest magnitude (torchao's dynamic scaling), the products summed in
/// f32. Emulated exactly on the CPU (`ferrotron_tensor::fp8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Fp8 {
    /// The products read the operands as stored (default).
    #[default]
    Off,
    /// One scale per operand tensor.
    Tensorwise,
    /// One scale per row or column along which the product does not sum (per token and per
    /// output feature in the forward).
    Rowwise,
}

impl Fp8 {
    /// The value as `train.fp8` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Fp8::Off => "off",
            Fp8::Tensorwise => "tensorwise",
            Fp8::Rowwise => "rowwise",
        }
    }
}

/// The longest FP8 amax history accepted (TransformerEngine's default is 1024).
pub const MAX_AMAX_HISTORY: usize = 1024;

impl Config {
    /// `train.fp8_amax_history`: delayed scaling, for tensorwise FP8.
    pub(crate) fn validate_amax_history(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        match (t.fp8_amax_history, t.fp8) {
            (0, _) | (1..=MAX_AMAX_HISTORY, Fp8::Tensorwise) => Ok(()),
            (n, Fp8::Tensorwise) => Err(invalid(
                "train.fp8_amax_history",
                format!("{n}: at most {MAX_AMAX_HISTORY} steps"),
            )),
            (_, Fp8::Rowwise) => Err(invalid(
                "train.fp8_amax_history",
                "delayed scaling keeps one magnitude per tensor: it needs train.fp8 = \
                 \"tensorwise\" (rowwise scales follow each row's own); set it to 0",
            )),
            (_, Fp8::Off) => Err(invalid(
                "train.fp8_amax_history",
                "is read only with train.fp8 = \"tensorwise\": set that, or set it to 0",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Fp8;
    use crate::{Config, Device, Matmul};

    /// Where the emulation cannot stand for the setting, the run is refused by name.
    #[test]
    fn unsupported_combinations_are_refused_by_name() {
        let with = |set: &dyn Fn(&mut Config)| {
            let mut c = Config::default();
            c.train.fp8 = Fp8::Rowwise;
            set(&mut c);
            c.validate().err().map(|e| e.to_string())
        };
        assert_eq!(with(&|_| {}), None);
        for (set, why) in [
            (
                &(|c: &mut Config| c.train.device = Device::Cuda) as &dyn Fn(&mut Config),
                "CPU only",
            ),
            (
                &|c: &mut Config| {
                    c.train.dtype = crate::DType::Bf16;
                    c.train.matmul = Matmul::Bf16;
                },
                "bf16",
            ),
            (
                &|c: &mut Config| (c.model.experts, c.model.top_k) = (4, 2),
                "mixture of experts",
            ),
            (&|c: &mut Config| c.parallel.cp = 2, "cp=2"),
        ] {
            let e = with(set).expect("refused");
            assert!(e.contains("train.fp8") && e.contains(why), "{e}");
        }
    }

    #[test]
    fn an_amax_history_needs_tensorwise_fp8() {
        let with = |fp8: Fp8, n: usize| {
            let mut c = Config::default();
            (c.train.fp8, c.train.fp8_amax_history) = (fp8, n);
            c.validate().err().map(|e| e.to_string())
        };
        assert_eq!(with(Fp8::Tensorwise, 16), None);
        assert_eq!(with(Fp8::Off, 0), None);
        for (fp8, n, why) in [
            (Fp8::Rowwise, 16, "needs train.fp8 = \"tensorwise\""),
            (Fp8::Off, 4, "read only with train.fp8"),
            (Fp8::Tensorwise, 5000, "at most 1024"),
        ] {
            let e = with(fp8, n).expect("refused");
            assert!(
                e.contains("train.fp8_amax_history") && e.contains(why),
                "{e}"
            );
        }
    }
}
