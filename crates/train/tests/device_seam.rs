//! The device seam, proven without a GPU: whole training steps run on the test suite's
//! second backend, [`ArenaBackend`], whose buffers are blocks of one arena per rank and whose
//! kernels refuse any slice outside it, and give the CPU backend's losses, gradient norms
//! and parameters. Each step's host↔device transfers, counted by label on the rank's ledger,
//! are the token ids in and the loss, norm and (mixture of experts) routing scalars out —
//! nothing else — and the same on both backends.
//!
//! Layouts: the 5D layout dp2·tp2(sp)·pp2·cp2 with a mixture of experts over ep2 under
//! ZeRO-1 (16 ranks), the dense 5D layout and the single rank under document masking, and
//! dp2 under ZeRO-3.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferrotron_comm::STAGING;
use ferrotron_config::{Config, DType};
use ferrotron_model::{ROUTING, TOKEN_IDS};
use ferrotron_tensor::adamw::SQUARED_NORMS;
use ferrotron_tensor::{ArenaBackend, Backend, CpuBackend, TransferCount};
use ferrotron_train::launch::on_thread_ranks_on;
use ferrotron_train::optim::{CHECKPOINT, GRAD_NORM};
use ferrotron_train::{Init, DOCUMENT_SPANS};

/// Device memory of each rank on the arena backend.
const ARENA_BYTES: usize = 64 << 20;

fn base() -> Config {
    let mut c = Config::default();
    c.model.hidden = 32;
    c.model.layers = 2;
    c.model.heads = 4;
    c.model.kv_heads = 2;
    c.model.ffn = 32;
    c.model.seq_len = 16;
    c.train.steps = 2;
    c.train.micro_batch = 2;
    c.train.grad_accum = 2;
    c.train.warmup_steps = 1;
    c.train.dtype = DType::F32;
    c.train.threads = 1;
    c.parallel.bucket_mb = 0.005;
    c.parallel.comm_timeout_s = 60.0;
    c
}

/// What one rank saw: per step (loss, grad norm, transfers of the step), then its view of
/// the full parameters.
struct Rank {
    steps: Vec<(f64, f64, BTreeMap<&'static str, TransferCount>)>,
    params: Vec<f32>,
    /// After the steps: (bytes the ledger holds, bytes its device memory has allocated).
    held: (usize, Option<usize>),
}

fn run(c: &Config, backends: &(dyn Fn(usize) -> Arc<dyn Backend> + Sync)) -> Vec<Rank> {
    on_thread_ranks_on(c, Init::Fresh, backends, |mut t| {
        let mut steps = Vec::new();
        for _ in 0..c.train.steps {
            t.device().ledger.reset_transfers();
            let s = t.step()?;
            steps.push((s.loss, s.grad_norm, t.device().ledger.transfers()));
        }
        let ledger = t.device().ledger;
        let held = (
            ledger.snapshot().current.iter().sum(),
            ledger.memory().map(|m| m.in_use()),
        );
        ledger.reset_transfers();
        let params = t.full_params()?;
        // Gathering the model for a save moves its values as checkpoint transfers only.
        let saved = ledger.transfers();
        assert!(
            saved.keys().all(|l| *l == CHECKPOINT || *l == STAGING),
            "{saved:?}"
        );
        assert!(saved[CHECKPOINT].to_host > 0, "{saved:?}");
        Ok(Rank {
            steps,
            params,
            held,
        })
    })
    .unwrap()
}

/// Runs `c` on both backends; asserts equal results and the allowed transfers.
fn check(what: &str, c: &Config) {
    let cpu = run(c, &|_| Arc::new(CpuBackend::default()));
    let arenas: Vec<Arc<ArenaBackend>> = (0..c.parallel.world_size())
        .map(|_| Arc::new(ArenaBackend::new(ARENA_BYTES)))
        .collect();
    let arena = run(c, &|r| arenas[r].clone());
    let moe = c.model.experts > 0;
    for (rank, (a, b)) in arena.iter().zip(&cpu).enumerate() {
        for (step, (x, y)) in a.steps.iter().zip(&b.steps).enumerate() {
            assert_eq!(
                x.0.to_bits(),
                y.0.to_bits(),
                "{what} rank {rank} step {step}: loss"
            );
            assert_eq!(
                x.1.to_bits(),
                y.1.to_bits(),
                "{what} rank {rank} step {step}: norm"
            );
            assert_eq!(x.2, y.2, "{what} rank {rank} step {step}: transfers differ");
            check_transfers(what, c, moe, &x.2);
        }
        assert!(
            a.params
                .iter()
                .zip(&b.params)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what} rank {rank}: parameters differ"
        );
        // The arena holds every byte the ledger counts (blocks round up to 64 bytes).
        let (counted, allocated) = (a.held.0, a.held.1.expect("arena memory"));
        let sizes = format!("{what} rank {rank}: ledger {counted} B, arena {allocated} B");
        assert!(counted > 0 && allocated >= counted, "{sizes}");
        assert!(allocated < counted + counted / 4, "{sizes}");
        assert_eq!(b.held.1, None, "the CPU backend allocates host vectors");
        eprintln!("{sizes}; transfers of the last step {:?}", a.steps[1].2);
    }
    // Every block went back to its arena: the allocator and the ledger agree on nothing left.
    for (rank, b) in arenas.iter().enumerate() {
        let memory = b.memory().expect("the arena backend has device memory");
        assert_eq!(
            memory.in_use(),
            0,
            "{what} rank {rank}: arena blocks leaked"
        );
    }
}

/// A step moves the token ids in (one transfer per micro-batch) and, out, only scalars: the
/// loss, the squared norms of the clipping, and with experts the routing tables and
/// statistics.
fn check_transfers(what: &str, c: &Config, moe: bool, t: &BTreeMap<&'static str, TransferCount>) {
    let ids = t[TOKEN_IDS];
    assert_eq!(
        ids.to_device, c.train.grad_accum,
        "{what}: one upload per micro-batch"
    );
    assert_eq!(ids.to_host, 0, "{what}: token ids never come back");
    let tokens = c.train.micro_batch * c.model.seq_len / c.parallel.cp;
    assert_eq!(
        ids.to_device_bytes,
        ids.to_device * 2 * tokens * 4,
        "{what}: ids"
    );
    for label in ["loss", GRAD_NORM] {
        let x = t.get(label).copied().unwrap_or_default();
        // A scalar (f64) or an f32 pair on its way to and from a reduction.
        assert!(x.to_host_bytes <= 8 * x.to_host, "{what}: {label} {x:?}");
        assert!(
            x.to_device_bytes <= 8 * x.to_device,
            "{what}: {label} {x:?}"
        );
    }
    // The squared norms of the clipping come back together: one readback a step.
    let norms = t.get(SQUARED_NORMS).copied().unwrap_or_default();
    assert_eq!(norms.to_host, 1, "{what}: squared norms {norms:?}");
    assert_eq!(norms.to_device, 0, "{what}: squared norms {norms:?}");
    let mut allowed = vec![TOKEN_IDS, "loss", GRAD_NORM, SQUARED_NORMS];
    if moe {
        allowed.extend([ROUTING, "moe statistics"]);
    }
    if c.data.document_mask {
        // The step's document spans (one f64, the MFU's attention) on the way to their sum.
        allowed.push(DOCUMENT_SPANS);
    }
    for label in t.keys() {
        assert!(
            allowed.contains(label),
            "{what}: unexpected transfer {label}: {t:?}"
        );
    }
}

#[test]
fn five_d_moe_step_on_the_arena_backend_equals_the_cpu_backend() {
    let mut c = base();
    (c.model.experts, c.model.top_k, c.model.moe_every) = (4, 2, 1);
    c.model.router_aux_loss_coef = 0.1;
    (c.parallel.dp, c.parallel.ep, c.parallel.zero) = (2, 2, 1);
    (c.parallel.tp, c.parallel.pp, c.parallel.cp) = (2, 2, 2);
    c.parallel.sequence_parallel = true;
    assert_eq!(c.parallel.world_size(), 16);
    check("dp2·tp2·sp·pp2·cp2·ep2 zero-1", &c);
}

/// Document masking's starts reach the kernels as host positions beside the device buffers
/// (like RoPE's), in whole sequences, the ring and every stage.
#[test]
fn document_masked_5d_step_on_the_arena_backend_equals_the_cpu_backend() {
    let mut c = base();
    c.model.vocab = 16;
    (c.data.document_mask, c.data.eos_id) = (true, Some(7));
    (c.parallel.dp, c.parallel.tp, c.parallel.pp, c.parallel.cp) = (2, 2, 2, 2);
    c.parallel.sequence_parallel = true;
    check("document-masked dp2·tp2·sp·pp2·cp2", &c);
    c.parallel = Default::default();
    c.parallel.comm_timeout_s = 60.0;
    check("document-masked single rank", &c);
}

#[test]
fn zero_3_step_on_the_arena_backend_equals_the_cpu_backend() {
    let mut c = base();
    (c.parallel.dp, c.parallel.zero) = (2, 3);
    check("dp2 zero-3", &c);
}

/// Device memory the host may not read (a GPU's own memory): every collective stages its
/// buffer through a host copy and its result back, and the run is still bit for bit the CPU
/// backend's. The staging is counted, once each way per collective that moves data.
#[test]
fn collectives_stage_through_the_host_when_device_memory_is_not_host_accessible() {
    let mut c = base();
    (c.model.experts, c.model.top_k, c.model.moe_every) = (4, 2, 1);
    (c.parallel.dp, c.parallel.ep, c.parallel.zero) = (2, 2, 1);
    (c.parallel.tp, c.parallel.pp, c.parallel.cp) = (2, 1, 2);
    c.parallel.sequence_parallel = true;
    let cpu = run(&c, &|_| Arc::new(CpuBackend::default()));
    let arenas: Vec<Arc<ArenaBackend>> = (0..c.parallel.world_size())
        .map(|_| Arc::new(ArenaBackend::opaque(ARENA_BYTES)))
        .collect();
    let staged = run(&c, &|r| arenas[r].clone());
    for (rank, (a, b)) in staged.iter().zip(&cpu).enumerate() {
        for (step, (x, y)) in a.steps.iter().zip(&b.steps).enumerate() {
            assert_eq!(
                x.0.to_bits(),
                y.0.to_bits(),
                "rank {rank} step {step}: loss"
            );
            assert_eq!(
                x.1.to_bits(),
                y.1.to_bits(),
                "rank {rank} step {step}: norm"
            );
            let s = x.2.get(STAGING).copied().unwrap_or_default();
            assert!(
                s.to_host > 0,
                "rank {rank} step {step}: nothing staged {:?}",
                x.2
            );
            // What goes out for a reduction comes back reduced: bytes out and in are of the
            // same order (all-gathers bring back more, reduce-scatters less).
            assert!(
                s.to_device > 0 && s.to_device_bytes > 0,
                "rank {rank}: {s:?}"
            );
            let mut rest = x.2.clone();
            rest.remove(STAGING);
            assert_eq!(rest, y.2, "rank {rank} step {step}: other transfers");
        }
        assert!(
            a.params
                .iter()
                .zip(&b.params)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "rank {rank}: parameters differ"
        );
    }
}
