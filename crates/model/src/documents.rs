//! Document masking (`data.document_mask`): windows packed from several documents attend only
//! within each document, and RoPE positions restart at each one.
//!
//! The data side gives, for every token of a micro-batch on this rank, the global position at
//! which its document starts ([`Documents::set`]). A block then rotates each token by its
//! position within its document, and attention hides every key before a query's document
//! ([`ferrotron_tensor::KvBlock::q_start`]), in whole sequences and in context parallelism's
//! ring blocks alike. Pipeline stages look the starts up by micro-batch, so a schedule may
//! interleave micro-batches freely.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use ferrotron_tensor::{Category, Held, Ledger};

/// Each micro-batch's document starts, with the ledger's count of their bytes.
type Table = HashMap<usize, (Arc<Vec<usize>>, Held)>;

/// The document starts of a step's micro-batches on this rank, counted in the ledger as
/// workspace while they are held.
#[derive(Default)]
pub struct Documents {
    by_micro_batch: Mutex<Table>,
}

impl Documents {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // The table holds plain data: a panic elsewhere leaves it consistent.
        self.by_micro_batch
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records micro-batch `mb`'s starts: `[b, seq_len]`, for each token of its windows the
    /// position (within its window) of its document's first token.
    pub fn set(&self, ledger: &Ledger, mb: usize, starts: Vec<usize>) {
        let held = ledger.hold(Category::Workspace, std::mem::size_of_val(&starts[..]));
        self.table().insert(mb, (Arc::new(starts), held));
    }

    /// Micro-batch `mb`'s starts, if recorded.
    pub fn get(&self, mb: usize) -> Option<Arc<Vec<usize>>> {
        self.table().get(&mb).map(|(s, _)| s.clone())
    }

    /// Forgets micro-batch `mb` (its backward is done).
    pub fn end(&self, mb: usize) {
        self.table().remove(&mb);
    }
}

/// Where this rank's tokens sit for one micro-batch's blocks: positions for RoPE (within their
/// documents under document masking) and, under document masking, the document starts for
/// the attention mask — of this rank's tokens, and of every token of the windows (what
/// context parallelism's strategies take).
pub(crate) struct TokenPlaces {
    /// RoPE position of each token.
    pub rope: Vec<usize>,
    /// Global position of each of this rank's tokens' document start (None: no masking).
    pub starts: Option<Vec<usize>>,
    /// The same for every token of the micro-batch's windows, `[b, seq_len]`.
    pub window_starts: Option<Arc<Vec<usize>>>,
}

impl TokenPlaces {
    /// From this rank's tokens' global positions (`[b, n]` flattened) and, with document
    /// masking, the document starts of the whole windows (`[b, seq_len]`).
    pub fn new(global: Vec<usize>, window_starts: Option<Arc<Vec<usize>>>, seq_len: usize) -> Self {
        let Some(window) = window_starts else {
            return TokenPlaces {
                rope: global,
                starts: None,
                window_starts: None,
            };
        };
        let batch = window.len() / seq_len;
        assert_eq!(
            batch * seq_len,
            window.len(),
            "document starts per window token"
        );
        let n = global.len() / batch.max(1);
        let starts: Vec<usize> = global
            .iter()
            .enumerate()
            .map(|(t, &p)| window[(t / n) * seq_len + p])
            .collect();
        let rope = global.iter().zip(&starts).map(|(p, s)| p - s).collect();
        TokenPlaces {
            rope,
            starts: Some(starts),
            window_starts: Some(window),
        }
    }
}
