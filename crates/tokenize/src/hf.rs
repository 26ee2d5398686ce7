//! Hugging Face `tokenizer.json` tokenizers, and training a byte-level BPE one.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use crate::input::{documents, ReadOptions};
use crate::{TokenizeError, Tokenizer};

/// Token names recognised as end-of-document, in order of preference.
pub const EOS_NAMES: [&str; 3] = ["</s>", "<|endoftext|>", "<|end_of_text|>"];

/// The special token [`train_bpe`] adds (id 0) and appends after every document.
pub const BPE_EOS: &str = "<|endoftext|>";

/// A Hugging Face tokenizer loaded from a `tokenizer.json`.
///
/// Documents are encoded without the tokenizer's own special tokens (no BOS, no template),
/// padding and truncation are switched off, and the tokenizer's EOS (the first of
/// [`EOS_NAMES`] it defines) is appended after every document; if it defines none, nothing
/// is appended.
#[derive(Debug, Clone)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
    eos: Option<u32>,
    /// Prepended to every document (a model directory whose config adds a BOS).
    bos: Option<u32>,
}

/// A special token of `tokenizer_config.json`: a string, or an object with `content`.
fn special(config: &serde_json::Value, key: &str) -> Option<String> {
    let v = config.get(key)?;
    v.as_str()
        .or_else(|| v.get("content").and_then(|c| c.as_str()))
        .map(str::to_owned)
}

impl HfTokenizer {
    /// Loads `path` (a `tokenizer.json`).
    ///
    /// # Errors
    ///
    /// [`TokenizeError::MissingInput`] if the file does not exist,
    /// [`TokenizeError::LoadTokenizer`] if it is not a valid tokenizer.
    pub fn from_file(path: &Path) -> Result<HfTokenizer, TokenizeError> {
        let json = match std::fs::read_to_string(path) {
            Ok(j) => j,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TokenizeError::MissingInput {
                    path: path.to_owned(),
                })
            }
            Err(e) => return Err(TokenizeError::io("read", path, e)),
        };
        Self::from_json(&json, path)
    }

    /// Loads a model directory's tokenizer: `dir/tokenizer.json`, with the BOS and EOS of
    /// `dir/tokenizer_config.json` when it has one. Its `eos_token` ends every document (else
    /// the first of [`EOS_NAMES`] the vocabulary has); its `bos_token` starts every document
    /// when `add_bos_token` is true, or, without that key, when the tokenizer's own
    /// post-processor adds it (as Llama 3's does).
    ///
    /// # Errors
    ///
    /// [`TokenizeError::MissingInput`] naming `dir/tokenizer.json` when it is absent,
    /// [`TokenizeError::LoadTokenizer`] when either file is invalid or names a special
    /// token the vocabulary lacks.
    pub fn from_dir(dir: &Path) -> Result<HfTokenizer, TokenizeError> {
        let file = dir.join("tokenizer.json");
        let mut tok = HfTokenizer::from_file(&file)?;
        let config_path = dir.join("tokenizer_config.json");
        let Ok(text) = std::fs::read_to_string(&config_path) else {
            return Ok(tok);
        };
        let bad = |reason: String| TokenizeError::LoadTokenizer {
            path: config_path.clone(),
            reason,
        };
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let id = |token: &str| {
            tok.inner.token_to_id(token).ok_or_else(|| {
                bad(format!(
                    "names {token:?}, which tokenizer.json does not have"
                ))
            })
        };
        if let Some(eos) = special(&config, "eos_token") {
            tok.eos = Some(id(&eos)?);
        }
        if let Some(bos) = special(&config, "bos_token") {
            let add = match config.get("add_bos_token").and_then(|v| v.as_bool()) {
                Some(add) => add,
                None => std::fs::read_to_string(&file).is_ok_and(|json| {
                    serde_json::from_str::<serde_json::Value>(&json).is_ok_and(|t| {
                        t.get("post_processor")
                            .is_some_and(|p| p.to_string().contains(&format!("\"{bos}\"")))
                    })
                }),
            };
            if add {
                tok.bos = Some(id(&bos)?);
            }
        }
        Ok(tok)
    }

    /// Parses a `tokenizer.json` document; `path` is only used in messages.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::LoadTokenizer`] if `json` is not a valid tokenizer.
    pub fn from_json(json: &str, path: &Path) -> Result<HfTokenizer, TokenizeError> {
        let load_err = |reason: String| TokenizeError::LoadTokenizer {
            path: path.to_owned(),
            reason,
        };
        let mut inner =
            tokenizers::Tokenizer::from_str(json).map_err(|e| load_err(e.to_string()))?;
        inner
            .with_truncation(None)
            .map_err(|e| load_err(e.to_string()))?;
        inner.with_padding(None);
        let max_id = inner.get_vocab(true).into_values().max();
        let vocab_size = inner
            .get_vocab_size(true)
            .max(max_id.map_or(0, |m| m as usize + 1));
        if vocab_size == 0 {
            return Err(load_err("its vocabulary is empty".to_owned()));
        }
        let eos = EOS_NAMES.iter().find_map(|name| inner.token_to_id(name));
        Ok(HfTokenizer {
            inner,
            path: path.to_owned(),
            vocab_size,
            eos,
            bos: None,
        })
    }

    /// The file the tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The wrapped Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn encode_err(&self, e: tokenizers::Error) -> TokenizeError {
        TokenizeError::Encode {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }

    fn finish_ids(&self, ids: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(ids.len() + 2);
        out.extend(self.bos);
        out.extend_from_slice(ids);
        out.extend(self.eos);
        out
    }
}

impl Tokenizer for HfTokenizer {
    /// Vocabulary size including added tokens (at least the largest id + 1).
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    fn encode_document(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| self.encode_err(e))?;
        Ok(self.finish_ids(enc.get_ids()))
    }

    fn encode_documents(&self, docs: &[String]) -> Result<Vec<Vec<u32>>, TokenizeError> {
        let inputs: Vec<&str> = docs.iter().map(String::as_str).collect();
        let encs = self
            .inner
            .encode_batch_fast(inputs, false)
            .map_err(|e| self.encode_err(e))?;
        Ok(encs.iter().map(|e| self.finish_ids(e.get_ids())).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizeError::Decode {
                path: self.path.clone(),
                reason: e.to_string(),
            })
    }
}

/// Trains a byte-level BPE tokenizer (GPT-2 style: [`ByteLevel`] pre-tokenizer and decoder,
/// no prefix space) with at most `vocab_size` ids on the documents of `inputs`, saves it to
/// `out_path` atomically as a `tokenizer.json`, and returns it.
///
/// Id 0 is [`BPE_EOS`] (`<|endoftext|>`), which the returned tokenizer appends after every
/// document; the next 256 ids are the byte alphabet, the rest are merges. On a small corpus
/// the trainer may run out of merges and produce fewer than `vocab_size` ids.
///
/// # Errors
///
/// [`TokenizeError::BpeVocabTooSmall`] if `vocab_size < 257`, the input errors of
/// [`crate::input::documents`], [`TokenizeError::Train`], or [`TokenizeError::Data`] when
/// saving fails.
pub fn train_bpe(
    inputs: &[PathBuf],
    read: &ReadOptions,
    vocab_size: usize,
    out_path: &Path,
) -> Result<HfTokenizer, TokenizeError> {
    let min = 256 + 1;
    if vocab_size < min {
        return Err(TokenizeError::BpeVocabTooSmall {
            path: out_path.to_owned(),
            vocab_size,
            min,
        });
    }
    crate::input::total_input_bytes(inputs)?;
    let train_err = |reason: String| TokenizeError::Train {
        path: out_path.to_owned(),
        reason,
    };

    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(BPE_EOS, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_post_processor(Some(ByteLevel::new(false, true, true)))
        .with_decoder(Some(ByteLevel::new(false, true, true)));

    // The trainer pulls documents from an iterator that cannot fail, so the first input
    // error is parked here and training stops early.
    let failure: Arc<Mutex<Option<TokenizeError>>> = Arc::new(Mutex::new(None));
    let mut docs = documents(inputs, read);
    let slot = Arc::clone(&failure);
    let texts = std::iter::from_fn(move || match docs.next()? {
        Ok(doc) => Some(doc.text),
        Err(e) => {
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            None
        }
    });
    let trained = tokenizer.train(&mut trainer, texts).map(|_| ());
    if let Some(e) = failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    trained.map_err(|e| train_err(e.to_string()))?;

    let json = tokenizer
        .to_string(true)
        .map_err(|e| train_err(format!("could not serialise the tokenizer: {e}")))?;
    if let Some(dir) = out_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| TokenizeError::io("create directory", dir, e))?;
    }
    ferrotron_data::write_atomic(out_path, json.as_bytes())?;
    HfTokenizer::from_json(&json, out_path)
}
