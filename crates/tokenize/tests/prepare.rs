//! Integration tests of input reading and `prepare_data`.

mod common;

use std::path::PathBuf;

use common::TempDir;
use ferrotron_data::TokenFile;
use ferrotron_data::TokenStore;
use ferrotron_tokenize::{prepare_data, PrepareOptions, TokenizeError, TokenizerChoice};

fn write(dir: &TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn bytes_opts(inputs: Vec<PathBuf>, dir: &TempDir) -> PrepareOptions {
    PrepareOptions::new(
        inputs,
        dir.path().join("out/data.bin"),
        TokenizerChoice::Bytes,
    )
}

#[test]
fn text_files_are_one_document_each() {
    let dir = TempDir::new("text");
    let a = write(&dir, "a.txt", "hello world\n");
    let b = write(&dir, "b.txt", "héllo");
    let empty = write(&dir, "empty.txt", "");
    let report = prepare_data(&bytes_opts(vec![a, empty, b], &dir)).unwrap();
    assert_eq!(report.documents, 2);
    assert_eq!(report.tokens, 12 + 1 + 6 + 1);
    assert_eq!(report.vocab_size, 257);
    // The byte tokenizer ends each document with 256: what data.eos_id takes.
    assert_eq!(report.eos_id, Some(256));
    assert_eq!(report.input_bytes, 18);
    assert_eq!(report.output, dir.path().join("out/data.bin"));

    let f = TokenFile::open(&report.output).unwrap();
    assert_eq!((f.len(), f.vocab_size()), (20, 257));
    let mut all = vec![0u32; 20];
    f.read(0, &mut all).unwrap();
    assert_eq!(&all[..5], &[104, 101, 108, 108, 111]);
    assert_eq!((all[11], all[12]), (10, 256));
    assert_eq!(&all[13..], &[104, 195, 169, 108, 108, 111, 256]);

    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["tokens"], 20);
    assert_eq!(json["documents"], 2);
}

#[test]
fn lines_as_documents() {
    let dir = TempDir::new("lines");
    let a = write(&dir, "a.txt", "a\n\nbc\r\ndef");
    let mut opts = bytes_opts(vec![a], &dir);
    opts.lines_as_documents = true;
    let report = prepare_data(&opts).unwrap();
    assert_eq!(report.documents, 3);
    assert_eq!(report.tokens, 2 + 3 + 4);
    let f = TokenFile::open(&report.output).unwrap();
    let mut all = vec![0u32; 9];
    f.read(0, &mut all).unwrap();
    assert_eq!(all, [97, 256, 98, 99, 256, 100, 101, 102, 256]);
}

#[test]
fn jsonl_text_field() {
    let dir = TempDir::new("jsonl");
    let j = write(
        &dir,
        "data.jsonl",
        "{\"text\":\"abc\"}\n\n{\"text\":\"h\\u00e9llo\",\"id\":3}\n{\"body\":\"x\",\"text\":\"\"}\n",
    );
    let report = prepare_data(&bytes_opts(vec![j.clone()], &dir)).unwrap();
    assert_eq!(report.documents, 2);
    assert_eq!(report.tokens, 4 + 7);

    let k = write(&dir, "other.json", "{\"body\":\"xy\"}\n{\"body\":\"z\"}\n");
    let mut opts = bytes_opts(vec![k], &dir);
    opts.jsonl_field = "body".to_owned();
    let report = prepare_data(&opts).unwrap();
    assert_eq!((report.documents, report.tokens), (2, 5));
}

#[test]
fn bad_jsonl_lines_name_file_and_line() {
    let dir = TempDir::new("badjsonl");
    let j = write(&dir, "data.jsonl", "{\"text\":\"a\"}\n\n{\"text\": oops}\n");
    let err = prepare_data(&bytes_opts(vec![j], &dir)).unwrap_err();
    assert!(
        matches!(err, TokenizeError::BadJsonLine { line: 3, .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("data.jsonl:3: not a valid JSON line"),
        "{err}"
    );
    assert!(!dir.path().join("out/data.bin").exists());
    assert!(!dir.path().join("out/data.bin.json").exists());
    assert_eq!(
        std::fs::read_dir(dir.path().join("out")).unwrap().count(),
        0
    );

    let j = write(&dir, "nofield.jsonl", "{\"text\":\"a\"}\n{\"txt\":\"b\"}\n");
    let err = prepare_data(&bytes_opts(vec![j], &dir)).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::BadField {
                line: 2,
                problem: "no",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("nofield.jsonl:2: no field \"text\""),
        "{err}"
    );

    let j = write(&dir, "num.jsonl", "{\"text\":5}\n");
    let err = prepare_data(&bytes_opts(vec![j], &dir)).unwrap_err();
    assert!(
        err.to_string()
            .contains("num.jsonl:1: a non-string field \"text\""),
        "{err}"
    );

    let j = write(&dir, "arr.jsonl", "[1,2]\n");
    let err = prepare_data(&bytes_opts(vec![j], &dir)).unwrap_err();
    assert!(
        matches!(err, TokenizeError::BadJsonLine { line: 1, .. }),
        "{err}"
    );
}

#[test]
fn input_errors() {
    let dir = TempDir::new("inerr");
    let missing = dir.path().join("nope.txt");
    let err = prepare_data(&bytes_opts(vec![missing.clone()], &dir)).unwrap_err();
    assert!(
        matches!(&err, TokenizeError::MissingInput { path } if *path == missing),
        "{err}"
    );

    let err = prepare_data(&bytes_opts(vec![], &dir)).unwrap_err();
    assert!(matches!(err, TokenizeError::NoInputs), "{err}");

    // A directory is read as the files under it; one holding none is named.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = prepare_data(&bytes_opts(vec![empty.clone()], &dir)).unwrap_err();
    assert!(
        matches!(&err, TokenizeError::EmptyDirectory { path } if *path == empty),
        "{err}"
    );

    let bad = dir.path().join("latin1.txt");
    std::fs::write(&bad, b"ok\nstill ok\ncaf\xe9\n").unwrap();
    let err = prepare_data(&bytes_opts(vec![bad.clone()], &dir)).unwrap_err();
    assert!(
        matches!(err, TokenizeError::NotUtf8 { line: 3, .. }),
        "{err}"
    );
    let mut opts = bytes_opts(vec![bad], &dir);
    opts.lines_as_documents = true;
    let err = prepare_data(&opts).unwrap_err();
    assert!(
        err.to_string().contains("latin1.txt:3: not valid UTF-8"),
        "{err}"
    );

    let empty = write(&dir, "empty.txt", "");
    let err = prepare_data(&bytes_opts(vec![empty], &dir)).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizeError::Data(ferrotron_data::DataError::Empty { .. })
        ),
        "{err}"
    );
}
