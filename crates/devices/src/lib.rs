//! The backend of each rank of a run (`train.device`): the CPU backend, or CUDA ranks on this
//! machine's GPUs. Opened before any rank starts, so a missing driver, library or GPU is an
//! error before any work; and the check that a run fits the memory it will run in
//! ([`memory_check`]).

#![warn(missing_docs)]

pub mod memory_check;

use std::sync::Arc;

use ferrotron_config::{Config, Device};
pub use ferrotron_tensor::Backend;

/// What can stop a run's devices from opening.
#[derive(Debug, thiserror::Error)]
pub enum DevicesError {
    /// The host backend (its matmul library) could not load.
    #[error(transparent)]
    Train(#[from] ferrotron_train::TrainError),
    /// No CUDA here: the build lacks it, the driver sees no GPU, or a GPU failed to open.
    #[error("{0}")]
    Cuda(String),
    /// The run does not fit the memory it would run in.
    #[error("{0}")]
    Memory(String),
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, DevicesError>;

/// What to say when the build has no CUDA support.
#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "train.device = \"cuda\": this ferrotron was built without CUDA. Rebuild \
     with `cargo build --release --features cuda` (running needs the NVIDIA driver, libnvrtc \
     and libcublasLt of CUDA 13) or set train.device = \"cpu\"";

/// The backends of ranks `0..world` run as threads of this process; `None` on the CPU
/// (every rank uses the host backend, `ferrotron_tensor::CpuBackend`). Rank `r` uses GPU
/// `r mod count`. With `memory_check`, the ranks sharing a GPU must fit in its memory by the
/// estimator.
///
/// # Errors
///
/// [`DevicesError::Cuda`] and [`DevicesError::Memory`].
pub fn thread_backends(
    config: &Config,
    world: usize,
    memory_check: bool,
) -> Result<Option<Vec<Arc<dyn Backend>>>> {
    match config.train.device {
        Device::Cpu => Ok(None),
        Device::Cuda => cuda::backends(config, 0..world, world, memory_check).map(Some),
    }
}

/// The backend of a one-process inference (`generate`, `eval`): the host's, or GPU 0's (with
/// no training-memory check: inference holds no gradients or optimizer states).
///
/// # Errors
///
/// [`DevicesError::Cuda`] when `device` is CUDA and it cannot open.
pub fn inference_backend(device: Device) -> Result<Arc<dyn Backend>> {
    let mut config = Config::default();
    config.train.device = device;
    if device == Device::Cpu {
        return Ok(ferrotron_train::launch::host_backend(&config)?);
    }
    if !cfg!(feature = "cuda") {
        return Err(DevicesError::Cuda(
            "--device cuda: this ferrotron was built without CUDA. Rebuild with `cargo build \
             --release --features cuda` (running needs the NVIDIA driver, libnvrtc and \
             libcublasLt of CUDA 13) or use --device cpu"
                .into(),
        ));
    }
    Ok(cuda::backends(&config, 0..1, 1, false)?.remove(0))
}

/// The backend of rank `rank` of an MPI job (one process per rank; GPU `rank mod count`).
///
/// # Errors
///
/// As [`thread_backends`].
pub fn rank_backend(config: &Config, rank: usize) -> Result<Arc<dyn Backend>> {
    match config.train.device {
        Device::Cpu => Ok(ferrotron_train::launch::host_backend(config)?),
        Device::Cuda => Ok(cuda::backends(config, rank..rank + 1, 1, true)?.remove(0)),
    }
}

/// GPUs a run's ranks occupy (at least 1): ranks as threads share this machine's GPUs (rank
/// `r` on GPU `r mod count`); under MPI every rank is taken to have a GPU of its own (MPI
/// ranks sharing a GPU make the run's MFU read low).
pub fn gpus_in_use(config: &Config) -> usize {
    let world = config.parallel.world_size();
    let gpus = match config.parallel.backend {
        ferrotron_config::CommBackend::Threads => world.min(cuda::count()),
        _ => world,
    };
    gpus.max(1)
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;

    pub fn backends(
        _config: &Config,
        _ranks: std::ops::Range<usize>,
        _in_process: usize,
        _memory_check: bool,
    ) -> Result<Vec<Arc<dyn Backend>>> {
        Err(DevicesError::Cuda(NO_CUDA.into()))
    }

    pub fn count() -> usize {
        0
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::BTreeMap;

    use ferrotron_cuda::{CudaBackend, CudaOptions, Gpu};

    use super::*;

    /// GPUs the driver sees (0 when it cannot be asked).
    pub fn count() -> usize {
        Gpu::count().unwrap_or(0)
    }

    /// Backends of `ranks` (`in_process` of them share this process's GPUs).
    pub fn backends(
        config: &Config,
        ranks: std::ops::Range<usize>,
        in_process: usize,
        memory_check: bool,
    ) -> Result<Vec<Arc<dyn Backend>>> {
        let gpu_err = |e: ferrotron_cuda::GpuError| DevicesError::Cuda(e.to_string());
        let count = Gpu::count().map_err(gpu_err)?;
        if count == 0 {
            return Err(DevicesError::Cuda(
                "train.device = \"cuda\" but the CUDA driver sees no GPU (check nvidia-smi \
                 and CUDA_VISIBLE_DEVICES)"
                    .into(),
            ));
        }
        // Every GPU is opened and checked against its share of the ranks before any rank's
        // backend allocates (its GEMM workspace, bf16 products' scratch).
        let mut gpus: BTreeMap<usize, Arc<Gpu>> = BTreeMap::new();
        for ordinal in ranks.clone().map(|rank| rank % count) {
            if let std::collections::btree_map::Entry::Vacant(e) = gpus.entry(ordinal) {
                e.insert(Gpu::open(ordinal).map_err(gpu_err)?);
            }
        }
        if memory_check {
            let per_gpu = in_process.div_ceil(count) as u64;
            for gpu in gpus.values() {
                crate::memory_check::check_device(
                    config,
                    per_gpu,
                    gpu.total_memory() as u64,
                    &format!("GPU {} ({})", gpu.ordinal(), gpu.name()),
                )?;
            }
        }
        let options = CudaOptions::of(config);
        let mut out = Vec::new();
        for rank in ranks {
            let gpu = gpus[&(rank % count)].clone();
            let backend = CudaBackend::new(gpu, options).map_err(gpu_err)?;
            out.push(Arc::new(backend) as Arc<dyn Backend>);
        }
        Ok(out)
    }
}
