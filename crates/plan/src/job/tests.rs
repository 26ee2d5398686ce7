//! The job's configuration, overrides and memory terms.
use super::*;

#[test]
fn toml_reads_keys_the_engine_refuses() {
    let job = Job::from_toml(
        "[parallel]\ndp = 2\ntp = 8\npp = 4\npp_schedule = \"interleaved\"\nvirtual_stages = 2\n",
        &[
            "parallel.recompute=full".into(),
            "model.seq_len=4096".into(),
        ],
        Some("llama3-70b"),
    )
    .unwrap();
    assert_eq!(job.model.name, "llama3-70b");
    assert_eq!(job.model.config.hidden, 8192);
    assert_eq!((job.layout.dp, job.layout.tp, job.layout.pp), (2, 8, 4));
    assert_eq!(job.layout.pp_schedule, crate::layout::Schedule::Interleaved);
    assert_eq!(job.layout.recompute, Recompute::Full);
    let moe = Job::from_toml("", &["model.experts=4".into()], None).unwrap();
    assert_eq!(moe.model.moe.map(|m| (m.experts, m.top_k)), Some((4, 2)));
}

/// On OpenBLAS the host matmul's scratch is its buffer per compute thread instead of
/// `gemm`'s largest packing, in the estimate as in the ledger.
#[test]
fn the_estimate_counts_openblas_scratch_per_thread() {
    let sets = |m: &str| -> Vec<String> {
        vec![
            format!("train.matmul={m}"),
            "train.threads=3".into(),
            "model.seq_len=512".into(),
        ]
    };
    let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
    let blas = Job::from_toml("", &sets("openblas"), None).unwrap();
    assert_eq!(blas.layout.matmul, ferrotron_config::Matmul::OpenBlas);
    let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
    let c = gemm.run_config();
    let (t, p) = (&c.train, &c.parallel);
    let pack = ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = 3.min(cores) as i64;
    assert_eq!(
        total(&blas) - total(&gemm),
        threads * ferrotron_config::BLAS_SCRATCH_PER_THREAD as i64 - pack as i64
    );
    let again = Job::from_toml("", &blas.overrides(), None).unwrap();
    assert_eq!(again.layout.matmul, ferrotron_config::Matmul::OpenBlas);
}

/// With bf16 products the host matmul's scratch is their packed blocks (one shared, one
/// per compute thread), in the estimate as in the ledger, and the setting round-trips.
#[test]
fn the_estimate_counts_the_bf16_products_blocks() {
    let sets = |m: &str| -> Vec<String> {
        vec![
            format!("train.matmul={m}"),
            "train.dtype=\"bf16\"".into(),
            "train.threads=3".into(),
        ]
    };
    let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
    let bf16 = Job::from_toml("", &sets("bf16"), None).unwrap();
    assert_eq!(bf16.layout.matmul, ferrotron_config::Matmul::Bf16);
    let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
    let c = gemm.run_config();
    let (t, p) = (&c.train, &c.parallel);
    let pack = ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = 3.min(cores) as u64;
    let blocks = ferrotron_config::BF16_GEMM_SHARED_BYTES
        + threads * ferrotron_config::BF16_GEMM_PER_THREAD_BYTES;
    assert_eq!(total(&bf16) - total(&gemm), blocks as i64 - pack as i64);
    let again = Job::from_toml("", &bf16.overrides(), None).unwrap();
    assert_eq!(again.layout.matmul, ferrotron_config::Matmul::Bf16);
}

/// On a GPU there is no host matmul scratch; with bf16 products there is the backend's
/// scratch for their rounded operands, which the engine holds as workspace too.
#[test]
fn the_estimate_counts_a_gpus_bf16_operands() {
    let sets = |m: &str| -> Vec<String> {
        vec![
            format!("train.matmul={m}"),
            "train.dtype=\"bf16\"".into(),
            "train.device=\"cuda\"".into(),
        ]
    };
    let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
    let bf16 = Job::from_toml("", &sets("bf16"), None).unwrap();
    let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
    let c = bf16.run_config();
    let (t, p) = (&c.train, &c.parallel);
    let operands =
        ferrotron_config::device_bf16_operand_bytes(&c.model, p, (t.micro_batch, t.loss_chunk));
    assert!(operands > 0);
    assert_eq!(total(&bf16) - total(&gemm), operands as i64);
}

/// With attention as products the GPU's score buffers are workspace for the whole run,
/// of the rank's kv heads under tp, and the layout's overrides carry the choice.
#[test]
fn the_estimate_counts_a_gpus_attention_scores() {
    let sets = |a: &str, tp: usize| -> Vec<String> {
        vec![
            format!("train.attention={a}"),
            "train.device=\"cuda\"".into(),
            format!("parallel.tp={tp}"),
        ]
    };
    let total = |j: &Job| crate::estimate(j).unwrap().stages[0].memory.total() as i64;
    for tp in [1, 2] {
        let tiles = Job::from_toml("", &sets("tiles", tp), None).unwrap();
        let products = Job::from_toml("", &sets("products", tp), None).unwrap();
        let c = products.run_config();
        assert_eq!(c.train.attention, ferrotron_config::Attention::Products);
        let kv = c.model.kv_heads / tp;
        let rows = ferrotron_config::attention_score_rows(c.model.seq_len, kv);
        let scores = 2 * 4 * kv * rows * c.model.seq_len;
        assert!(scores > 0);
        assert_eq!(total(&products) - total(&tiles), scores as i64);
        assert!(products
            .overrides()
            .contains(&"train.attention=products".to_string()));
    }
}

/// With `train.threads` unset, the estimate counts OpenBLAS's buffer for the threads the
/// engine gives a rank: every core for a pipeline stage (the stages share them), a share
/// for a data-parallel rank.
#[test]
fn unset_threads_count_a_stage_s_cores_and_a_dp_rank_s_share() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (degree, threads) in [
        ("parallel.pp=2", cores),
        ("parallel.dp=2", (cores / 2).max(1)),
    ] {
        let sets = |m: &str| -> Vec<String> {
            vec![
                format!("train.matmul={m}"),
                "train.threads=0".into(),
                degree.into(),
            ]
        };
        let gemm = Job::from_toml("", &sets("gemm"), None).unwrap();
        let blas = Job::from_toml("", &sets("openblas"), None).unwrap();
        let c = gemm.run_config();
        let (t, p) = (&c.train, &c.parallel);
        let pack = ferrotron_config::step_gemm_pack_bytes(&c.model, p, t.micro_batch, t.loss_chunk);
        let (g, b) = (
            crate::estimate(&gemm).unwrap(),
            crate::estimate(&blas).unwrap(),
        );
        for (g, b) in g.stages.iter().zip(&b.stages) {
            assert_eq!(
                b.memory.total() as i64 - g.memory.total() as i64,
                threads as i64 * ferrotron_config::BLAS_SCRATCH_PER_THREAD as i64 - pack as i64,
                "{degree}, stage {}",
                g.stage
            );
        }
    }
}

#[test]
fn overrides_round_trip() {
    let job = Job::from_toml(
        "",
        &[
            "parallel.pp=2".into(),
            "parallel.pp_layers=[3, 1]".into(),
            "parallel.pp_schedule=zero_bubble".into(),
            "train.dtype=bf16".into(),
            "train.grad_accum=4".into(),
        ],
        None,
    )
    .unwrap();
    let again = Job::from_toml("", &job.overrides(), None).unwrap();
    assert_eq!(again.layout, job.layout);
    assert_eq!(job.layout.pp_layers, Some(vec![3, 1]));
    let ulysses = ["parallel.cp=2".into(), "parallel.cp_kind=ulysses".into()];
    let job = Job::from_toml("", &ulysses, None).unwrap();
    assert_eq!(job.layout.cp_kind, ferrotron_config::CpKind::Ulysses);
    let again = Job::from_toml("", &job.overrides(), None).unwrap();
    assert_eq!(again.layout, job.layout);
    assert_eq!(
        job.run_config().parallel.cp_kind,
        ferrotron_config::CpKind::Ulysses
    );
}

#[test]
fn bad_layouts_name_the_field() {
    let err = Job::from_toml("[parallel]\ntp = 3\n", &[], None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "parallel.tp: tp=3 does not divide model.heads=4"
    );
    let err = Job::from_toml("[parallel]\nep = 2\n", &[], None).unwrap_err();
    assert!(err.to_string().starts_with("parallel.ep:"), "{err}");
    let err = Job::from_toml("[parallel]\npp = -1\n", &[], None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "parallel.pp: expected a non-negative integer"
    );
    let err = Job::from_toml("", &["parallel.recompute=some".into()], None).unwrap_err();
    assert!(err.to_string().starts_with("parallel.recompute"), "{err}");
}

/// Attention as products is refused with context parallelism, as `train` refuses it, and
/// makes the job's run a GPU's.
#[test]
fn attention_as_products_refuses_cp_and_runs_on_a_gpu() {
    let sets = |cp: usize| -> Vec<String> {
        vec![
            "train.attention=\"products\"".into(),
            "train.device=\"cuda\"".into(),
            format!("parallel.cp={cp}"),
        ]
    };
    let err = Job::from_toml("", &sets(2), None).unwrap_err().to_string();
    assert!(
        err.contains("train.attention") && err.contains("parallel.cp"),
        "{err}"
    );
    let job = Job::from_toml("", &sets(1), None).unwrap();
    assert_eq!(
        job.run_config().train.device,
        ferrotron_config::Device::Cuda
    );
    assert!(job.engine_accepts().is_ok());
}
