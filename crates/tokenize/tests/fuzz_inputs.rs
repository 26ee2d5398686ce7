//! prepare-data's readers given damaged files — mutated and truncated JSON lines, gzip, zstd
//! and Parquet — return a token file or an error, never panic, and leave no output behind
//! when they fail (proptest, 64 cases per reader and run).

use std::io::Write;
use std::path::{Path, PathBuf};

use ferrotron_tokenize::{prepare_data, PrepareOptions, TokenizerChoice};
use proptest::prelude::*;

fn case_dir(what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "ferrotron-fuzzin-{}-{what}-{n}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `bytes` with `edits` applied and cut to `keep` of its length (per mille).
fn damage(bytes: &[u8], edits: &[(usize, u8)], keep: u16) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for &(at, b) in edits {
        if !out.is_empty() {
            let i = at % out.len();
            out[i] = b;
        }
    }
    out.truncate(out.len() * keep.min(1000) as usize / 1000);
    out
}

fn jsonl() -> Vec<u8> {
    (0..40)
        .map(|i| {
            format!(
                "{{\"text\": \"line {i} of the document {}\"}}\n",
                "x".repeat(i)
            )
        })
        .collect::<String>()
        .into_bytes()
}

/// Runs prepare-data on `name` holding `bytes`: it must not panic, and when it fails it
/// leaves no token file.
fn survives(name: &str, bytes: &[u8]) {
    let dir = case_dir(name.split('.').next_back().unwrap_or("x"));
    let input = dir.join(name);
    std::fs::write(&input, bytes).unwrap();
    let out = dir.join("out.bin");
    let mut opts = PrepareOptions::new(vec![input], out.clone(), TokenizerChoice::Bytes);
    opts.val_fraction = 0.25;
    if prepare_data(&opts).is_err() {
        assert!(!out.exists(), "a failed run left {}", out.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn parquet_bytes() -> Vec<u8> {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = std::sync::Arc::new(
        parquet::schema::parser::parse_message_type(
            "message s { OPTIONAL BYTE_ARRAY text (UTF8); }",
        )
        .unwrap(),
    );
    let props = std::sync::Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build(),
    );
    let mut buf = Vec::new();
    let mut w = SerializedFileWriter::new(&mut buf, schema, props).unwrap();
    let mut g = w.next_row_group().unwrap();
    let mut col = g.next_column().unwrap().unwrap();
    let values: Vec<ByteArray> = (0..30)
        .map(|i| ByteArray::from(format!("row {i}").as_str()))
        .collect();
    col.typed::<ByteArrayType>()
        .write_batch(&values, Some(&[1; 30]), None)
        .unwrap();
    col.close().unwrap();
    g.close().unwrap();
    w.close().unwrap();
    buf
}

fn compress(kind: &str, bytes: &[u8]) -> Vec<u8> {
    match kind {
        "gz" => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(bytes).unwrap();
            e.finish().unwrap()
        }
        _ => ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn json_lines(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8), keep in 0u16..1001) {
        survives("d.jsonl", &damage(&jsonl(), &edits, keep));
    }

    #[test]
    fn gzip_and_zstd(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
                     keep in 0u16..1001, zstd in any::<bool>()) {
        let kind = if zstd { "zst" } else { "gz" };
        survives(&format!("d.jsonl.{kind}"), &damage(&compress(kind, &jsonl()), &edits, keep));
    }

    #[test]
    fn parquet_files(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8), keep in 0u16..1001) {
        survives("d.parquet", &damage(&parquet_bytes(), &edits, keep));
    }
}

#[test]
fn the_undamaged_files_are_read() {
    for (name, bytes) in [
        ("a.jsonl", jsonl()),
        ("b.jsonl.gz", compress("gz", &jsonl())),
        ("c.jsonl.zst", compress("zst", &jsonl())),
        ("d.parquet", parquet_bytes()),
    ] {
        let dir = case_dir("ok");
        std::fs::write(dir.join(name), &bytes).unwrap();
        let opts = PrepareOptions::new(
            vec![dir.join(name)],
            dir.join("o.bin"),
            TokenizerChoice::Bytes,
        );
        let r = prepare_data(&opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(r.documents >= 30, "{name}: {} documents", r.documents);
        let _ = Path::new(&dir);
    }
}
