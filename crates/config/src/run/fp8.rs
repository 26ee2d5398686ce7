//! `train.fp8`: the blocks' linear layers with FP8 operands.

use serde::{Deserialize, Serialize};

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
}
