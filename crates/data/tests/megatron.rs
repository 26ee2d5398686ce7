//! Megatron indexed datasets against a Python writer and reader of the format written from
//! its description (`tests/fixtures/megatron_format.py`, no ferrotron code), and blends.

mod common;
#[path = "fixtures/megatron_python.rs"]
mod megatron_python;

use std::path::Path;

use common::TempDir;
use ferrotron_data::blend::corpus_seed;
use ferrotron_data::{
    locate, open_tokens, write_token_file, Blend, DataError, DataSource, FileSampler, Located,
    MegatronFile, MegatronWriter, TokenFile, TokenStore,
};
use megatron_python::{python_read, python_write};

/// Documents of varied lengths (1 to 40 ids) below `vocab`.
fn documents(n: usize, vocab: i64) -> Vec<Vec<i64>> {
    (0..n)
        .map(|d| {
            (0..1 + (d * 7) % 40)
                .map(|i| ((d * 31 + i * 17) as i64) % vocab)
                .collect()
        })
        .collect()
}

fn flat(docs: &[Vec<i64>]) -> Vec<u32> {
    docs.iter().flatten().map(|&t| t as u32).collect()
}

#[test]
fn a_python_written_dataset_reads_as_the_same_tokens_in_every_dtype() {
    let dir = TempDir::new("mg-read");
    for code in [1u8, 2, 3, 4, 5, 8] {
        let vocab = if code <= 2 { 100 } else { 300 };
        let docs = documents(50, vocab);
        let prefix = dir.path().join(format!("corpus_{code}"));
        python_write(&prefix, code, &docs);
        let file = MegatronFile::open(&prefix).unwrap();
        let want = flat(&docs);
        assert_eq!(file.len(), want.len(), "dtype {code}");
        assert_eq!(file.documents(), 50);
        assert_eq!(file.vocab_size(), *want.iter().max().unwrap() as usize + 1);
        let mut got = vec![0u32; want.len()];
        file.read(0, &mut got).unwrap();
        assert_eq!(got, want, "dtype {code}");
    }
}

#[test]
fn its_windows_are_the_token_files_windows() {
    let dir = TempDir::new("mg-windows");
    let docs = documents(80, 257);
    let prefix = dir.path().join("corpus");
    python_write(&prefix, 8, &docs);
    let tokens = dir.path().join("corpus_tokens.bin");
    write_token_file(&tokens, &flat(&docs), 257).unwrap();
    let a = FileSampler::new(MegatronFile::open(&prefix).unwrap(), 16, 7).unwrap();
    let b = FileSampler::new(TokenFile::open(&tokens).unwrap(), 16, 7).unwrap();
    assert_eq!(a.windows(), b.windows());
    let (mut x, mut y) = (vec![0u32; 17], vec![0u32; 17]);
    for i in 0..3 * a.windows() as u64 {
        a.sample(i, &mut x);
        b.sample(i, &mut y);
        assert_eq!(x, y, "sample {i}");
    }
}

#[test]
fn ferrotrons_writer_is_read_by_the_python_reader() {
    let dir = TempDir::new("mg-write");
    for vocab in [257usize, 70_000] {
        let docs = documents(30, vocab as i64);
        let prefix = dir.path().join(format!("ours_{vocab}"));
        let mut w = MegatronWriter::create(&prefix, vocab).unwrap();
        for d in &docs {
            w.push(&d.iter().map(|&t| t as u32).collect::<Vec<_>>())
                .unwrap();
        }
        assert_eq!(w.finish().unwrap(), flat(&docs).len() as u64);
        let read = python_read(&prefix);
        // Megatron's choice: u16 below 65,500 ids, i32 above.
        assert_eq!(read["dtype"], if vocab < 65_500 { 8 } else { 4 });
        let sequences: Vec<Vec<i64>> = serde_json::from_value(read["sequences"].clone()).unwrap();
        assert_eq!(sequences, docs);
        let bounds: Vec<i64> = serde_json::from_value(read["documents"].clone()).unwrap();
        assert_eq!(bounds, (0..=30).collect::<Vec<i64>>());
    }
    // Nothing but the two files is left.
    assert_eq!(
        dir.entries(),
        [
            "ours_257.bin",
            "ours_257.idx",
            "ours_70000.bin",
            "ours_70000.idx"
        ]
    );
}

#[test]
fn a_path_names_a_prefix_its_bin_or_its_idx() {
    let dir = TempDir::new("mg-locate");
    let prefix = dir.path().join("c_text_document");
    python_write(&prefix, 8, &documents(3, 50));
    for given in [
        "c_text_document",
        "c_text_document.bin",
        "c_text_document.idx",
    ] {
        assert_eq!(
            locate(&dir.path().join(given)),
            Located::Megatron(prefix.clone()),
            "{given}"
        );
    }
    let tokens = dir.path().join("t.bin");
    write_token_file(&tokens, &[1, 2, 3], 4).unwrap();
    assert_eq!(locate(&tokens), Located::Tokens(tokens.clone()));
    assert_eq!(
        open_tokens(&prefix).unwrap().len(),
        flat(&documents(3, 50)).len()
    );
}

/// The error opening `prefix` after `damage` changed its files.
fn damaged(dir: &Path, name: &str, damage: impl FnOnce(&mut Vec<u8>, &mut Vec<u8>)) -> String {
    let prefix = dir.join(name);
    python_write(&prefix, 3, &documents(10, 50));
    let (idx, bin) = (
        dir.join(format!("{name}.idx")),
        dir.join(format!("{name}.bin")),
    );
    let (mut i, mut b) = (std::fs::read(&idx).unwrap(), std::fs::read(&bin).unwrap());
    damage(&mut i, &mut b);
    std::fs::write(&idx, i).unwrap();
    std::fs::write(&bin, b).unwrap();
    MegatronFile::open(&prefix).unwrap_err().to_string()
}

#[test]
fn a_bad_index_is_an_error_naming_the_file() {
    let dir = TempDir::new("mg-bad");
    let d = dir.path();
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "magic",
            damaged(d, "magic", |i, _| i[0] = b'X'),
            "not a Megatron index",
        ),
        (
            "version",
            damaged(d, "version", |i, _| i[9] = 2),
            "index version 2",
        ),
        ("float", damaged(d, "float", |i, _| i[17] = 7), "float32"),
        (
            "past",
            damaged(d, "past", |_, b| b.truncate(b.len() - 2)),
            "sizes run past the end of .bin",
        ),
        (
            "long",
            damaged(d, "long", |_, b| b.extend([0, 0])),
            "do not belong together",
        ),
        (
            "cut",
            damaged(d, "cut", |i, _| i.truncate(i.len() - 1)),
            "truncated or damaged",
        ),
        (
            "modes",
            damaged(d, "modes", |i, _| i.extend([0u8; 10])),
            "multimodal",
        ),
        (
            "negative",
            damaged(d, "negative", |_, b| {
                b[0..2].copy_from_slice(&(-5i16).to_le_bytes())
            }),
            "token 0 is -5",
        ),
    ];
    for (name, err, what) in cases {
        assert!(err.contains(what), "{name}: {err}");
        assert!(err.contains(name), "{name}: the error names no file: {err}");
    }
    let missing = MegatronFile::open(&d.join("none")).unwrap_err().to_string();
    assert!(missing.contains("none.idx") && missing.contains("prepare-data --format megatron"));
    // Ids past the model's vocabulary: the file, the id and the fix.
    let prefix = d.join("wide");
    python_write(&prefix, 4, &[vec![1, 2, 70_000]]);
    let err = MegatronFile::open(&prefix)
        .unwrap()
        .check_vocab(32_000)
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, DataError::Megatron { .. }));
    assert!(text.contains("wide.bin") && text.contains("id 70000") && text.contains("model.vocab"));
}

/// Three corpora whose every token names its corpus (ids 0-9, 10-19, 20-29).
fn three_corpora(dir: &Path) -> Vec<Box<dyn DataSource>> {
    (0..3u32)
        .map(|c| {
            let path = dir.join(format!("c{c}.bin"));
            let tokens: Vec<u32> = (0..4000).map(|i| 10 * c + i % 10).collect();
            write_token_file(&path, &tokens, 30).unwrap();
            let file = TokenFile::open(&path).unwrap();
            Box::new(FileSampler::new(file, 8, corpus_seed(5, c as usize)).unwrap())
                as Box<dyn DataSource>
        })
        .collect()
}

#[test]
fn a_blend_draws_each_corpus_within_one_percent_of_its_weight() {
    let dir = TempDir::new("blend-share");
    let weights = [5.0, 3.0, 2.0];
    let parts = weights
        .iter()
        .copied()
        .zip(three_corpora(dir.path()))
        .collect();
    let blend = Blend::new(parts).unwrap();
    let n = 20_000u64;
    let mut drawn = [0u64; 3];
    let mut out = vec![0u32; 9];
    for i in 0..n {
        blend.sample(i, &mut out);
        let c = (out[0] / 10) as usize;
        assert!(
            out.iter().all(|&t| t / 10 == c as u32),
            "sample {i} mixes corpora"
        );
        assert_eq!(blend.locate(i).0, c);
        drawn[c] += 1;
    }
    for (c, w) in weights.iter().enumerate() {
        let share = drawn[c] as f64 / n as f64;
        let want = w / 10.0;
        assert!(
            (share - want).abs() <= 0.01 * want,
            "corpus {c}: {share} vs {want}"
        );
    }
    // Sample i is the same whenever it is asked for (a resume asks for it alone).
    let mut again = vec![0u32; 9];
    for i in [0u64, 1, 777, 65_535, 65_536, 200_001] {
        blend.sample(i, &mut out);
        Blend::new(
            weights
                .iter()
                .copied()
                .zip(three_corpora(dir.path()))
                .collect(),
        )
        .unwrap()
        .sample(i, &mut again);
        assert_eq!(out, again, "sample {i}");
    }
}

#[test]
fn a_blend_of_one_corpus_reads_what_the_corpus_alone_reads() {
    let dir = TempDir::new("blend-one");
    let mut parts = three_corpora(dir.path());
    let alone = parts.remove(0);
    let again = three_corpora(dir.path()).remove(0);
    let blend = Blend::new(vec![(1.0, again)]).unwrap();
    let (mut x, mut y) = (vec![0u32; 9], vec![0u32; 9]);
    for i in 0..2000 {
        blend.sample(i, &mut x);
        alone.sample(i, &mut y);
        assert_eq!(x, y, "sample {i}");
    }
}

#[test]
fn bad_blends_are_refused() {
    let dir = TempDir::new("blend-bad");
    let err = |weights: Vec<f64>| {
        let parts = weights.into_iter().zip(three_corpora(dir.path())).collect();
        Blend::new(parts).unwrap_err().to_string()
    };
    assert!(err(vec![1.0, 0.0]).contains("entry 1 has weight 0"));
    assert!(err(vec![1.0, f64::NAN]).contains("finite number above 0"));
    assert!(err(vec![1.0, 1e-9]).contains("too small to be drawn"));
    assert!(Blend::new(Vec::new())
        .unwrap_err()
        .to_string()
        .contains("0 corpora"));
}
