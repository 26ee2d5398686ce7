//! Document masking (`data.document_mask`) across layouts against the single-rank run: data,
//! tensor + sequence, pipeline (1F1B and interleaved) and context parallelism (alone and with
//! tp2) give the single rank's gradients and train to its losses and parameters.
//!
//! Tolerances (f32): one step's gradients before the optimizer per tensor within relative
//! 1e-5 (L2; measured at most 3.2e-7) and per element within 1e-4·max(|g|, 1e-2); the loss of
//! every step within relative 1e-5; the parameters after two steps per tensor within relative
//! 1e-4 (measured at most 1.6e-5, cp2·tp2+sp). The parameters' bound is looser than the
//! gradients' because Adam's first steps divide each gradient by its own magnitude: an
//! element whose gradient is at rounding level moves by about ±lr either way, and the packed
//! windows' one-token documents give more such elements than whole windows do. That the masked single rank equals each document run alone is proven
//! in `crates/model/tests/document_mask.rs`; here the masked run must also differ from the
//! unmasked one, so the windows really hold several documents.
//!
//! The synthetic corpus over a 16-token vocabulary, with token 7 as the end of a document, cuts
//! the 32-token windows into several documents (token 3, say, never follows the chain's
//! start, so it would cut none: `masking_changes_the_run` guards against such a choice).

mod common;

use ferrotron_config::{Config, CpKind, PpSchedule};
use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::{document_starts, DataSource};
use ferrotron_train::launch::on_thread_ranks;
use ferrotron_train::Init;

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 4;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 128;
    c.model.vocab = 16;
    c.model.seq_len = 32;
    c.data.document_mask = true;
    c.data.eos_id = Some(7);
    c.train.steps = 2;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 1;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.02;
    c.parallel.comm_timeout_s = 60.0;
    c
}

/// `c` against the single rank over the same global batch (tolerances in the module docs).
fn check(c: &Config, what: &str) {
    let mut single = base();
    single.train.grad_accum = c.train.grad_accum * c.parallel.dp;
    common::check_layout(c, &single, what, 1e-4);
}

#[test]
fn masking_changes_the_run() {
    let masked = common::single(&base());
    let mut plain = base();
    (plain.data.document_mask, plain.data.eos_id) = (false, None);
    let plain = common::single(&plain);
    let rel = (masked.0[0] - plain.0[0]).abs() / plain.0[0];
    assert!(rel > 1e-4, "the first step's loss moved by {rel:e} only");
}

#[test]
fn data_and_tensor_parallel_equal_the_single_rank() {
    let mut c = base();
    c.parallel.dp = 2;
    check(&c, "dp2");
    let mut c = base();
    (c.parallel.tp, c.parallel.sequence_parallel) = (2, true);
    check(&c, "tp2+sp");
}

#[test]
fn pipelines_equal_the_single_rank() {
    for (schedule, chunks) in [(PpSchedule::OneFOneB, 1), (PpSchedule::Interleaved, 2)] {
        let mut c = base();
        (c.parallel.pp, c.parallel.pp_schedule) = (2, schedule);
        c.parallel.virtual_stages = chunks;
        check(&c, &format!("pp2 {schedule:?}"));
    }
}

#[test]
fn context_parallel_rings_equal_the_single_rank() {
    let mut c = base();
    c.parallel.cp = 2;
    check(&c, "cp2");
    c.parallel.cp = 4;
    check(&c, "cp4");
    let mut c = base();
    (c.parallel.cp, c.parallel.tp, c.parallel.sequence_parallel) = (2, 2, true);
    check(&c, "cp2·tp2+sp");
    // Ulysses' all-to-all hands each rank whole documents' heads: the same kernels' mask.
    let mut c = base();
    (c.parallel.cp, c.parallel.cp_kind) = (2, CpKind::Ulysses);
    check(&c, "cp2 ulysses");
}

/// The MFU numerator counts each document's full attention: the span the run reports is the
/// documents' squared lengths over the global batch's tokens, counted here from the corpus
/// directly, and every layout reports the same.
#[test]
fn the_mfu_counts_each_documents_attention() {
    let c = base();
    let (s, windows) = (c.model.seq_len, c.train.steps * c.samples_per_step());
    let corpus = SyntheticCorpus::new(c.model.vocab, c.train.seed);
    let (mut sample, mut starts, mut pairs) = (vec![0; s + 1], vec![0; s], 0.0);
    for i in 0..windows as u64 {
        corpus.sample(i, &mut sample);
        document_starts(&sample[..s], 7, &mut starts);
        let mut len = vec![0usize; s];
        starts.iter().for_each(|&st| len[st] += 1);
        pairs += len.iter().map(|&l| (l * l) as f64).sum::<f64>();
    }
    let want = pairs / (windows * s) as f64;
    assert!(
        want < 0.8 * s as f64,
        "windows of one document test nothing: {want}"
    );
    // Rank 0's summary of a run of `c`, checked against the FLOPs its span gives.
    let span = |c: &Config| {
        let summaries = on_thread_ranks(c, Init::Fresh, |mut t| {
            let steps = t.run(|_| {})?;
            Ok((t.rank(), t.summary(&steps, None)))
        })
        .unwrap();
        let (_, summary) = summaries.into_iter().find(|(r, _)| *r == 0).unwrap();
        let span = summary
            .attention_span
            .expect("a masked run reports its span");
        assert_eq!(summary.flops_per_token, c.model.model_flops_with_span(span));
        span
    };
    let single = span(&c);
    assert!((single - want).abs() <= 1e-12 * want, "{single} vs {want}");
    for (dp, cp, pp) in [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)] {
        let mut l = base();
        (l.parallel.dp, l.parallel.cp, l.parallel.pp) = (dp, cp, pp);
        l.train.grad_accum = 2 / dp;
        let got = span(&l);
        eprintln!("dp{dp} cp{cp} pp{pp}: span {got} (single {single})");
        assert!(
            (got - single).abs() <= 1e-12 * single,
            "dp{dp} cp{cp} pp{pp}: {got} vs {single}"
        );
    }
}
