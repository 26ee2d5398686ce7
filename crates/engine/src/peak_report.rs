//! The matmul peak a run's MFU is against (cached, or measured by the leader while the
//! other ranks wait) and the leader's closing lines about loss, throughput and MFU.

use ferrotron_bench::peak;
use ferrotron_config::CommBackend;
use ferrotron_train::trainer::thread_pool;
use ferrotron_train::{mfu, RunSummary, TrainError, Trainer};

use crate::{say, Console};

/// The matmul peak a run's MFU is against: measured or cached by the leader alone, for
/// `threads` threads per process, `copies` processes' worth.
pub(crate) struct Peak {
    /// FLOP/s of one process's cores (the leader's; `None` on the other ranks).
    flops: Option<f64>,
    threads: usize,
    copies: usize,
    products: peak::Products,
    /// GPUs the ranks occupy (0 on the CPU): `flops` is then one GPU's GEMM peak.
    gpus: usize,
    /// The GPUs' products: `f32`, `TF32` (`train.tf32`) or `bf16-product`.
    gpu_products: &'static str,
}

impl Peak {
    /// The peak of the cores this run occupies (one definition: `ferrotron_train::mfu`).
    /// Only the leader reports MFU, so only the leader measures, while the others wait at a
    /// barrier (so that they do not compute on the cores being measured); the trainer's
    /// metrics get the run's peak.
    pub(crate) fn settle(
        trainer: &mut Trainer,
        threads: usize,
        console: &dyn Console,
    ) -> Result<Peak, TrainError> {
        if trainer.config.train.device == ferrotron_config::Device::Cuda {
            return Peak::on_gpus(trainer, threads);
        }
        let cfg = &trainer.config;
        let occupancy = mfu::Occupancy {
            ranks: cfg.parallel.world_size(),
            threads_per_rank: threads,
            shared_host: cfg.parallel.backend == CommBackend::Threads,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let (peak_threads, copies) = occupancy.peak_shape();
        // bf16 products are measured against the bf16 products' own peak.
        let products = peak::Products::of(cfg.train.matmul);
        let flops = if trainer.rank() == 0 {
            Some(match peak::cached_peak_of(peak_threads, products) {
                Some(p) => p,
                None => measure_peak(peak_threads, products, console)?,
            })
        } else {
            None
        };
        trainer.world_barrier()?;
        trainer.metrics.peak_flops = flops.map(|p| p * copies as f64);
        trainer.metrics.peak_threads = peak_threads * copies;
        Ok(Peak {
            flops,
            threads: peak_threads,
            copies,
            products,
            gpus: 0,
            gpu_products: "",
        })
    }

    /// On GPUs: the leader times its GPU's GEMMs (the run's products: f32, TF32 where allowed,
    /// or bf16 products) while the other ranks wait; the run's peak is that times the GPUs in
    /// use.
    fn on_gpus(trainer: &mut Trainer, threads: usize) -> Result<Peak, TrainError> {
        let cfg = &trainer.config;
        let gpus = ferrotron_devices::gpus_in_use(cfg);
        let n = peak::DEVICE_PEAK_SIZE;
        let bf16 = cfg.train.matmul == ferrotron_config::Matmul::Bf16;
        // bf16 products round their operands into the rank's scratch, sized for the model's
        // products: the peak's product must fit in it, or no MFU is reported.
        let fits = !bf16 || {
            let t = &cfg.train;
            let scratch = ferrotron_config::device_bf16_operand_bytes(
                &cfg.model,
                &cfg.parallel,
                (t.micro_batch, t.loss_chunk),
            );
            scratch as usize >= ferrotron_config::device_bf16_second_operand(n * n) + 2 * n * n
        };
        let gpu_products = match (bf16, cfg.train.tf32) {
            (true, _) => "bf16-product",
            (false, true) => "TF32",
            (false, false) => "f32",
        };
        let flops = match (trainer.rank(), fits) {
            (0, true) => peak::measure_device_peak(&**trainer.backend(), n, 9),
            _ => None,
        };
        trainer.world_barrier()?;
        trainer.metrics.peak_flops = flops.map(|p| p * gpus as f64);
        Ok(Peak {
            flops,
            threads,
            copies: 1,
            products: peak::Products::F32,
            gpus,
            gpu_products,
        })
    }

    /// `f32` or `bf16-product`, as the report names the peak.
    fn kind(&self) -> &'static str {
        match self.products {
            peak::Products::F32 => "f32",
            peak::Products::Bf16 => "bf16-product",
        }
    }
}

/// Measures the matmul peak of `threads` threads (the other ranks wait at a barrier, so
/// that they do not compute on the cores being measured). A quiet measurement is cached for
/// later runs (the cache keeps the best quiet one); one taken while other processes took
/// the cores is used for this run only, and said so.
fn measure_peak(
    threads: usize,
    products: peak::Products,
    console: &dyn Console,
) -> Result<f64, TrainError> {
    let m = thread_pool(threads)?.install(|| peak::measure_peak_of(products, 7));
    if peak::store_peak_of(threads, products, m) == peak::Stored::NotQuiet {
        say!(
            console,
            "warning: the matmul peak ({:.1} GFLOP/s with {threads} threads) was measured while the machine was busy: {}; MFU may read high (it is never counted above what this run's own products reach). Run `ferrotron bench --configs ''` on a quiet machine to cache a true one",
            m.gflops,
            m.describe()
        );
    }
    Ok(m.flops())
}

/// How the MFU numerator counts attention: the window's full matrix, or under document
/// masking each document's.
fn attention_counted(summary: &RunSummary) -> String {
    match summary.attention_span {
        None => "full attention, as nanotron and Megatron-LM count them".into(),
        Some(span) => format!(
            "each document's full attention, as if each were a sequence of its own (document masking: {span:.0} keys per token of the window's {})",
            summary.config.model.seq_len
        ),
    }
}

/// The leader's closing lines: loss, tokens/s and MFU (with a warning where MFU above 100%
/// shows a stale peak), and how much of the gradient reductions was hidden.
pub(crate) fn report(summary: &RunSummary, trained: bool, peak: &Peak, console: &dyn Console) {
    let threads = peak.threads;
    if trained && peak.gpus > 0 && peak.flops.is_none() {
        say!(
            console,
            "done: final loss {:.4} (mean of last 10% {:.4}); {:.0} tokens/s median; MFU not reported: the GPU's bf16-product peak is measured on a {n}² product, which this run's bf16 scratch (sized for its own products) cannot hold",
            summary.final_loss,
            summary.tail_loss,
            summary.tokens_per_s,
            n = peak::DEVICE_PEAK_SIZE
        );
    } else if trained && peak.gpus > 0 {
        say!(
            console,
            "done: final loss {:.4} (mean of last 10% {:.4}); {:.0} tokens/s median; MFU {:.1}% of the measured {} GEMM peak of the GPUs this run occupies ({:.1} TFLOP/s each with cuBLASLt, × {} GPU{}; model FLOPs with {})",
            summary.final_loss,
            summary.tail_loss,
            summary.tokens_per_s,
            summary.mfu.unwrap_or(0.0) * 100.0,
            peak.gpu_products,
            peak.flops.unwrap_or(0.0) / 1e12,
            peak.gpus,
            if peak.gpus > 1 { "s" } else { "" },
            attention_counted(summary)
        );
    } else if trained {
        say!(
            console,
            "done: final loss {:.4} (mean of last 10% {:.4}); {:.0} tokens/s median; MFU {:.1}% of the measured {} matmul peak of the cores this run occupies ({:.1} GFLOP/s with {threads} threads{}; model FLOPs with {})",
            summary.final_loss,
            summary.tail_loss,
            summary.tokens_per_s,
            summary.mfu.unwrap_or(0.0) * 100.0,
            peak.kind(),
            peak.flops.unwrap_or(0.0) / 1e9,
            if peak.copies > 1 { format!(", × {} processes", peak.copies) } else { String::new() },
            attention_counted(summary)
        );
    }
    let measured = peak.flops.unwrap_or(0.0) * peak.copies as f64 / 1e9;
    // The products' best beats a median peak by a little in most runs; more says the peak
    // was taken under load or is stale.
    if summary.peak_from_products && summary.peak_gflops.unwrap_or(0.0) > 1.05 * measured {
        say!(
            console,
            "note: this run's own linear products reached more than the measured matmul peak ({:.1} GFLOP/s): MFU is against what they reached, {:.1} GFLOP/s over the cores the run occupies (summary.json: peak_from_products)",
            measured,
            summary.peak_gflops.unwrap_or(0.0)
        );
    }
    if peak.gpus == 0 && summary.mfu.is_some_and(|m| m > 1.0) {
        warn_stale_peak(peak, console);
    }
    match (summary.checkpoint_blocked_s, summary.checkpoint_background_s) {
        (Some(blocked), Some(written)) => say!(
            console,
            "checkpoints: written in the background in {written:.2} s; the step loop waited {blocked:.2} s for its saves"
        ),
        (Some(blocked), None) => say!(
            console,
            "checkpoints: the step loop waited {blocked:.2} s for its saves (synchronous)"
        ),
        _ => {}
    }
    if let (Some(h), Some(e)) = (summary.reduce_hidden_share, summary.reduce_exposed_share) {
        say!(
            console,
            "gradient reductions (rank 0): {:.1}% of their time hidden behind backward; exposed communication {:.1}% of step time",
            h * 100.0,
            e * 100.0
        );
    }
}

/// MFU above 100% on the CPU: the peak is stale or was measured under load; says which and
/// how to measure it again.
fn warn_stale_peak(peak: &Peak, console: &dyn Console) {
    let threads = peak.threads;
    let when = match (
        peak::cached_measurement_of(threads, peak.products),
        peak::cached_peak_of(threads, peak.products),
    ) {
        (Some(m), _) => format!("cached peak: {}", m.describe()),
        (None, Some(_)) => "the cached peak does not say how it was measured".into(),
        (None, None) => "no cached peak: this run measured it under its own load".into(),
    };
    say!(
        console,
        "warning: MFU above 100% means the matmul peak is stale or was measured while other processes ran ({when}); run `ferrotron bench --configs ''{}` on a quiet machine to measure it again",
        match peak.products {
            peak::Products::F32 => "",
            peak::Products::Bf16 => " --matmul bf16 --dtype bf16",
        }
    );
}
