//! Ulysses context parallelism (`parallel.cp_kind = "ulysses"`) against the single-rank run:
//! cp2 and cp4 alone, with tp2 + SP, with dp2 and ZeRO-1, with pp2 and under full
//! recomputation, on a model with grouped-query attention (8 heads, 4 key/value heads); and
//! with fewer key/value heads than ranks (2 over cp4, 1 per tensor-parallel rank over
//! cp2·tp2), where ranks share a key/value head and sum its gradients.
//!
//! Tolerances (f32) as in the parity suite: one step's gradients per tensor within relative
//! 1e-5 (L2; measured at most 4.1e-7) and per element within 1e-4·max(|g|, 1e-2); every
//! step's loss within relative 1e-5; the parameters after two steps within relative 1e-4 per
//! tensor (measured at most 2.3e-6, and 1.5e-5 for cp2·tp2 + SP: Adam's first steps divide
//! each gradient by its own magnitude, so an element whose gradient is at rounding level moves
//! by about ±lr either way; `document_mask.rs` argues the same). The all-to-all moves values
//! without arithmetic; what differs from the single rank is the attention's summation order
//! over the heads each rank now holds.

mod common;

use ferrotron_config::{Config, CpKind, PpSchedule, Recompute};

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 64;
    c.model.layers = 2;
    c.model.heads = 8;
    c.model.kv_heads = 4;
    c.model.ffn = 128;
    c.model.seq_len = 32;
    c.train.steps = 2;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 1;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.02;
    c.parallel.comm_timeout_s = 60.0;
    c.parallel.cp_kind = CpKind::Ulysses;
    c
}

/// `c` against one rank with the same model and global batch.
fn check(c: &Config, what: &str) {
    let mut single = base();
    single.model = c.model.clone();
    single.parallel.cp_kind = CpKind::Ring;
    single.parallel.recompute = c.parallel.recompute;
    single.train.grad_accum = c.train.grad_accum * c.parallel.dp;
    common::check_layout(c, &single, what, 1e-4);
}

#[test]
fn ulysses_alone_equals_the_single_rank() {
    for cp in [2, 4] {
        let mut c = base();
        c.parallel.cp = cp;
        check(&c, &format!("ulysses cp{cp}"));
    }
}

#[test]
fn ulysses_with_tensor_and_data_parallelism_equals_the_single_rank() {
    let mut c = base();
    (c.parallel.cp, c.parallel.tp, c.parallel.sequence_parallel) = (2, 2, true);
    check(&c, "ulysses cp2·tp2+sp");
    let mut c = base();
    (c.parallel.cp, c.parallel.dp, c.parallel.zero) = (2, 2, 1);
    c.train.grad_accum = 1;
    check(&c, "ulysses cp2·dp2 zero-1");
}

#[test]
fn ulysses_with_pipelines_and_recomputation_equals_the_single_rank() {
    let mut c = base();
    (c.parallel.cp, c.parallel.pp, c.parallel.pp_schedule) = (2, 2, PpSchedule::OneFOneB);
    check(&c, "ulysses cp2·pp2");
    let mut c = base();
    (c.parallel.cp, c.parallel.recompute) = (2, Recompute::Full);
    check(&c, "ulysses cp2 full recomputation");
}

#[test]
fn shared_key_value_heads_equal_the_single_rank() {
    let mut c = base();
    (c.model.kv_heads, c.parallel.cp) = (2, 4);
    check(&c, "ulysses cp4 over 2 key/value heads");
    let mut c = base();
    c.model.kv_heads = 2;
    (c.parallel.cp, c.parallel.tp, c.parallel.sequence_parallel) = (2, 2, true);
    check(&c, "ulysses cp2·tp2+sp over 1 key/value head per tp rank");
}

#[test]
fn heads_that_cp_does_not_deal_are_refused_naming_the_setting() {
    let mut c = base();
    (c.model.hidden, c.model.heads, c.model.kv_heads) = (96, 12, 6);
    c.parallel.cp = 4;
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.contains("parallel.cp_kind") && err.contains("kv_heads"),
        "{err}"
    );
    c.parallel.cp_kind = CpKind::Ring;
    c.validate().unwrap();
    let mut c = base();
    c.parallel.cp = 16;
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.contains("parallel.cp_kind") && err.contains("heads"),
        "{err}"
    );
}
