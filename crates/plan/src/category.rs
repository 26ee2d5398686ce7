//! The memory categories of the engine's ledger and a per-category byte count.

use serde::{Deserialize, Serialize};

/// A memory category of the engine's ledger: the same type the ledger counts in.
pub use ferrotron_config::MemoryCategory as Category;

/// Peak bytes per category of one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// Weights.
    pub weights: u64,
    /// Gradients.
    pub gradients: u64,
    /// Optimizer states.
    pub optimizer: u64,
    /// Activations.
    pub activations: u64,
    /// Communication buffers (rough).
    pub communication: u64,
    /// Workspace (rough).
    pub workspace: u64,
    /// A background checkpoint's host snapshot (`checkpoint.async`): the rank's owned state
    /// as f32 master, first and second moments.
    #[serde(default)]
    pub checkpoint: u64,
}

impl Memory {
    /// Bytes of `cat`.
    pub fn get(&self, cat: Category) -> u64 {
        match cat {
            Category::Weights => self.weights,
            Category::Gradients => self.gradients,
            Category::Optimizer => self.optimizer,
            Category::Activations => self.activations,
            Category::Communication => self.communication,
            Category::Workspace => self.workspace,
            Category::Checkpoint => self.checkpoint,
        }
    }

    /// Sum of every category (an upper bound of the peak: categories peak at different
    /// moments, weights, gradients and optimizer states not at all).
    pub fn total(&self) -> u64 {
        Category::ALL.iter().map(|c| self.get(*c)).sum()
    }

    /// The largest category.
    pub fn dominant(&self) -> Category {
        // The first of equal categories (max_by_key keeps the last).
        Category::ALL
            .into_iter()
            .rev()
            .max_by_key(|c| self.get(*c))
            .unwrap_or(Category::Weights)
    }
}
