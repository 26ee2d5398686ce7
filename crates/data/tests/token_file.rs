//! Integration tests of the token-file format.

mod common;

use common::TempDir;
use ferrotron_data::TokenStore;
use ferrotron_data::{write_token_file, DataError, Dtype, TokenFile, TokenFileWriter};

/// The SHA-256 of a file as coreutils' `sha256sum` prints it (an implementation we do not
/// share).
fn sha256sum(path: &std::path::Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("coreutils' sha256sum");
    let text = String::from_utf8(out.stdout).unwrap();
    text.split_whitespace().next().unwrap().to_string()
}

#[test]
fn a_file_without_a_recorded_hash_is_hashed_on_open() {
    let dir = TempDir::new("legacy");
    let path = dir.path().join("data.bin");
    write_token_file(&path, &ramp(5000, 70_000), 70_000).unwrap();
    let want = sha256sum(&path);
    let recorded = TokenFile::open(&path).unwrap().fingerprint();
    // A sidecar written before hashes were recorded.
    let side_path = dir.path().join("data.bin.json");
    let mut side: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&side_path).unwrap()).unwrap();
    side.as_object_mut().unwrap().remove("sha256");
    std::fs::write(&side_path, side.to_string()).unwrap();
    let computed = TokenFile::open(&path).unwrap().fingerprint();
    assert_eq!(computed, recorded);
    assert_eq!(
        ferrotron_data::fingerprint_of(&path).unwrap(),
        computed,
        "from the sidecar or the file, the same fingerprint"
    );
    match computed {
        ferrotron_data::DataFingerprint::File {
            sha256, num_tokens, ..
        } => {
            assert_eq!(sha256, want);
            assert_eq!(num_tokens, 5000);
        }
        other => panic!("{other:?}"),
    }
}

fn ramp(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7) % vocab) as u32).collect()
}

#[test]
fn round_trip_u16() {
    let dir = TempDir::new("rt16");
    let path = dir.path().join("data.bin");
    let tokens = ramp(1000, 257);
    write_token_file(&path, &tokens, 257).unwrap();

    let side = std::fs::read_to_string(dir.path().join("data.bin.json")).unwrap();
    let side: serde_json::Value = serde_json::from_str(&side).unwrap();
    let sha256 = sha256sum(&path);
    assert_eq!(
        side,
        serde_json::json!({"format":"ferrotron-tokens","version":1,"dtype":"u16",
                           "vocab_size":257,"num_tokens":1000,"sha256":sha256})
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 2000);

    let f = TokenFile::open(&path).unwrap();
    assert_eq!(f.len(), 1000);
    assert!(!f.is_empty());
    assert_eq!(f.vocab_size(), 257);
    assert_eq!(f.dtype(), Dtype::U16);
    assert_eq!(f.get(0), 0);
    assert_eq!(f.get(37), 259 % 257);
    assert_eq!(f.get(999), ((999 * 7) % 257) as u32);
    let mut out = vec![0u32; 5];
    f.read(995, &mut out).unwrap();
    assert_eq!(out, tokens[995..1000]);
    assert!(matches!(
        f.read(996, &mut out),
        Err(DataError::OutOfRange { .. })
    ));
}

#[test]
fn round_trip_u32() {
    let dir = TempDir::new("rt32");
    let path = dir.path().join("big.bin");
    let tokens = vec![0, 65_535, 65_536, 70_000, 99_999, 12];
    write_token_file(&path, &tokens, 100_000).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 24);
    let f = TokenFile::open(&path).unwrap();
    assert_eq!(f.dtype(), Dtype::U32);
    assert_eq!(f.vocab_size(), 100_000);
    let mut out = vec![0u32; 6];
    f.read(0, &mut out).unwrap();
    assert_eq!(out, tokens);
    assert_eq!(f.get(4), 99_999);
}

#[test]
fn vocab_65536_still_fits_u16() {
    let dir = TempDir::new("edge");
    let path = dir.path().join("d.bin");
    write_token_file(&path, &[65_535, 1], 65_536).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 4);
    let f = TokenFile::open(&path).unwrap();
    assert_eq!(f.dtype(), Dtype::U16);
    assert_eq!(f.get(0), 65_535);
}

#[test]
fn truncated_and_oversized_files_are_rejected() {
    let dir = TempDir::new("trunc");
    let path = dir.path().join("data.bin");
    write_token_file(&path, &ramp(1000, 257), 257).unwrap();
    let bytes = std::fs::read(&path).unwrap();

    std::fs::write(&path, &bytes[..1500]).unwrap();
    let err = TokenFile::open(&path).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(
            "data.bin is truncated: sidecar says 1000 tokens (2000 bytes) but the file has 1500 bytes"
        ),
        "{msg}"
    );

    let mut longer = bytes.clone();
    longer.extend_from_slice(&[0, 0]);
    std::fs::write(&path, &longer).unwrap();
    let err = TokenFile::open(&path).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SizeMismatch {
                actual_bytes: 2002,
                expected_bytes: 2000,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("longer than its sidecar says"),
        "{err}"
    );
}

#[test]
fn missing_sidecar_and_missing_bin_name_the_path() {
    let dir = TempDir::new("missing");
    let path = dir.path().join("data.bin");
    write_token_file(&path, &[1, 2, 3], 10).unwrap();

    std::fs::remove_file(&path).unwrap();
    match TokenFile::open(&path).unwrap_err() {
        DataError::MissingFile { path: p, .. } => assert_eq!(p, path),
        e => panic!("unexpected {e}"),
    }

    std::fs::remove_file(dir.path().join("data.bin.json")).unwrap();
    std::fs::write(&path, [1u8, 0]).unwrap();
    let err = TokenFile::open(&path).unwrap_err();
    match &err {
        DataError::MissingFile { path: p, .. } => assert_eq!(p, &dir.path().join("data.bin.json")),
        e => panic!("unexpected {e}"),
    }
    assert!(
        err.to_string().contains("data.bin.json does not exist"),
        "{err}"
    );

    // Neither file: the one the user named is the one reported.
    std::fs::remove_file(&path).unwrap();
    match TokenFile::open(&path).unwrap_err() {
        DataError::MissingFile { path: p, .. } => assert_eq!(p, path),
        e => panic!("unexpected {e}"),
    }
}

#[test]
fn bad_sidecar_json_names_the_file() {
    let dir = TempDir::new("badjson");
    let path = dir.path().join("data.bin");
    write_token_file(&path, &[1, 2, 3], 10).unwrap();
    let side = dir.path().join("data.bin.json");
    std::fs::write(&side, "{\"format\": ").unwrap();
    let err = TokenFile::open(&path).unwrap_err();
    assert!(
        matches!(&err, DataError::BadSidecar { path: p, .. } if *p == side),
        "{err}"
    );
    assert!(err.to_string().contains("data.bin.json"), "{err}");

    std::fs::write(
        &side,
        r#"{"format":"other","version":1,"dtype":"u16","vocab_size":10,"num_tokens":3}"#,
    )
    .unwrap();
    let err = TokenFile::open(&path).unwrap_err();
    assert!(err.to_string().contains("format is \"other\""), "{err}");
}

#[test]
fn token_out_of_range_at_write_leaves_nothing() {
    let dir = TempDir::new("oorw");
    let path = dir.path().join("data.bin");
    let err = write_token_file(&path, &[1, 2, 300, 4], 257).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfRange {
                position: 2,
                id: 300,
                vocab_size: 257,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("token 2 is 300"), "{err}");
    assert_eq!(dir.entries(), Vec::<String>::new());

    let mut w = TokenFileWriter::create(&path, 257).unwrap();
    w.push(&[1, 2, 3]).unwrap();
    let err = w.push(&[4, 257]).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfRange {
                position: 4,
                id: 257,
                ..
            }
        ),
        "{err}"
    );
    drop(w);
    assert_eq!(dir.entries(), Vec::<String>::new());
}

#[test]
fn corrupted_token_is_found_on_open() {
    let dir = TempDir::new("corrupt");
    let path = dir.path().join("data.bin");
    write_token_file(&path, &ramp(100, 257), 257).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[2 * 37..2 * 37 + 2].copy_from_slice(&300u16.to_le_bytes());
    bytes[2 * 60..2 * 60 + 2].copy_from_slice(&999u16.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = TokenFile::open(&path).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfRange {
                position: 37,
                id: 300,
                vocab_size: 257,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn empty_files_are_errors() {
    let dir = TempDir::new("empty");
    let path = dir.path().join("data.bin");
    assert!(matches!(
        write_token_file(&path, &[], 10),
        Err(DataError::Empty { .. })
    ));
    let w = TokenFileWriter::create(&path, 10).unwrap();
    assert!(matches!(w.finish(), Err(DataError::Empty { .. })));
    assert_eq!(dir.entries(), Vec::<String>::new());

    std::fs::write(&path, []).unwrap();
    std::fs::write(
        dir.path().join("data.bin.json"),
        r#"{"format":"ferrotron-tokens","version":1,"dtype":"u16","vocab_size":10,"num_tokens":0}"#,
    )
    .unwrap();
    assert!(matches!(
        TokenFile::open(&path),
        Err(DataError::Empty { .. })
    ));
}

#[test]
fn invalid_vocab_size_is_rejected() {
    let dir = TempDir::new("vocab0");
    let path = dir.path().join("data.bin");
    assert!(matches!(
        write_token_file(&path, &[], 0),
        Err(DataError::InvalidVocabSize { vocab_size: 0, .. })
    ));
}

#[test]
fn check_vocab_against_model() {
    let dir = TempDir::new("checkvocab");
    let path = dir.path().join("data.bin");
    write_token_file(&path, &[1, 49_999], 50_000).unwrap();
    let f = TokenFile::open(&path).unwrap();
    f.check_vocab(50_000).unwrap();
    f.check_vocab(50_257).unwrap();
    let err = f.check_vocab(256).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("data file "), "{msg}");
    assert!(
        msg.contains("data.bin has vocab_size 50000 but model.vocab is 256: "),
        "{msg}"
    );
}

#[test]
fn atomic_write_leaves_no_temp_files_and_overwrites() {
    let dir = TempDir::new("atomic");
    let path = dir.path().join("data.bin");
    write_token_file(&path, &[5; 10], 257).unwrap();
    assert_eq!(dir.entries(), ["data.bin", "data.bin.json"]);

    // Overwrite with a different file through the streaming writer.
    let mut w = TokenFileWriter::create(&path, 100_000).unwrap();
    assert_eq!(
        dir.entries(),
        [".data.bin.tmp", "data.bin", "data.bin.json"],
        "tokens go to a temporary file until finish"
    );
    w.push(&[1, 2]).unwrap();
    w.push(&[]).unwrap();
    w.push(&[70_000]).unwrap();
    assert_eq!(w.num_tokens(), 3);
    assert_eq!(w.finish().unwrap(), 3);
    assert_eq!(dir.entries(), ["data.bin", "data.bin.json"]);
    let f = TokenFile::open(&path).unwrap();
    assert_eq!((f.len(), f.vocab_size(), f.get(2)), (3, 100_000, 70_000));

    // A writer dropped before finish leaves the previous file intact.
    let mut w = TokenFileWriter::create(&path, 257).unwrap();
    w.push(&[9; 50]).unwrap();
    drop(w);
    assert_eq!(dir.entries(), ["data.bin", "data.bin.json"]);
    assert_eq!(TokenFile::open(&path).unwrap().len(), 3);
}

#[test]
fn streaming_writer_matches_one_shot_writer() {
    let dir = TempDir::new("stream");
    let a = dir.path().join("a.bin");
    let b = dir.path().join("b.bin");
    let tokens = ramp(10_000, 300);
    write_token_file(&a, &tokens, 300).unwrap();
    let mut w = TokenFileWriter::create(&b, 300).unwrap();
    for chunk in tokens.chunks(777) {
        w.push(chunk).unwrap();
    }
    w.finish().unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert_eq!(
        std::fs::read(dir.path().join("a.bin.json")).unwrap(),
        std::fs::read(dir.path().join("b.bin.json")).unwrap()
    );
}

#[test]
fn writer_in_missing_directory_is_an_io_error() {
    let dir = TempDir::new("nodir");
    let path = dir.path().join("no/such/dir/data.bin");
    let err = TokenFileWriter::create(&path, 10).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::Io {
                action: "create",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains(".data.bin.tmp"), "{err}");
}
