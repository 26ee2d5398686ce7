//! Integration tests of Hugging Face tokenizers and BPE training.

mod common;

use std::path::PathBuf;

use common::TempDir;
use ferrotron_data::TokenFile;
use ferrotron_data::TokenStore;
use ferrotron_tokenize::{
    prepare_data, train_bpe, HfTokenizer, PrepareOptions, ReadOptions, TokenizeError, Tokenizer,
    TokenizerChoice,
};

/// A word-level tokenizer.json; `added` is the JSON of its `added_tokens` array.
fn word_level(added: &str, extra_vocab: &str) -> String {
    format!(
        r#"{{"version":"1.0",
            "truncation":{{"direction":"Right","max_length":2,"strategy":"LongestFirst","stride":0}},
            "padding":null,"added_tokens":[{added}],"normalizer":null,
            "pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,"decoder":null,
            "model":{{"type":"WordLevel","vocab":{{"[UNK]":0,"hello":1,"world":2{extra_vocab}}},
                      "unk_token":"[UNK]"}}}}"#
    )
}

#[test]
fn hf_tokenizer_without_and_with_eos() {
    let dir = TempDir::new("wordlevel");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, word_level("", "")).unwrap();
    let t = HfTokenizer::from_file(&path).unwrap();
    assert_eq!(t.vocab_size(), 3);
    assert_eq!(t.eos_id(), None);
    // Truncation (max_length 2 in the file) is switched off.
    assert_eq!(t.encode_document("hello world foo").unwrap(), vec![1, 2, 0]);

    let added = r#"{"id":7,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,
                    "normalized":false,"special":true}"#;
    std::fs::write(&path, word_level(added, ",\"</s>\":7")).unwrap();
    let t = HfTokenizer::from_file(&path).unwrap();
    assert_eq!(t.vocab_size(), 8, "largest id + 1");
    assert_eq!(t.eos_id(), Some(7));
    assert_eq!(t.encode_document("world hello").unwrap(), vec![2, 1, 7]);
    assert_eq!(
        t.encode_documents(&["hello".to_owned(), "world world".to_owned()])
            .unwrap(),
        vec![vec![1, 7], vec![2, 2, 7]]
    );
}

#[test]
fn hf_tokenizer_load_errors() {
    let dir = TempDir::new("hferr");
    let path = dir.path().join("tokenizer.json");
    let err = HfTokenizer::from_file(&path).unwrap_err();
    assert!(matches!(err, TokenizeError::MissingInput { .. }), "{err}");
    std::fs::write(&path, "{\"model\": 3}").unwrap();
    let err = HfTokenizer::from_file(&path).unwrap_err();
    assert!(matches!(err, TokenizeError::LoadTokenizer { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

fn corpus(dir: &TempDir) -> PathBuf {
    let path = dir.path().join("corpus.txt");
    let line = "the quick brown fox jumps over the lazy dog and the lazy dog sleeps\n";
    std::fs::write(&path, line.repeat(200)).unwrap();
    path
}

#[test]
fn train_bpe_then_prepare() {
    let dir = TempDir::new("bpe");
    let input = corpus(&dir);
    let tok_path = dir.path().join("tok/tokenizer.json");
    let read = ReadOptions {
        lines_as_documents: true,
        ..ReadOptions::default()
    };
    let tok = train_bpe(std::slice::from_ref(&input), &read, 300, &tok_path).unwrap();
    assert_eq!(tok.eos_id(), Some(0));
    assert!(
        (257..=300).contains(&tok.vocab_size()),
        "{}",
        tok.vocab_size()
    );
    let names: Vec<String> = std::fs::read_dir(dir.path().join("tok"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["tokenizer.json"], "no temporary file is left");

    let doc = "the lazy dog jumps over the quick brown fox";
    let ids = tok.encode_document(doc).unwrap();
    assert_eq!(ids.last(), Some(&0));
    assert!(ids.len() < doc.len() / 2, "{} ids", ids.len());
    assert_eq!(tok.decode(&ids).unwrap(), doc);

    let mut opts = PrepareOptions::new(
        vec![input.clone()],
        dir.path().join("data.bin"),
        TokenizerChoice::HfFile(tok_path.clone()),
    );
    opts.lines_as_documents = true;
    let report = prepare_data(&opts).unwrap();
    assert_eq!(report.documents, 200);
    assert_eq!(report.input_bytes, 68 * 200);
    assert!(report.tokens < report.input_bytes / 4, "{report:?}");
    let expected_per_line = tok
        .encode_document("the quick brown fox jumps over the lazy dog and the lazy dog sleeps")
        .unwrap()
        .len() as u64;
    assert_eq!(report.tokens, 200 * expected_per_line);
    // 14 words, each a single merged token after training, + end-of-text.
    assert_eq!(expected_per_line, 15);
    // The corpus runs out of merges: 1 special + 256 bytes + 40 merges.
    assert_eq!(tok.vocab_size(), 297);
    assert_eq!(report.vocab_size, tok.vocab_size());
    assert_eq!(
        (report.eos_id, tok.eos_id()),
        (Some(0), Some(0)),
        "<|endoftext|> is id 0"
    );
    let f = TokenFile::open(&report.output).unwrap();
    assert_eq!(f.vocab_size(), tok.vocab_size());
    assert_eq!(f.len() as u64, report.tokens);

    // Training inside prepare_data gives the same tokenizer and the same token count.
    opts.tokenizer = TokenizerChoice::TrainBpe {
        vocab_size: 300,
        save_to: dir.path().join("tok2.json"),
    };
    opts.output = dir.path().join("data2.bin");
    let report2 = prepare_data(&opts).unwrap();
    assert_eq!(
        (report2.tokens, report2.vocab_size),
        (report.tokens, report.vocab_size)
    );
    assert_eq!(
        std::fs::read(&tok_path).unwrap(),
        std::fs::read(dir.path().join("tok2.json")).unwrap()
    );
}

#[test]
fn train_bpe_errors() {
    let dir = TempDir::new("bpeerr");
    let input = corpus(&dir);
    let out = dir.path().join("tokenizer.json");
    let err = train_bpe(&[input], &ReadOptions::default(), 256, &out).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::BpeVocabTooSmall {
                vocab_size: 256,
                min: 257,
                ..
            }
        ),
        "{err}"
    );
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\":\"ok\"}\n{\"text\":\"ok\"}\nnot json\n").unwrap();
    let err = train_bpe(&[bad], &ReadOptions::default(), 300, &out).unwrap_err();
    assert!(
        matches!(err, TokenizeError::BadJsonLine { line: 3, .. }),
        "{err}"
    );
    assert!(!out.exists());
}

/// A model directory's tokenizer: BOS and EOS as its tokenizer_config.json says, given as a
/// string or as an object with `content`, or added by the post-processor; a directory without
/// tokenizer.json and a config naming an unknown token are errors naming the file.
#[test]
fn a_model_directory_tokenizer_adds_bos_and_eos_as_its_config_says() {
    let dir = TempDir::new("tokdir");
    let added = r#"{"id":7,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,
                    "normalized":false,"special":true},
                   {"id":8,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,
                    "normalized":false,"special":true}"#;
    let json = word_level(added, ",\"</s>\":7,\"<s>\":8");
    std::fs::write(dir.path().join("tokenizer.json"), &json).unwrap();
    let config = |c: &str| std::fs::write(dir.path().join("tokenizer_config.json"), c).unwrap();
    config(r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": true}"#);
    let t = HfTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.encode_document("hello world").unwrap(), vec![8, 1, 2, 7]);
    config(r#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": false}"#);
    let t = HfTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.encode_document("hello").unwrap(), vec![1, 7]);
    // Without add_bos_token, a post-processor that adds the BOS decides.
    let with_template = json.replace(
        "\"post_processor\":null",
        r#""post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[],"special_tokens":{"<s>":{"id":"<s>","ids":[8],"tokens":["<s>"]}}}"#,
    );
    std::fs::write(dir.path().join("tokenizer.json"), with_template).unwrap();
    config(r#"{"bos_token": "<s>", "eos_token": "</s>"}"#);
    let t = HfTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.encode_document("world").unwrap(), vec![8, 2, 7]);
    // The same through prepare-data with the directory as --tokenizer.
    std::fs::write(dir.path().join("docs.txt"), "hello world").unwrap();
    let out = dir.path().join("t.bin");
    let opts = PrepareOptions::new(
        vec![dir.path().join("docs.txt")],
        out.clone(),
        TokenizerChoice::HfFile(dir.path().to_path_buf()),
    );
    prepare_data(&opts).unwrap();
    let f = TokenFile::open(&out).unwrap();
    let mut ids = vec![0; f.len()];
    f.read(0, &mut ids).unwrap();
    assert_eq!(ids, [8, 1, 2, 7]);
    // Errors name the file.
    config(r#"{"bos_token": "<bos>", "add_bos_token": true}"#);
    let err = HfTokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("<bos>"),
        "{err}"
    );
    let empty = TempDir::new("tokdir-empty");
    let err = HfTokenizer::from_dir(empty.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}
