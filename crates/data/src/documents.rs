//! Documents inside a packed window, for document masking: a document ends with its
//! end-of-document token, and the token after it starts the next.

/// Writes, for each of `tokens` (a window's inputs), the index of its document's first token:
/// the window's first token starts a document, and so does every token right after `eos`.
///
/// # Panics
///
/// When `out` is not as long as `tokens`.
pub fn document_starts(tokens: &[u32], eos: u32, out: &mut [usize]) {
    assert_eq!(tokens.len(), out.len(), "one start per token");
    let mut start = 0;
    for (i, o) in out.iter_mut().enumerate() {
        if i > 0 && tokens[i - 1] == eos {
            start = i;
        }
        *o = start;
    }
}

#[cfg(test)]
mod tests {
    use super::document_starts;

    #[test]
    fn a_document_starts_after_each_end_token() {
        let tokens = [5, 9, 0, 4, 0, 0, 7, 8];
        let mut out = [usize::MAX; 8];
        document_starts(&tokens, 0, &mut out);
        // The end token belongs to the document it ends; two in a row make a one-token one.
        assert_eq!(out, [0, 0, 0, 3, 3, 5, 6, 6]);
        document_starts(&tokens, 42, &mut out);
        assert_eq!(out, [0; 8]);
    }
}
