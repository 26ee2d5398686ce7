//! A mixture of experts' settings beyond its shape: how its loads are balanced and, with a
//! capacity factor, how many assignments each expert takes before it drops the rest.

use serde::{Deserialize, Serialize};

use super::ModelConfig;
use crate::{invalid, ConfigError};

/// How a mixture of experts keeps its experts' loads even.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MoeBalance {
    /// The load-balancing loss alone (`router_aux_loss_coef`; Mixtral, Switch).
    #[default]
    AuxLoss,
    /// Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the router's
    /// probabilities to choose the experts only (the gates stay the unbiased probabilities),
    /// moves by `moe_bias_rate` after every step, up for experts that got fewer than the
    /// mean of the step's assignments and down for those that got more. The load-balancing
    /// loss still applies at `router_aux_loss_coef` (set it to 0 for none).
    Bias,
}

impl ModelConfig {
    pub(crate) fn validate_moe(&self) -> Result<(), ConfigError> {
        if !(self.moe_bias_rate > 0.0 && self.moe_bias_rate.is_finite()) {
            return Err(invalid(
                "model.moe_bias_rate",
                "must be a finite number above 0 (DeepSeek-V3 uses 0.001)",
            ));
        }
        if self.experts == 0 {
            if self.moe_capacity_factor.is_some() {
                return Err(invalid(
                    "model.moe_capacity_factor",
                    "caps the experts of a mixture of experts: set model.experts (and top_k), or \
                     remove moe_capacity_factor for a dense model",
                ));
            }
            if self.moe_balance == MoeBalance::Bias {
                return Err(invalid(
                    "model.moe_balance",
                    "\"bias\" balances the experts of a mixture of experts: set model.experts \
                     (and top_k), or moe_balance = \"aux_loss\" for a dense model",
                ));
            }
            return Ok(());
        }
        if self.qkv_bias {
            return Err(invalid(
                "model.qkv_bias",
                "q/k/v biases (Qwen2) with experts > 0: no Hugging Face architecture has both, \
                 so such a model could not be exported; set qkv_bias = false or experts = 0",
            ));
        }
        if !(1..=self.experts).contains(&self.top_k) {
            return Err(invalid(
                "model.top_k",
                format!(
                    "top_k={} with experts={}: each token goes to between 1 and `experts` experts",
                    self.top_k, self.experts
                ),
            ));
        }
        if self.moe_every == 0 || self.moe_every > self.layers {
            return Err(invalid(
                "model.moe_every",
                format!(
                    "moe_every={} with layers={}: block l is a mixture-of-experts block when (l + 1) % moe_every == 0, so choose 1 ≤ moe_every ≤ layers (or experts = 0 for a dense model)",
                    self.moe_every, self.layers
                ),
            ));
        }
        if !(self.router_aux_loss_coef >= 0.0 && self.router_aux_loss_coef.is_finite()) {
            return Err(invalid(
                "model.router_aux_loss_coef",
                "must be finite and non-negative (0 disables the load-balancing loss)",
            ));
        }
        self.validate_capacity()
    }

    /// `model.moe_capacity_factor`: finite, above 0, and at most the factor that makes every
    /// expert able to take every token's slots.
    fn validate_capacity(&self) -> Result<(), ConfigError> {
        let Some(cf) = self.moe_capacity_factor else {
            return Ok(());
        };
        if !(cf > 0.0 && cf.is_finite()) {
            return Err(invalid(
                "model.moe_capacity_factor",
                format!("{cf}: must be a finite number above 0 (1.0 to 1.25 is usual), or absent for dropless routing"),
            ));
        }
        Ok(())
    }

    /// The most (token, slot) assignments each expert takes from `t` tokens under
    /// `moe_capacity_factor`: `⌈cf · t · top_k / experts⌉` (GShard's, Megatron's), at most
    /// `t` (a token goes to an expert once); None when dropless.
    pub fn expert_capacity(&self, t: usize) -> Option<usize> {
        let cf = self.moe_capacity_factor?;
        Some(expert_capacity(cf, t, self.top_k, self.experts))
    }
}

/// `⌈cf · t · top_k / experts⌉`, at most `t`: the assignments an expert takes from `t`
/// tokens at capacity factor `cf` ([`ModelConfig::expert_capacity`]).
pub fn expert_capacity(cf: f64, t: usize, top_k: usize, experts: usize) -> usize {
    let balanced = (t * top_k) as f64 / experts.max(1) as f64;
    ((cf * balanced).ceil() as usize).min(t)
}

#[cfg(test)]
mod tests {
    use crate::{Config, ModelConfig};

    #[test]
    fn capacity_is_the_rounded_up_balanced_load_at_most_every_token() {
        let m = ModelConfig {
            experts: 8,
            top_k: 2,
            moe_capacity_factor: Some(1.25),
            ..ModelConfig::default()
        };
        // 1.25 · 100·2/8 = 31.25 → 32.
        assert_eq!(m.expert_capacity(100), Some(32));
        let generous = ModelConfig {
            moe_capacity_factor: Some(100.0),
            ..m.clone()
        };
        assert_eq!(generous.expert_capacity(100), Some(100));
        let dropless = ModelConfig {
            moe_capacity_factor: None,
            ..m
        };
        assert_eq!(dropless.expert_capacity(100), None);
    }

    #[test]
    fn bad_capacity_settings_are_refused_by_name() {
        let moe = |cf: Option<f64>, experts: usize, cp: usize| {
            let mut c = Config::default();
            (c.model.experts, c.model.moe_capacity_factor) = (experts, cf);
            c.parallel.cp = cp;
            c.validate().err().map(|e| e.to_string())
        };
        for (cf, experts, cp, why) in [
            (Some(0.0), 4, 1, "above 0"),
            (Some(f64::INFINITY), 4, 1, "finite"),
            (Some(1.0), 0, 1, "set model.experts"),
            (Some(1.0), 4, 2, "context-parallel"),
        ] {
            let e = moe(cf, experts, cp).expect("refused");
            assert!(
                e.contains("model.moe_capacity_factor") && e.contains(why),
                "{e}"
            );
        }
        assert_eq!(moe(Some(1.0), 4, 1), None);
    }
}
