//! The memory categories: the one list the ledger counts in, the estimator predicts, and
//! the reports and metrics name.

use serde::{Deserialize, Serialize};

/// What a buffer holds (playbook §1: weights, gradients, optimizer states, activations, plus
/// communication buffers and workspace).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryCategory {
    /// Model weights used by forward and backward (bf16 copies in mixed precision).
    Weights,
    /// Gradients (and the fp32 accumulation buffer where enabled).
    Gradients,
    /// Optimizer states: Adam moments, and fp32 master weights in mixed precision.
    Optimizer,
    /// Activations saved by forward for backward.
    Activations,
    /// Buffers that only exist to send or receive (buckets, gathered weights, sent
    /// activations).
    Communication,
    /// Temporaries of a kernel or layer, freed before the step ends.
    Workspace,
    /// A background checkpoint's host snapshot of the state (`checkpoint.async`), held from
    /// the step boundary it was taken at until its file is written.
    Checkpoint,
}

impl MemoryCategory {
    /// How many categories there are.
    pub const COUNT: usize = 7;

    /// Every category, in report order (`ALL[c.index()] == c`).
    pub const ALL: [MemoryCategory; Self::COUNT] = [
        MemoryCategory::Weights,
        MemoryCategory::Gradients,
        MemoryCategory::Optimizer,
        MemoryCategory::Activations,
        MemoryCategory::Communication,
        MemoryCategory::Workspace,
        MemoryCategory::Checkpoint,
    ];

    /// Every category's name, in report order.
    pub const NAMES: [&'static str; Self::COUNT] = [
        MemoryCategory::ALL[0].name(),
        MemoryCategory::ALL[1].name(),
        MemoryCategory::ALL[2].name(),
        MemoryCategory::ALL[3].name(),
        MemoryCategory::ALL[4].name(),
        MemoryCategory::ALL[5].name(),
        MemoryCategory::ALL[6].name(),
    ];

    /// Lower-case name used in reports, metrics and `summary.json`.
    pub const fn name(self) -> &'static str {
        match self {
            MemoryCategory::Weights => "weights",
            MemoryCategory::Gradients => "gradients",
            MemoryCategory::Optimizer => "optimizer",
            MemoryCategory::Activations => "activations",
            MemoryCategory::Communication => "communication",
            MemoryCategory::Workspace => "workspace",
            MemoryCategory::Checkpoint => "checkpoint",
        }
    }

    /// Position in [`Self::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::MemoryCategory;

    #[test]
    fn order_names_and_serde_agree() {
        for (i, c) in MemoryCategory::ALL.into_iter().enumerate() {
            assert_eq!(c.index(), i);
            assert_eq!(MemoryCategory::NAMES[i], c.name());
            let json = format!("\"{}\"", c.name());
            let back: MemoryCategory = serde_json_like(&json);
            assert_eq!(back, c);
        }
    }

    /// Deserialises a quoted lower-case name through TOML (the crate's own format).
    fn serde_json_like(quoted: &str) -> MemoryCategory {
        #[derive(serde::Deserialize)]
        struct W {
            c: MemoryCategory,
        }
        toml::from_str::<W>(&format!("c = {quoted}")).unwrap().c
    }
}
