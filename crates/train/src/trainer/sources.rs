//! Where a trainer's state and tokens come from, and its compute pool.

use ferrotron_config::Config;
use ferrotron_data::blend::corpus_seed;
use ferrotron_data::synthetic::SyntheticCorpus;
use ferrotron_data::{open_tokens, Blend, DataSource, FileSampler, TokenStore};

use ferrotron_tensor::linear::HostMatmul;
use ferrotron_tensor::{Backend, CpuBackend};

use crate::TrainError;

/// Where a trainer's weights and optimizer states come from.
#[derive(Clone, Copy)]
pub enum Init<'a> {
    /// The layout-independent initialisation drawn from (seed, parameter name).
    Fresh,
    /// These full fp32 weights in full-layout order (fresh optimizer states).
    Weights(&'a [f32]),
    /// A checkpoint, saved under any layout: weights, optimizer states, step and data
    /// position.
    Checkpoint(&'a crate::checkpoint::Checkpoint),
}

/// The token source a config names: the token file or Megatron dataset of `data.path`, the
/// blend of `data.blend`, or the embedded synthetic corpus.
pub fn open_data(config: &Config) -> Result<Box<dyn DataSource>, TrainError> {
    let corpus = |path: &std::path::Path, c: usize| -> Result<Box<dyn DataSource>, TrainError> {
        let file = open_tokens(path)?;
        file.check_vocab(config.model.vocab)?;
        let seed = corpus_seed(config.train.seed, c);
        Ok(Box::new(FileSampler::new(
            file,
            config.model.seq_len,
            seed,
        )?))
    };
    if let Some(path) = &config.data.path {
        return corpus(path, 0);
    }
    if config.data.blend.is_empty() {
        return Ok(Box::new(SyntheticCorpus::new(
            config.model.vocab,
            config.train.seed,
        )));
    }
    let parts = config
        .data
        .blend
        .iter()
        .enumerate()
        .map(|(c, (weight, path))| Ok((*weight, corpus(path, c)?)))
        .collect::<Result<Vec<_>, TrainError>>()?;
    Ok(Box::new(Blend::new(parts)?))
}

/// A rayon pool of `threads` workers (0 = one per core).
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool, TrainError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if threads > cores {
        eprintln!(
            "warning: {threads} compute threads asked for, this machine has {cores} cores: using {cores}"
        );
        cores
    } else {
        threads
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Threads(e.to_string()))
}

/// Where the linear layers of a run on `matmul` compute, in words (e.g. "OpenBLAS 0.3.21,
/// 2 threads"), loading the library when it is one.
///
/// # Errors
///
/// As [`HostMatmul::load`]: a library that is not installed, naming the fix.
pub fn matmul_description(matmul: ferrotron_config::Matmul) -> Result<String, TrainError> {
    Ok(HostMatmul::load(matmul)?.describe())
}

/// The host backend `config` asks for: the CPU kernels with the linear layers' products on
/// `train.matmul`'s library (loading OpenBLAS when it is named: an error names the fix when
/// it is missing).
pub fn host_backend(config: &Config) -> Result<std::sync::Arc<dyn Backend>, TrainError> {
    config.validate()?;
    Ok(std::sync::Arc::new(CpuBackend::new(HostMatmul::load(
        config.train.matmul,
    )?)))
}
