//! Where the cost model says Ulysses beats the ring (`parallel.cp_kind`): Llama-3-8B's shapes
//! on H100 nodes (8 GPUs each), one sequence per context-parallel group, 8 micro-batches.
//!
//! The ring hides its key/value passes behind attention; Ulysses' all-to-alls wait. So the
//! ring wins within a node and at long sequences, where attention outweighs the passes, and
//! Ulysses wins where the passes cross nodes and attention is short: its per-rank volume
//! does not grow with cp, the ring's `cp − 1` passes do. The model is given 32 key/value heads
//! (multi-head attention) so that Ulysses may split them 16 and 32 ways. Step time of Ulysses
//! over the ring's, as this test prints it: seq 4096: cp 8 1.285, cp 16 0.373, cp 32 0.272;
//! seq 65536: cp 8 1.071, cp 32 1.188.

use ferrotron_config::CpKind;
use ferrotron_plan::{step_cost, CostModel, Hardware, Job, Layout, ModelSpec};

/// Step seconds of `kv_heads`-headed Llama-3-8B at `seq` over `cp` ranks of `kind`.
fn step(kv_heads: usize, seq: usize, cp: usize, kind: CpKind) -> f64 {
    let mut model = ModelSpec::preset("llama3-8b").unwrap();
    (model.config.seq_len, model.config.kv_heads) = (seq, kv_heads);
    let layout = Layout::default().with(|l| {
        (l.parallel.cp, l.parallel.cp_kind) = (cp, kind);
        (l.micro_batch, l.grad_accum) = (1, 8);
    });
    let job = Job { model, layout };
    let hw = Hardware::builtin("h100").unwrap();
    step_cost(&job, &hw, &CostModel::default()).unwrap().step_s
}

#[test]
fn ulysses_wins_across_nodes_on_short_sequences_and_the_ring_within_a_node() {
    let ratio = |seq, cp| step(32, seq, cp, CpKind::Ulysses) / step(32, seq, cp, CpKind::Ring);
    for cp in [16, 32] {
        let r = ratio(4096, cp);
        eprintln!("seq 4096 cp {cp}: Ulysses / ring {r:.3}");
        assert!(r < 0.9, "cp {cp}: Ulysses / ring {r}");
    }
    for (seq, cp) in [(4096, 8), (65536, 8), (65536, 32)] {
        let r = ratio(seq, cp);
        eprintln!("seq {seq} cp {cp}: Ulysses / ring {r:.3}");
        assert!(r > 1.0, "seq {seq} cp {cp}: Ulysses / ring {r}");
    }
}

#[test]
fn grouped_query_heads_are_shared_and_too_many_ranks_refused() {
    // Llama-3-8B's own 8 key/value heads over 16 ranks: each goes to two of them.
    let (u, r) = (
        step(8, 4096, 16, CpKind::Ulysses),
        step(8, 4096, 16, CpKind::Ring),
    );
    eprintln!(
        "8 key/value heads, seq 4096 cp 16: Ulysses / ring {:.3}",
        u / r
    );
    assert!(u < r, "Ulysses {u} s, ring {r} s");
    let mut model = ModelSpec::preset("llama3-8b").unwrap();
    model.config.seq_len = 4096;
    let layout =
        Layout::default().with(|l| (l.parallel.cp, l.parallel.cp_kind) = (64, CpKind::Ulysses));
    let job = Job { model, layout };
    let hw = Hardware::builtin("h100").unwrap();
    let err = step_cost(&job, &hw, &CostModel::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("parallel.cp_kind") && err.contains("heads=32"),
        "{err}"
    );
}
