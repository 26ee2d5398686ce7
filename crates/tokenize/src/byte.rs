//! The tokenizer trait and the byte-level tokenizer.

use crate::TokenizeError;

/// Turns documents into token ids, ending every document with an end-of-document token when
/// the tokenizer has one.
pub trait Tokenizer: Send + Sync {
    /// Every id this tokenizer produces is below this.
    fn vocab_size(&self) -> usize;

    /// The id appended after every document, if any.
    fn eos_id(&self) -> Option<u32>;

    /// The ids of one document, followed by [`Tokenizer::eos_id`] when there is one.
    ///
    /// # Errors
    ///
    /// [`TokenizeError::Encode`] when the underlying tokenizer fails.
    fn encode_document(&self, text: &str) -> Result<Vec<u32>, TokenizeError>;

    /// [`Tokenizer::encode_document`] for many documents (implementations may run in
    /// parallel); the result is in input order.
    ///
    /// # Errors
    ///
    /// As [`Tokenizer::encode_document`].
    fn encode_documents(&self, docs: &[String]) -> Result<Vec<Vec<u32>>, TokenizeError> {
        docs.iter().map(|d| self.encode_document(d)).collect()
    }

    /// Text of `ids` (end-of-document tokens are dropped).
    ///
    /// # Errors
    ///
    /// [`TokenizeError::Decode`] when the underlying tokenizer fails.
    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError>;
}

/// Byte-level tokenizer: ids `0..=255` are the UTF-8 bytes of the text, id
/// [`ByteTokenizer::EOD`] (256) ends every document. Vocabulary size 257.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// The end-of-document id.
    pub const EOD: u32 = 256;
    /// 256 bytes + end-of-document.
    pub const VOCAB_SIZE: usize = 257;

    /// The bytes of `text` followed by [`ByteTokenizer::EOD`].
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() + 1);
        ids.extend(text.bytes().map(u32::from));
        ids.push(Self::EOD);
        ids
    }

    /// The text of `ids`: end-of-document tokens and ids above 256 are dropped, invalid UTF-8
    /// becomes U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Tokenizer for ByteTokenizer {
    fn vocab_size(&self) -> usize {
        Self::VOCAB_SIZE
    }

    fn eos_id(&self) -> Option<u32> {
        Some(Self::EOD)
    }

    fn encode_document(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.encode(text))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        Ok(self.decode_lossy(ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_with_accent() {
        let t = ByteTokenizer;
        assert_eq!(
            t.encode_document("héllo").unwrap(),
            vec![104, 195, 169, 108, 108, 111, 256]
        );
        assert_eq!(t.vocab_size(), 257);
        assert_eq!(t.eos_id(), Some(256));
        assert_eq!(t.decode(&[104, 195, 169, 256, 108]).unwrap(), "hél");
        assert_eq!(t.encode(""), vec![256]);
    }
}
