//! Text in and out of a model directory: its `tokenizer.json`, or bytes when it has none
//! (prepare-data's default byte tokens), as `generate` reads a prompt and writes the text.

use std::path::Path;

use crate::{ByteTokenizer, HfTokenizer, TokenizeError};

/// How a model directory's text becomes ids and back.
pub enum TextCodec {
    /// The directory's `tokenizer.json`.
    Hf(Box<HfTokenizer>),
    /// UTF-8 bytes: right only for a model trained on byte tokens.
    Bytes,
}

impl TextCodec {
    /// The codec of model directory `dir`: its `tokenizer.json` where there is one, else
    /// bytes ([`TextCodec::is_bytes`] tells; callers warn that bytes fit only byte-trained
    /// models).
    ///
    /// # Errors
    ///
    /// A `tokenizer.json` that does not load.
    pub fn for_model_dir(dir: &Path) -> Result<TextCodec, TokenizeError> {
        let path = dir.join("tokenizer.json");
        Ok(if path.is_file() {
            TextCodec::Hf(Box::new(HfTokenizer::from_file(&path)?))
        } else {
            TextCodec::Bytes
        })
    }

    /// Whether the text is read as bytes (the directory had no `tokenizer.json`).
    pub fn is_bytes(&self) -> bool {
        matches!(self, TextCodec::Bytes)
    }

    /// The ids of `text`, with the tokenizer's special tokens (BOS) as it adds them.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::BadOption`] naming `--prompt` when the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match self {
            TextCodec::Hf(t) => Ok(t
                .inner()
                .encode(text, true)
                .map_err(|e| TokenizeError::BadOption {
                    option: "--prompt",
                    reason: e.to_string(),
                })?
                .get_ids()
                .to_vec()),
            TextCodec::Bytes => Ok(text.bytes().map(u32::from).collect()),
        }
    }

    /// The text of `ids`, special tokens skipped (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            TextCodec::Hf(t) => t.inner().decode(ids, true).unwrap_or_default(),
            TextCodec::Bytes => ByteTokenizer.decode_lossy(ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_without_a_tokenizer_reads_and_writes_bytes() {
        let codec = TextCodec::for_model_dir(Path::new("/nonexistent-model-dir")).unwrap();
        assert!(codec.is_bytes());
        assert_eq!(codec.encode("hé").unwrap(), vec![104, 195, 169]);
        assert_eq!(codec.decode(&[104, 195, 169]), "hé");
    }
}
