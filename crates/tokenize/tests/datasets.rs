//! Dataset inputs of `prepare-data`: gzip and zstd files read as their plain versions,
//! directories and glob patterns expanded in sorted order, a seeded shuffle and a seeded
//! validation split that partition the documents, and clear errors for a file cut short or
//! a pattern matching nothing, with nothing written.

use std::io::Write;
use std::path::{Path, PathBuf};

use ferrotron_data::TokenFile;
use ferrotron_data::TokenStore;
use ferrotron_tokenize::sources::expand;
use ferrotron_tokenize::{
    prepare_data, val_path, ByteTokenizer, PrepareOptions, TokenizeError, TokenizerChoice,
};

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ferrotron-datasets-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `n` JSON lines `{"text": "document i …"}`.
fn jsonl(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "{{\"text\": \"document {i}: {}\"}}\n",
                "words ".repeat(i % 7)
            )
        })
        .collect()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest)
}

/// The documents of a byte-level token file, split at the end-of-document token.
fn documents(path: &Path) -> Vec<String> {
    let f = TokenFile::open(path).unwrap();
    let mut ids = vec![0u32; f.len()];
    f.read(0, &mut ids).unwrap();
    ids.split(|&t| t == ByteTokenizer::EOD)
        .filter(|d| !d.is_empty())
        .map(|d| ByteTokenizer.decode_lossy(d))
        .collect()
}

fn prepare(
    inputs: Vec<PathBuf>,
    out: &Path,
    edit: impl Fn(&mut PrepareOptions),
) -> Result<ferrotron_tokenize::PrepareReport, TokenizeError> {
    let mut opts = PrepareOptions::new(inputs, out.to_path_buf(), TokenizerChoice::Bytes);
    edit(&mut opts);
    prepare_data(&opts)
}

#[test]
fn gzip_and_zstd_inputs_give_the_plain_files_tokens() {
    let dir = scratch("compressed");
    let text = jsonl(300);
    std::fs::write(dir.join("d.jsonl"), &text).unwrap();
    std::fs::write(dir.join("d.jsonl.gz"), gzip(text.as_bytes())).unwrap();
    std::fs::write(dir.join("d.jsonl.zst"), zstd(text.as_bytes())).unwrap();
    let plain = prepare(vec![dir.join("d.jsonl")], &dir.join("plain.bin"), |_| {}).unwrap();
    assert_eq!(plain.documents, 300);
    for name in ["d.jsonl.gz", "d.jsonl.zst"] {
        let out = dir.join(format!("{name}.bin"));
        let r = prepare(vec![dir.join(name)], &out, |_| {}).unwrap();
        assert_eq!(
            (r.documents, r.tokens),
            (plain.documents, plain.tokens),
            "{name}"
        );
        assert_eq!(documents(&out), documents(&dir.join("plain.bin")), "{name}");
        // Progress and the report count the file's bytes on disk.
        assert_eq!(
            r.input_bytes,
            std::fs::metadata(dir.join(name)).unwrap().len()
        );
    }
}

#[test]
fn directories_and_patterns_expand_in_sorted_order() {
    let dir = scratch("expand");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    for f in [
        "b.jsonl",
        "a.txt",
        "sub/c.txt.gz",
        ".hidden.txt",
        "model.bin",
    ] {
        std::fs::write(dir.join(f), b"x").unwrap();
    }
    let listed = expand(std::slice::from_ref(&dir)).unwrap();
    assert_eq!(
        listed,
        [
            dir.join("a.txt"),
            dir.join("b.jsonl"),
            dir.join("sub/c.txt.gz")
        ]
    );
    let pattern = dir.join("*.txt");
    assert_eq!(expand(&[pattern]).unwrap(), [dir.join("a.txt")]);
    let none = dir.join("*.parquet");
    let err = expand(&[none]).unwrap_err().to_string();
    assert!(
        err.contains("matches no file") && err.contains("*.parquet"),
        "{err}"
    );
    std::fs::create_dir_all(dir.join("empty")).unwrap();
    let err = expand(&[dir.join("empty")]).unwrap_err().to_string();
    assert!(err.contains("holds no .txt"), "{err}");
}

#[test]
fn shuffle_and_validation_split_are_seeded_and_partition_the_documents() {
    let dir = scratch("split");
    std::fs::write(dir.join("d.jsonl"), jsonl(400)).unwrap();
    let input = vec![dir.join("d.jsonl")];
    let all = {
        prepare(input.clone(), &dir.join("all.bin"), |_| {}).unwrap();
        documents(&dir.join("all.bin"))
    };
    let run = |name: &str, shuffle: Option<u64>, split_seed: u64| {
        let out = dir.join(format!("{name}.bin"));
        let r = prepare(input.clone(), &out, |o| {
            o.shuffle_seed = shuffle;
            o.val_fraction = 0.1;
            o.split_seed = split_seed;
        })
        .unwrap();
        let v = r.validation.clone().unwrap();
        let (val_file, val_docs) = (v.output, v.documents);
        assert_eq!(val_file, val_path(&out));
        assert_eq!(r.documents + val_docs, 400);
        (documents(&out), documents(&val_file))
    };
    let (train, val) = run("ordered", None, 7);
    // A partition of the documents, about 10% held out, in input order.
    assert!((20..=65).contains(&val.len()), "{} held out", val.len());
    let mut union: Vec<String> = train.iter().chain(&val).cloned().collect();
    union.sort();
    let mut sorted_all = all.clone();
    sorted_all.sort();
    assert_eq!(union, sorted_all);
    let in_order: Vec<&String> = all.iter().filter(|d| !val.contains(d)).collect();
    assert_eq!(train.iter().collect::<Vec<_>>(), in_order);
    // Shuffled: the same split (it depends on the seed, not the order), another order, the
    // same one again for the same seed.
    let (shuffled, val_s) = run("shuffled", Some(3), 7);
    let (again, _) = run("again", Some(3), 7);
    let (other, _) = run("other", Some(4), 7);
    let mut a = val_s.clone();
    a.sort();
    let mut b = val.clone();
    b.sort();
    assert_eq!(a, b, "the split does not depend on the shuffle");
    assert_ne!(shuffled, train);
    assert_eq!(shuffled, again);
    assert_ne!(shuffled, other);
    let mut s = shuffled.clone();
    s.sort();
    let mut t = train.clone();
    t.sort();
    assert_eq!(s, t, "a shuffle keeps the documents");
    // Another split seed holds out other documents.
    let (_, val_other) = run("split2", None, 8);
    assert_ne!(val_other, val);
}

#[test]
fn a_compressed_file_cut_short_is_named_and_nothing_is_written() {
    let dir = scratch("cut");
    let gz = gzip(jsonl(2000).as_bytes());
    std::fs::write(dir.join("d.jsonl.gz"), &gz[..gz.len() / 2]).unwrap();
    let zst = zstd(jsonl(2000).as_bytes());
    std::fs::write(dir.join("e.jsonl.zst"), &zst[..zst.len() / 2]).unwrap();
    for name in ["d.jsonl.gz", "e.jsonl.zst"] {
        let out = dir.join(format!("{name}.bin"));
        let err = prepare(vec![dir.join(name)], &out, |o| o.val_fraction = 0.2)
            .unwrap_err()
            .to_string();
        assert!(err.contains(name), "{err}");
        assert!(
            !out.exists() && !val_path(&out).exists(),
            "{name}: output left behind"
        );
    }
    let err = prepare(vec![dir.join("d.jsonl")], &dir.join("x.bin"), |o| {
        o.val_fraction = 1.0
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("--val-fraction"), "{err}");
}

/// A Snappy-compressed Parquet file of two row groups with an optional string column `text`
/// (`None` is a null) and an integer column `id`, as a Hugging Face dataset shard has.
fn write_parquet(path: &Path, groups: &[Vec<Option<String>>]) {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = std::sync::Arc::new(
        parquet::schema::parser::parse_message_type(
            "message schema { OPTIONAL BYTE_ARRAY text (UTF8); REQUIRED INT64 id; }",
        )
        .unwrap(),
    );
    let props = std::sync::Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build(),
    );
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut id = 0i64;
    for rows in groups {
        let mut g = w.next_row_group().unwrap();
        let mut col = g.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = rows
            .iter()
            .flatten()
            .map(|s| ByteArray::from(s.as_str()))
            .collect();
        let defs: Vec<i16> = rows.iter().map(|r| i16::from(r.is_some())).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, Some(&defs), None)
            .unwrap();
        col.close().unwrap();
        let mut col = g.next_column().unwrap().unwrap();
        let ids: Vec<i64> = rows
            .iter()
            .map(|_| {
                id += 1;
                id
            })
            .collect();
        col.typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        col.close().unwrap();
        g.close().unwrap();
    }
    w.close().unwrap();
}

#[test]
fn parquet_rows_are_documents_and_bad_files_or_columns_are_named() {
    let dir = scratch("parquet");
    let docs: Vec<String> = (0..300)
        .map(|i| format!("document {i}: {}", "words ".repeat(i % 5)))
        .collect();
    let mut groups = vec![Vec::new(), Vec::new()];
    for (i, d) in docs.iter().enumerate() {
        groups[usize::from(i >= 120)].push(Some(d.clone()));
    }
    groups[1].push(None); // a null row: an empty document, skipped
    std::fs::create_dir_all(dir.join("data")).unwrap();
    write_parquet(&dir.join("data/train-00000.parquet"), &groups);
    let r = prepare(vec![dir.join("data")], &dir.join("p.bin"), |_| {}).unwrap();
    assert_eq!(r.documents, 300);
    assert_eq!(documents(&dir.join("p.bin")), docs);
    // The same documents as JSON lines give the same token file.
    let jsonl: String = docs
        .iter()
        .map(|d| format!("{}\n", serde_json::json!({"text": d})))
        .collect();
    std::fs::write(dir.join("same.jsonl"), jsonl).unwrap();
    let j = prepare(vec![dir.join("same.jsonl")], &dir.join("j.bin"), |_| {}).unwrap();
    assert_eq!((j.documents, j.tokens), (r.documents, r.tokens));
    let cases = [
        (
            "content",
            "has no column `content` (its columns: text, id); pass --field",
        ),
        ("id", "column `id` holds"),
    ];
    for (field, needle) in cases {
        let out = dir.join(format!("{field}.bin"));
        let err = prepare(vec![dir.join("data/train-00000.parquet")], &out, |o| {
            o.jsonl_field = field.into();
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(needle) && err.contains("train-00000.parquet"),
            "{err}"
        );
        assert!(!out.exists());
    }
    std::fs::write(dir.join("broken.parquet"), b"PAR1 this is not parquet").unwrap();
    let err = prepare(vec![dir.join("broken.parquet")], &dir.join("b.bin"), |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("broken.parquet") && err.contains("not a readable Parquet file"),
        "{err}"
    );
}
