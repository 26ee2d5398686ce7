//! FP8 delayed scaling (`train.fp8_amax_history = N`, tensorwise): each operand of each
//! linear layer is scaled by the largest magnitude it had over the last `N` steps, as
//! TransformerEngine's delayed scaling does ("max" over the history), instead of its own.
//!
//! A site is one operand role of one linear weight (six per layer: the forward's input and
//! weight, the input gradient's output gradient and weight, the weight gradient's output
//! gradient and input), named by the weight's global name, so every layout holds the same
//! sites. During a step each rank records the largest magnitude every site of its stage saw
//! (after tensor parallelism's reduction); at the step's end the trainer takes the maxima over
//! the data × context group and sums them over the pipeline stages (each site lives on one),
//! so every rank appends the same values: the single rank's history, on every layout. A site
//! with no history yet (the first step) is scaled by its own magnitude.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

use crate::layout::ParamLayout;

/// Operand roles per linear weight.
pub const ROLES: usize = 6;

/// Which operand of which product a site is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `x` of `y = x·wᵀ`.
    ForwardInput = 0,
    /// `w` of `y = x·wᵀ`.
    ForwardWeight = 1,
    /// `dy` of `dx = dy·w`.
    InputGradOutput = 2,
    /// `w` of `dx = dy·w`.
    InputGradWeight = 3,
    /// `dy` of `dw = dyᵀ·x`.
    WeightGradOutput = 4,
    /// `x` of `dw = dyᵀ·x`.
    WeightGradInput = 5,
}

/// The amax history of every FP8 site of the model, and this step's maxima of this rank's.
#[derive(Debug)]
pub struct Fp8History {
    len: usize,
    /// Global names of the FP8 weights, in site order (site = index × `ROLES` + role).
    names: Vec<String>,
    /// This rank's weights, by their flat offset in its layout: their index in `names`.
    local: HashMap<usize, usize>,
    /// Past step maxima per site, oldest first, at most `len`.
    past: Vec<VecDeque<f32>>,
    /// This step's maxima per site (0 where this rank saw none).
    current: Mutex<Vec<f32>>,
}

impl Fp8History {
    /// Histories of `len` steps for the linear weights of `global` (the whole model), of
    /// which this rank holds those of `local`.
    pub fn new(global: &ParamLayout, local: &ParamLayout, len: usize) -> Fp8History {
        let names: Vec<String> = global
            .muon_matrices()
            .into_iter()
            .map(|p| global.params[p].name.clone())
            .collect();
        let by_name: HashMap<&str, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let local = local
            .muon_matrices()
            .into_iter()
            .filter_map(|p| {
                let i = by_name.get(local.params[p].name.as_str())?;
                Some((local.range(p).start, *i))
            })
            .collect();
        let sites = names.len() * ROLES;
        Fp8History {
            len,
            names,
            local,
            past: vec![VecDeque::new(); sites],
            current: Mutex::new(vec![0.0; sites]),
        }
    }

    /// The site of the weight at flat offset `at` of this rank's layout in `role` (None for
    /// a weight whose products FP8 does not cover).
    pub fn site(&self, at: usize, role: Role) -> Option<usize> {
        self.local.get(&at).map(|i| i * ROLES + role as usize)
    }

    /// The magnitude `site`'s operand is scaled by: the largest of its past steps', or its
    /// own `amax` before it has any; records `amax` as this step's.
    pub fn scale_amax(&self, site: usize, amax: f32) -> f32 {
        let mut current = self.current.lock().expect("amax table lock");
        current[site] = current[site].max(amax);
        self.past[site]
            .iter()
            .copied()
            .reduce(f32::max)
            .unwrap_or(amax)
    }

    /// This step's maxima of every site (0 where this rank saw none), and a fresh step.
    pub fn take_step(&self) -> Vec<f32> {
        let mut current = self.current.lock().expect("amax table lock");
        let sites = current.len();
        std::mem::replace(&mut *current, vec![0.0; sites])
    }

    /// Appends a step's maxima (every rank's, reduced), dropping the oldest beyond the length.
    pub fn push(&mut self, maxima: &[f32]) {
        for (past, &m) in self.past.iter_mut().zip(maxima) {
            past.push_back(m);
            while past.len() > self.len {
                past.pop_front();
            }
        }
    }

    /// The histories by weight name, each with its six role lists (oldest first).
    pub fn save(&self) -> BTreeMap<String, Vec<Vec<f32>>> {
        self.names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let roles = (0..ROLES)
                    .map(|r| self.past[i * ROLES + r].iter().copied().collect())
                    .collect();
                (n.clone(), roles)
            })
            .collect()
    }

    /// Restores saved histories (their newest `len` steps). A weight they lack keeps an
    /// empty history; one they hold that this model lacks is an error naming it.
    pub fn restore(&mut self, saved: &BTreeMap<String, Vec<Vec<f32>>>) -> Result<(), String> {
        for (name, roles) in saved {
            let Some(i) = self.names.iter().position(|n| n == name) else {
                return Err(format!(
                    "the checkpoint's FP8 amax history names {name}, which this model lacks"
                ));
            };
            for (r, values) in roles.iter().take(ROLES).enumerate() {
                let keep = values.len().saturating_sub(self.len);
                self.past[i * ROLES + r] = values[keep..].iter().copied().collect();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_config::ModelConfig;

    fn history(len: usize) -> Fp8History {
        let cfg = ModelConfig {
            layers: 2,
            ..ModelConfig::default()
        };
        let layout = ParamLayout::new(&cfg);
        Fp8History::new(&layout, &layout, len)
    }

    #[test]
    fn the_first_step_scales_by_its_own_then_by_the_window() {
        let mut h = history(2);
        let at = h.local.keys().copied().min().unwrap();
        let s = h.site(at, Role::ForwardInput).unwrap();
        assert_eq!(h.scale_amax(s, 3.0), 3.0, "no history: its own");
        assert_eq!(h.scale_amax(s, 5.0), 5.0);
        let step = h.take_step();
        assert_eq!(step[s], 5.0, "the step's largest");
        h.push(&step);
        assert_eq!(h.scale_amax(s, 9.0), 5.0, "the past, not its own");
        let mut two = h.take_step();
        assert_eq!(two[s], 9.0);
        h.push(&two);
        two[s] = 1.0;
        h.push(&two);
        // A window of 2: 5 has left, 9 and 1 remain.
        assert_eq!(h.scale_amax(s, 0.5), 9.0);
        let saved = h.save();
        let mut again = history(1);
        again.restore(&saved).unwrap();
        assert_eq!(again.scale_amax(s, 0.5), 1.0, "the newest one kept");
    }

    #[test]
    fn sites_cover_the_blocks_linear_weights() {
        let h = history(4);
        assert_eq!(h.names.len(), 2 * 7);
        assert_eq!(h.local.len(), 14);
        assert!(
            h.site(0, Role::ForwardWeight).is_none(),
            "the embedding is not FP8"
        );
        let mut bad = BTreeMap::new();
        bad.insert(
            "model.layers.9.mlp.up_proj.weight".to_string(),
            vec![vec![1.0]],
        );
        assert!(history(4).restore(&bad).unwrap_err().contains("layers.9"));
    }
}
