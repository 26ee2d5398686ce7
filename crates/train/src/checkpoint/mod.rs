//! Sharded checkpoints: every rank writes what it owns, a manifest lists every file with its
//! checksum, and a checkpoint loads into any other layout. The format is described in
//! [`format`](mod@format); [`crate::Trainer::save_checkpoint`] writes one and
//! [`crate::Init::Checkpoint`] resumes from one.

mod convert;
mod data_check;
pub mod format;
mod load;
mod save;

pub use convert::{export_hf, import_hf};
pub use data_check::{data_fingerprint, DataChange};
pub use format::{Kind, Manifest, PieceMeta};
pub use load::{resolve, Checkpoint};
pub use save::{
    clear_checkpoints, finalize, list_checkpoints, owned_pieces, prepare_partial, write_rank_file,
    OwnedPiece,
};
