//! How a rank's trainer is built: its ledger, compute threads and standing workspace, its
//! part of the model, its gradient buckets, its starting values (fresh, full weights or a
//! checkpoint under any layout), its training state and its pipeline stage.

use std::sync::Arc;

use ferrotron_comm::GroupKind;
use ferrotron_config::Config;
use ferrotron_data::DataSource;
use ferrotron_model::{Llama, Shard};
use ferrotron_parallel::buckets::BucketPlan;
use ferrotron_parallel::pipeline::{stage_parts, Pipeline};
use ferrotron_parallel::RankMesh;
use ferrotron_tensor::{Backend, Held, Ledger};

use super::{
    checkpoint, host_backend, open_data, thread_pool, Device, Faults, Init, Position, RunMetrics,
    Trainer,
};
use crate::lr::LrSchedule;
use crate::state::TrainState;
use crate::TrainError;

/// Memory outside the engine's buffers that a step may use, counted as workspace for the
/// whole run: the data source's caches (a token file's shuffled epochs) and, where buffers
/// are host vectors (the CPU backend), the host matmul library's scratch: the largest packing
/// `gemm` allocates inside one of the step's matmuls, or OpenBLAS's buffer per compute thread
/// ([`ferrotron_config::step_matmul_scratch_bytes`], which the estimator uses too); on a
/// device with bf16 products, the backend's scratch for their rounded operands
/// ([`ferrotron_config::device_bf16_operand_bytes`]); on a GPU running attention as
/// products, the backend's score buffers ([`ferrotron_config::device_attention_score_bytes`]).
fn standing_workspace(
    config: &Config,
    ledger: &Ledger,
    (backend, threads): (&dyn Backend, usize),
    data: &dyn DataSource,
) -> Vec<Held> {
    // Host vectors (no device memory of the backend's own): the kernels are the host's.
    let host = backend.memory().is_none();
    let (model, t) = (&config.model, &config.train);
    let gemm = if host {
        ferrotron_config::step_matmul_scratch_bytes(
            t.matmul,
            threads,
            model,
            &config.parallel,
            (t.micro_batch, t.loss_chunk),
        )
    } else if t.matmul == ferrotron_config::Matmul::Bf16
        && t.device == ferrotron_config::Device::Cuda
    {
        // A GPU's bf16 products: the CUDA backend's scratch for the rounded operands.
        ferrotron_config::device_bf16_operand_bytes(
            model,
            &config.parallel,
            (t.micro_batch, t.loss_chunk),
        )
    } else {
        0
    };
    // A GPU's attention as products: the backend's score buffers.
    let scores = match t.device {
        ferrotron_config::Device::Cuda => {
            ferrotron_config::device_attention_score_bytes(model, &config.parallel, t.attention)
        }
        ferrotron_config::Device::Cpu => 0,
    };
    [data.cache_bytes(), gemm as usize, scores as usize]
        .into_iter()
        .filter(|&b| b > 0)
        .map(|b| ledger.hold(ferrotron_tensor::Category::Workspace, b))
        .collect()
}

/// The part of the model rank `mesh` holds: its tensor-parallel slice, expert-parallel
/// experts and pipeline stage.
fn rank_model(config: &Config, mesh: &RankMesh) -> Llama {
    let (tp, tp_rank) = mesh.coords(GroupKind::Tp);
    let (ep, ep_rank) = mesh.coords(GroupKind::Ep);
    let shard = Shard {
        tp,
        tp_rank,
        ep,
        ep_rank,
    };
    let (_, pp_rank) = mesh.coords(GroupKind::Pp);
    Llama::sharded(&config.model, shard, &stage_parts(config, pp_rank))
}

/// The ledger of a rank: its communicator's (shared, so that received buffers are counted
/// with the rest), which must allocate from `backend`'s device memory; a fresh one on a
/// single rank. Recycling of overwritten step buffers is on.
fn rank_ledger(mesh: &RankMesh, backend: &dyn Backend) -> Result<Ledger, TrainError> {
    let ledger = match mesh.comm() {
        Some(c) => c.ledger().clone(),
        None => backend.memory().map(Ledger::on).unwrap_or_default(),
    };
    // A step's overwritten buffers reuse the memory of those it freed (host only; the
    // trainer releases what is kept at the end of every step and evaluation).
    ledger.set_recycling(ferrotron_tensor::Recycling::On);
    if backend.memory().is_some() != ledger.memory().is_some() {
        return Err(TrainError::Layout(
            "the rank's ledger must allocate from its backend's device memory \
             (build the communicator's ledger with Ledger::on(backend.memory()))"
                .into(),
        ));
    }
    Ok(ledger)
}

/// The gradient buckets of `model` and this rank's ZeRO pieces of them: shards over the
/// gradient-reduction group (data × context parallel ranks), experts over their replicas.
fn bucket_plan(config: &Config, model: &Llama, mesh: &RankMesh) -> BucketPlan {
    let p = &config.parallel;
    let (dp_size, _) = mesh.coords(GroupKind::DpCp);
    let (ep_size, _) = mesh.coords(GroupKind::Ep);
    let bucket_elems = ferrotron_config::bucket_elems(p.bucket_mb, config.train.dtype.size());
    BucketPlan::with_experts(
        &model.layout,
        bucket_elems,
        dp_size,
        (ep_size, p.cp),
        p.zero >= 1,
        p.zero >= 3,
    )
}

/// This rank's starting values of its parameters (this layout's slices, in layout order),
/// when `init` gives any: its tensor-parallel slice of full weights, or its pieces of a
/// checkpoint's master weights (any layout it was saved under).
fn local_values(
    config: &Config,
    model: &Llama,
    init: Init<'_>,
) -> Result<Option<Vec<f32>>, TrainError> {
    match init {
        Init::Fresh => Ok(None),
        Init::Checkpoint(ck) => Ok(Some(
            ck.local(crate::checkpoint::Kind::Master, &model.layout)?,
        )),
        Init::Weights(full) => {
            let p = &config.parallel;
            if p.tp == 1 && p.pp == 1 && p.ep == 1 {
                return Ok(Some(full.to_vec()));
            }
            let full_layout = ferrotron_model::ParamLayout::new(&config.model);
            let mut out = vec![0.0f32; model.layout.total];
            for spec in &model.layout.params {
                let full_spec = full_layout
                    .find(&spec.name)
                    .expect("stage parameters exist in the full model");
                model
                    .layout
                    .slice_into(spec, &full[full_spec.range()], &mut out[spec.range()]);
            }
            Ok(Some(out))
        }
    }
}

impl Trainer {
    /// A single-rank trainer with weights from the layout-independent initialisation.
    pub fn new(config: Config) -> Result<Self, TrainError> {
        let backend = host_backend(&config)?;
        Self::build(config, Init::Fresh, RankMesh::single(), backend)
    }

    /// A single-rank trainer continuing from a checkpoint saved under any layout.
    pub fn resume(
        config: Config,
        checkpoint: &crate::checkpoint::Checkpoint,
    ) -> Result<Self, TrainError> {
        let backend = host_backend(&config)?;
        Self::build(
            config,
            Init::Checkpoint(checkpoint),
            RankMesh::single(),
            backend,
        )
    }

    /// A single-rank trainer starting from `weights` (full fp32 values in layout order).
    pub fn with_weights(config: Config, weights: &[f32]) -> Result<Self, TrainError> {
        let backend = host_backend(&config)?;
        Self::build(config, Init::Weights(weights), RankMesh::single(), backend)
    }

    /// The trainer of one rank of a parallel run, talking over the groups of `mesh`. Each
    /// rank keeps its slice of what `init` gives.
    pub fn for_rank(config: Config, init: Init<'_>, mesh: RankMesh) -> Result<Self, TrainError> {
        let backend = host_backend(&config)?;
        Self::build(config, init, mesh, backend)
    }

    /// A trainer for one rank of `mesh` whose kernels are `backend`'s (the CPU backend's
    /// elsewhere): every buffer of the step is `backend`'s device memory.
    pub fn for_rank_on(
        config: Config,
        init: Init<'_>,
        mesh: RankMesh,
        backend: Arc<dyn Backend>,
    ) -> Result<Self, TrainError> {
        Self::build(config, init, mesh, backend)
    }

    /// A trainer on the groups of `mesh`.
    fn build(
        config: Config,
        init: Init<'_>,
        mesh: RankMesh,
        backend: Arc<dyn Backend>,
    ) -> Result<Self, TrainError> {
        config.validate()?;
        let data = open_data(&config)?;
        let pool = thread_pool(config.train.threads)?;
        let ledger = rank_ledger(&mesh, &*backend)?;
        let threads = pool.current_num_threads();
        let standing = standing_workspace(&config, &ledger, (&*backend, threads), &*data);
        let (_, pp_rank) = mesh.coords(GroupKind::Pp);
        let model = rank_model(&config, &mesh);
        if let Init::Checkpoint(ck) = init {
            checkpoint::check_compatible(&config, &ck.manifest)?;
        }
        let local = pool.install(|| local_values(&config, &model, init))?;
        // The full local values exist while the state is built: workspace.
        let _held = local
            .as_ref()
            .map(|v| ledger.hold(ferrotron_tensor::Category::Workspace, 4 * v.len()));
        let weights = local.as_deref();
        let plan = bucket_plan(&config, &model, &mesh);
        let (layout, (_, dp_rank)) = (model.layout.clone(), mesh.coords(GroupKind::DpCp));
        let (zero, train) = (config.parallel.zero, &config.train);
        let dev = ferrotron_tensor::Device {
            ledger: &ledger,
            backend: &*backend,
        };
        let mut state = match weights {
            Some(w) => TrainState::new(dev, layout, plan, dp_rank, zero, w, train),
            None => {
                pool.install(|| TrainState::initialised(dev, layout, plan, dp_rank, zero, train))
            }
        };
        if let Init::Checkpoint(ck) = init {
            pool.install(|| checkpoint::load_moments(&mut state, ck, dev))?;
        }
        let position = start_position(&config, init);
        let expert_bias = expert_bias(&config, &ledger, init)?;
        let fp8_history = super::fp8_amax::fp8_history(&config, &model.layout, init)?;
        let scaler = (config.train.dtype == ferrotron_config::DType::F16).then(|| {
            let saved = match init {
                Init::Checkpoint(ck) => ck.manifest.loss_scale,
                _ => None,
            };
            crate::loss_scale::LossScaler::new(&config.train.loss_scale, saved)
        });
        let pipeline = if config.parallel.pp > 1 {
            Some(Pipeline::new(
                &config,
                pp_rank,
                mesh.link(GroupKind::Pp).cloned(),
            )?)
        } else {
            None
        };
        Ok(Trainer {
            config,
            model,
            mesh,
            pipeline,
            state,
            position,
            data,
            device: Device {
                ledger,
                pool,
                backend,
                _standing: standing,
            },
            metrics: RunMetrics::default(),
            faults: Faults::default(),
            stop_flag: None,
            expert_bias,
            scaler,
            fp8_history,
        })
    }
}

/// Aux-loss-free balancing's biases: zero, or those a checkpoint saved.
fn expert_bias(
    config: &Config,
    ledger: &ferrotron_tensor::Ledger,
    init: Init<'_>,
) -> Result<super::balance::ExpertBias, TrainError> {
    let mut bias = super::balance::ExpertBias::new(config, ledger);
    if let (Init::Checkpoint(ck), Some(_)) = (init, bias.layers()) {
        // A run switched to bias balancing on resume starts from zero biases.
        if let Some(saved) = &ck.manifest.expert_bias {
            bias.restore(saved)?;
        }
    }
    Ok(bias)
}

/// Where a run starts: step 0 at the first sample, or a checkpoint's step and data
/// position; the LR schedule of `train`.
fn start_position(config: &Config, init: Init<'_>) -> Position {
    let (step, samples_done) = match init {
        Init::Checkpoint(ck) => (ck.manifest.step, ck.manifest.samples_done),
        _ => (0, 0),
    };
    let t = &config.train;
    Position {
        step,
        samples_done,
        schedule: LrSchedule {
            peak: t.lr,
            floor: t.min_lr,
            warmup: t.warmup_steps,
            total: t.steps,
        },
    }
}
