//! Integration tests of the windowing and the shuffled sampler.

mod common;

use std::path::Path;

use common::TempDir;
use ferrotron_data::{
    eval_window, eval_windows, write_token_file, DataError, DataSource, FileSampler, TokenFile,
};

/// A file whose token `i` is `i` (vocab = n).
fn identity_file(dir: &Path, n: usize) -> TokenFile {
    let path = dir.join("ids.bin");
    let tokens: Vec<u32> = (0..n as u32).collect();
    write_token_file(&path, &tokens, n).unwrap();
    TokenFile::open(&path).unwrap()
}

#[test]
fn windowing_counts_and_contents() {
    let dir = TempDir::new("windows");
    let f = identity_file(dir.path(), 1000);
    assert_eq!(eval_windows(&f, 64).unwrap(), 15); // (1000 - 1) / 64
    assert_eq!(eval_windows(&f, 999).unwrap(), 1);
    assert_eq!(eval_windows(&f, 1).unwrap(), 999);
    let mut out = vec![0u32; 65];
    eval_window(&f, 64, 3, &mut out).unwrap();
    assert_eq!(out, (192..257).collect::<Vec<u32>>());
    eval_window(&f, 64, 14, &mut out).unwrap();
    assert_eq!((out[0], out[64]), (896, 960)); // tokens 961..1000 are dropped
    assert!(matches!(
        eval_window(&f, 64, 15, &mut out),
        Err(DataError::OutOfRange { .. })
    ));
    let mut short = vec![0u32; 64];
    assert!(matches!(
        eval_window(&f, 64, 0, &mut short),
        Err(DataError::OutOfRange { .. })
    ));
    assert!(matches!(
        eval_windows(&f, 0),
        Err(DataError::ZeroSeqLen { .. })
    ));
}

#[test]
fn seq_len_longer_than_data_is_an_error() {
    let dir = TempDir::new("toolong");
    let f = identity_file(dir.path(), 10);
    let err = FileSampler::new(f, 10, 0).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            DataError::SeqLenTooLong {
                seq_len: 10,
                tokens: 10,
                needed: 11,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.starts_with("seq_len=10 is longer than the data: file "),
        "{msg}"
    );
    assert!(
        msg.contains("ids.bin has 10 tokens, need at least 11"),
        "{msg}"
    );

    let f = TokenFile::open(&dir.path().join("ids.bin")).unwrap();
    assert_eq!(FileSampler::new(f, 9, 0).unwrap().windows(), 1);
}

#[test]
fn one_epoch_visits_every_window_once() {
    let dir = TempDir::new("epoch");
    let s = FileSampler::new(identity_file(dir.path(), 1001), 10, 7).unwrap();
    assert_eq!(s.windows(), 100);
    assert_eq!(s.vocab_size(), 1001);
    let mut out = vec![0u32; 11];
    for epoch in 0..3u64 {
        let mut seen = vec![0u32; 100];
        let mut order = Vec::new();
        for i in 0..100 {
            s.sample(epoch * 100 + i, &mut out);
            let w = (out[0] / 10) as usize;
            assert_eq!(out, (w as u32 * 10..w as u32 * 10 + 11).collect::<Vec<_>>());
            assert_eq!(w, s.window_of(epoch * 100 + i));
            seen[w] += 1;
            order.push(w);
        }
        assert_eq!(seen, vec![1; 100], "epoch {epoch}");
        assert_ne!(
            order,
            (0..100).collect::<Vec<_>>(),
            "epoch {epoch} is shuffled"
        );
    }
    let first: Vec<usize> = (0..100).map(|i| s.window_of(i)).collect();
    let second: Vec<usize> = (100..200).map(|i| s.window_of(i)).collect();
    assert_ne!(first, second, "each epoch has its own order");
}

#[test]
fn sampler_is_deterministic() {
    let dir = TempDir::new("determinism");
    let a = FileSampler::new(identity_file(dir.path(), 61), 10, 1234).unwrap();
    let b = FileSampler::new(
        TokenFile::open(&dir.path().join("ids.bin")).unwrap(),
        10,
        1234,
    )
    .unwrap();
    let c = FileSampler::new(
        TokenFile::open(&dir.path().join("ids.bin")).unwrap(),
        10,
        1235,
    )
    .unwrap();
    let order = |s: &FileSampler| (0..60).map(|i| s.window_of(i)).collect::<Vec<_>>();
    // Sampling out of order (epoch 5 before epoch 0) gives the same answers.
    let late: Vec<usize> = (50..60).rev().map(|i| a.window_of(i)).collect();
    assert_eq!(order(&a), order(&b));
    assert_ne!(order(&a), order(&c));
    let mut late_b: Vec<usize> = (50..60).map(|i| b.window_of(i)).collect();
    late_b.reverse();
    assert_eq!(late, late_b);
    // Fixed across runs and platforms: splitmix64 + Fisher–Yates, pinned here.
    assert_eq!(&order(&a)[..12], &PINNED_SEED_1234[..]);
}

const PINNED_SEED_1234: [usize; 12] = [5, 0, 3, 1, 4, 2, 0, 4, 2, 1, 3, 5];

#[test]
fn sampler_is_send_sync_and_thread_consistent() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<FileSampler>();
    let dir = TempDir::new("threads");
    let s = FileSampler::new(identity_file(dir.path(), 5001), 50, 99).unwrap();
    let serial: Vec<u32> = (0..400u64)
        .map(|i| {
            let mut out = vec![0u32; 51];
            s.sample(i, &mut out);
            out[0]
        })
        .collect();
    let parallel: Vec<Vec<u32>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let s = &s;
                scope.spawn(move || {
                    (0..100u64)
                        .map(|k| {
                            let mut out = vec![0u32; 51];
                            s.sample(t * 100 + k, &mut out);
                            out[0]
                        })
                        .collect::<Vec<u32>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(parallel.concat(), serial);
}
