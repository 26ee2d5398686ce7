//! What a run's tokens are, so that a resumed run can tell whether it continues on the data
//! it was trained on: a token file by its contents (token count and SHA-256, recorded by
//! `prepare-data` as it writes), the synthetic corpus by its vocabulary and seed.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The identity of a token source.
///
/// Token files and Megatron datasets are the same data when their contents are, wherever
/// they lie; a blend when its weights and every corpus are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataFingerprint {
    /// The embedded synthetic corpus (its language depends on the vocabulary alone; the
    /// seed picks the sample order).
    Synthetic {
        /// Vocabulary size.
        vocab: usize,
    },
    /// A token file: named by its path, identified by its contents.
    File {
        /// The `.bin` path it was opened from.
        path: PathBuf,
        /// Tokens in it.
        num_tokens: u64,
        /// Lowercase hex SHA-256 of the `.bin` bytes.
        sha256: String,
    },
    /// A Megatron indexed dataset: named by its prefix, identified by its contents.
    Megatron {
        /// The prefix (`PREFIX.bin` + `PREFIX.idx`).
        prefix: PathBuf,
        /// Tokens in it.
        num_tokens: u64,
        /// Lowercase hex SHA-256 of the index's SHA-256 (hex) followed by the `.bin` bytes.
        sha256: String,
    },
    /// A blend of corpora, each with its share of the samples.
    Blend {
        /// The corpora in `data.blend`'s order.
        parts: Vec<BlendedData>,
    },
}

/// One corpus of a blend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlendedData {
    /// Its share of the samples (the blend's weights normalised to sum to 1).
    pub weight: f64,
    /// What it is.
    pub data: DataFingerprint,
}

impl DataFingerprint {
    /// Whether both name the same tokens (a token file may have moved: its path does not
    /// count).
    pub fn same_data(&self, other: &DataFingerprint) -> bool {
        match (self, other) {
            (
                DataFingerprint::File {
                    num_tokens: a,
                    sha256: x,
                    ..
                },
                DataFingerprint::File {
                    num_tokens: b,
                    sha256: y,
                    ..
                },
            ) => a == b && x == y,
            (
                DataFingerprint::Megatron {
                    num_tokens: a,
                    sha256: x,
                    ..
                },
                DataFingerprint::Megatron {
                    num_tokens: b,
                    sha256: y,
                    ..
                },
            ) => a == b && x == y,
            (DataFingerprint::Blend { parts: a }, DataFingerprint::Blend { parts: b }) => {
                a.len() == b.len()
                    && a.iter()
                        .zip(b)
                        .all(|(a, b)| a.weight == b.weight && a.data.same_data(&b.data))
            }
            (a, b) => a == b,
        }
    }

    /// One line for messages: `data/a.bin (1000 tokens, SHA-256 0123abcd…)` or `the
    /// embedded synthetic corpus (vocab 257)`.
    pub fn describe(&self) -> String {
        match self {
            DataFingerprint::Synthetic { vocab } => {
                format!("the embedded synthetic corpus (vocab {vocab})")
            }
            DataFingerprint::File {
                path,
                num_tokens,
                sha256,
            } => format!(
                "{} ({num_tokens} tokens, SHA-256 {}…)",
                path.display(),
                &sha256[..sha256.len().min(12)]
            ),
            DataFingerprint::Megatron {
                prefix,
                num_tokens,
                sha256,
            } => format!(
                "Megatron dataset {} ({num_tokens} tokens, SHA-256 {}…)",
                prefix.display(),
                &sha256[..sha256.len().min(12)]
            ),
            DataFingerprint::Blend { parts } => {
                let parts: Vec<String> = parts
                    .iter()
                    .map(|p| format!("{:.4} × {}", p.weight, p.data.describe()))
                    .collect();
                format!("a blend of {}", parts.join(" + "))
            }
        }
    }
}

/// A SHA-256 computed over bytes as they stream past.
#[derive(Debug, Clone, Default)]
pub struct StreamHash(sha2::Sha256);

impl StreamHash {
    /// Adds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        sha2::Digest::update(&mut self.0, bytes);
    }

    /// The lowercase hex digest.
    pub fn hex(self) -> String {
        sha2::Digest::finalize(self.0)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// The lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let mut h = StreamHash::default();
    h.update(bytes);
    h.hex()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_sha256() {
        // FIPS 180-2's "abc" example.
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let mut h = StreamHash::default();
        h.update(b"a");
        h.update(b"bc");
        assert_eq!(h.hex(), sha256_hex(b"abc"));
    }

    #[test]
    fn a_moved_file_is_the_same_data_and_another_is_not() {
        let file = |path: &str, sha: &str| DataFingerprint::File {
            path: path.into(),
            num_tokens: 10,
            sha256: sha.into(),
        };
        assert!(file("a.bin", "00").same_data(&file("moved/a.bin", "00")));
        assert!(!file("a.bin", "00").same_data(&file("a.bin", "01")));
        let synthetic = DataFingerprint::Synthetic { vocab: 257 };
        assert!(!synthetic.same_data(&file("a.bin", "00")));
        assert!(synthetic.same_data(&synthetic.clone()));
    }
}
