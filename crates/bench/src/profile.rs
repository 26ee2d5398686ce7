//! The step profile (`ferrotron bench --profile`): where one training step's time goes, by
//! kernel class, against this machine's measured limits.
//!
//! The trainer runs on a [`ProfiledBackend`] around the CPU backend, which times every
//! kernel call and counts its FLOPs and bytes. After warm-up steps, the profile of the timed
//! steps gives, per class: time per step, its share of the step, and the rate it reached —
//! GFLOP/s against the measured GEMM peak for classes that compute (GEMMs, attention, the LM
//! head), GB/s against the measured memory bandwidth for the memory-bound rest. What is not
//! inside a kernel (host code between kernels, data loading, the optimizer's loop) is the
//! step time minus the kernels' sum; cores left idle are `threads × wall − CPU time` of the
//! process (a spinning worker counts as busy).

use std::sync::Arc;
use std::time::Instant;

use ferrotron_config::Config;
use ferrotron_parallel::RankMesh;
use ferrotron_tensor::elementwise::add;
pub use ferrotron_tensor::profile::process_cpu_seconds;
use ferrotron_tensor::profile::ProfiledBackend;
use serde::{Deserialize, Serialize};

use ferrotron_train::{Init, TrainError, Trainer};

/// One class of kernels in a step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProfileRow {
    /// The class (a GEMM's role and shape, `attention forward`, `AdamW`, …).
    pub class: String,
    /// Calls per step.
    pub calls: f64,
    /// Seconds per step.
    pub seconds: f64,
    /// Floating-point operations per step.
    pub flops: f64,
    /// Bytes moved per step.
    pub bytes: f64,
    /// Achieved FLOP/s, for classes that compute.
    pub flops_per_s: Option<f64>,
    /// Achieved bytes/s, for memory-bound classes.
    pub bytes_per_s: Option<f64>,
    /// The rate as a fraction of the machine's limit for it (GEMM peak or bandwidth).
    pub of_limit: f64,
    /// Cores busy inside the class on average: the process's CPU seconds during its calls
    /// over their wall seconds (the thread count when no core waited).
    #[serde(default)]
    pub cores_busy: f64,
}

/// A step's profile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepProfile {
    /// Compute threads.
    pub threads: usize,
    /// Timed steps.
    pub steps: usize,
    /// Mean wall seconds per step.
    pub step_seconds: f64,
    /// Kernel classes, slowest first.
    pub rows: Vec<ProfileRow>,
    /// Seconds per step outside any kernel.
    pub outside_kernels: f64,
    /// Core-seconds per step no thread of the process used (`threads × wall − CPU time`).
    pub idle_core_seconds: f64,
    /// Of those, the core-seconds per step left idle inside kernels (`threads × seconds − CPU
    /// seconds` of every class).
    #[serde(default)]
    pub idle_in_kernels: f64,
    /// Bytes of buffers the step allocated zero-filled (the ledger's count), per step.
    #[serde(default)]
    pub allocated_bytes: f64,
    /// Buffers the step allocated zero-filled, per step.
    #[serde(default)]
    pub allocations: f64,
    /// Buffers the step was handed in recycled memory, without a fill, per step.
    #[serde(default)]
    pub reused: f64,
    /// Their bytes, per step.
    #[serde(default)]
    pub reused_bytes: f64,
    /// The GEMM peak the rates are compared with (FLOP/s).
    pub peak_flops: f64,
    /// The memory bandwidth the rates are compared with (bytes/s).
    pub bandwidth: f64,
    /// Model FLOPs per step ÷ step time ÷ peak: the run's MFU.
    pub mfu: f64,
}

/// Profiles `steps` steps of `config` (single rank) after `warmup` steps, against the GEMM
/// peak `peak_flops` and the memory bandwidth `bandwidth` of this thread count.
pub fn profile(
    config: Config,
    warmup: usize,
    steps: usize,
    limits: (f64, f64),
) -> Result<StepProfile, TrainError> {
    let host = ferrotron_train::trainer::host_backend(&config)?;
    profile_on(config, host, warmup, steps, limits)
}

/// [`profile`] with the kernels of `device` (a GPU's backend, say): each call is timed up to
/// the end of the device's [`Backend::synchronize`](ferrotron_tensor::Backend::synchronize),
/// so an asynchronous device's kernels are timed whole, each with its launch's latency.
pub fn profile_on(
    mut config: Config,
    device: Arc<dyn ferrotron_tensor::Backend>,
    warmup: usize,
    steps: usize,
    (peak_flops, bandwidth): (f64, f64),
) -> Result<StepProfile, TrainError> {
    config.train.steps = warmup + steps;
    let backend = Arc::new(ProfiledBackend::new(device));
    let mut trainer =
        Trainer::for_rank_on(config, Init::Fresh, RankMesh::single(), backend.clone())?;
    for _ in 0..warmup {
        trainer.step()?;
    }
    backend.reset();
    let mem0 = trainer.memory();
    let (cpu0, start) = (process_cpu_seconds(), Instant::now());
    let mut tokens = 0.0;
    for _ in 0..steps {
        tokens += trainer.step()?.tokens as f64;
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu0;
    let mem1 = trainer.memory();
    let n = steps.max(1) as f64;
    let mut rows: Vec<ProfileRow> = backend
        .snapshot()
        .into_iter()
        .map(|(class, s)| {
            let computes = s.flops > 0.0;
            let (rate, limit) = match computes {
                true => (s.flops / s.seconds, peak_flops),
                false => (s.bytes / s.seconds, bandwidth),
            };
            ProfileRow {
                class,
                calls: s.calls as f64 / n,
                seconds: s.seconds / n,
                flops: s.flops / n,
                bytes: s.bytes / n,
                flops_per_s: computes.then_some(rate),
                bytes_per_s: (!computes).then_some(rate),
                of_limit: rate / limit,
                cores_busy: s.cpu_seconds / s.seconds,
            }
        })
        .collect();
    rows.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let in_kernels: f64 = rows.iter().map(|r| r.seconds).sum();
    let threads = trainer.threads();
    let idle_in_kernels: f64 = rows
        .iter()
        .map(|r| (threads as f64 - r.cores_busy).max(0.0) * r.seconds)
        .sum();
    let model_flops = trainer.flops_per_token() * tokens;
    Ok(StepProfile {
        threads,
        steps,
        step_seconds: wall / n,
        outside_kernels: wall / n - in_kernels,
        idle_core_seconds: (threads as f64 * wall - cpu).max(0.0) / n,
        idle_in_kernels,
        allocated_bytes: ((mem1.allocated - mem0.allocated)
            - (mem1.reused_bytes - mem0.reused_bytes)) as f64
            / n,
        allocations: ((mem1.allocations - mem0.allocations) - (mem1.reused - mem0.reused)) as f64
            / n,
        reused: (mem1.reused - mem0.reused) as f64 / n,
        reused_bytes: (mem1.reused_bytes - mem0.reused_bytes) as f64 / n,
        rows,
        peak_flops,
        bandwidth,
        mfu: model_flops / wall / peak_flops,
    })
}

/// Median bytes/s of `reps` element-wise adds over 16 Mi f32 (two 64 MiB inputs, one
/// output: 192 MiB moved per add) on the current rayon pool: the memory bandwidth the
/// element-wise kernels can reach.
pub fn measure_bandwidth(reps: usize) -> f64 {
    let n = 16 << 20;
    let a: Vec<f32> = (0..n).map(|i| (i % 13) as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut out = vec![0.0f32; n];
    add(&mut out, &a, &b); // warm-up: page faults
    let mut rates: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            add(&mut out, &a, &b);
            12.0 * n as f64 / t.elapsed().as_secs_f64()
        })
        .collect();
    rates.sort_by(|x, y| x.total_cmp(y));
    rates[rates.len() / 2]
}

impl StepProfile {
    /// The profile as a Markdown table: one row per class, then the time outside kernels and
    /// the idle cores.
    pub fn table(&self) -> String {
        let ms = |s: f64| s * 1e3;
        let share = |s: f64| 100.0 * s / self.step_seconds;
        let mut out = format!(
            "step {:.1} ms ({} threads, mean of {} steps), MFU {:.1}% of the GEMM peak {:.1} GFLOP/s; memory bandwidth {:.1} GB/s\n\n\
             | kernel class | calls/step | ms/step | share | achieved | of limit | cores busy |\n|---|---|---|---|---|---|---|\n",
            ms(self.step_seconds),
            self.threads,
            self.steps,
            100.0 * self.mfu,
            self.peak_flops / 1e9,
            self.bandwidth / 1e9
        );
        for r in &self.rows {
            let achieved = match (r.flops_per_s, r.bytes_per_s) {
                (Some(f), _) => format!("{:.1} GFLOP/s", f / 1e9),
                (_, Some(b)) => format!("{:.1} GB/s", b / 1e9),
                _ => String::new(),
            };
            out += &format!(
                "| {} | {:.0} | {:.2} | {:.1}% | {achieved} | {:.0}% | {:.2} |\n",
                r.class,
                r.calls,
                ms(r.seconds),
                share(r.seconds),
                100.0 * r.of_limit,
                r.cores_busy
            );
        }
        out += &format!(
            "| outside kernels (host code, data, serial sections) | | {:.2} | {:.1}% | | | |\n",
            ms(self.outside_kernels),
            share(self.outside_kernels)
        );
        out += &format!(
            "| of which: buffers allocated (zero-filled) | {:.0} | | | {:.1} MiB | | |\n",
            self.allocations,
            self.allocated_bytes / (1u64 << 20) as f64
        );
        out += &format!(
            "| of which: buffers reused (recycled, no fill) | {:.0} | | | {:.1} MiB | | |\n",
            self.reused,
            self.reused_bytes / (1u64 << 20) as f64
        );
        out += &format!(
            "| cores idle (threads × wall − CPU time), core-ms | | {:.2} | {:.1}% of {} cores | | | |\n",
            ms(self.idle_core_seconds),
            share(self.idle_core_seconds) / self.threads.max(1) as f64,
            self.threads
        );
        out += &format!(
            "| of which: inside kernels, core-ms | | {:.2} | {:.1}% of {} cores | | | |\n",
            ms(self.idle_in_kernels),
            share(self.idle_in_kernels) / self.threads.max(1) as f64,
            self.threads
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every matmul of a step goes through the profiled backend: the GEMM and LM-head classes
    /// add up to 6 FLOPs per token per weight of the linear layers and the head (forward,
    /// backward input, backward weight), and attention to its causal count.
    #[test]
    fn the_profile_counts_every_matmul_of_the_step() {
        let mut c = Config::default();
        (c.model.vocab, c.model.hidden, c.model.layers) = (64, 32, 2);
        (
            c.model.heads,
            c.model.kv_heads,
            c.model.ffn,
            c.model.seq_len,
        ) = (4, 2, 48, 16);
        (c.train.micro_batch, c.train.grad_accum, c.train.threads) = (2, 2, 1);
        let p = profile(c.clone(), 1, 2, (1e9, 1e9)).unwrap();
        let m = &c.model;
        let tokens = (c.train.micro_batch * c.train.grad_accum * m.seq_len) as f64;
        let d = m.head_dim();
        let linear = m.hidden * (m.heads + 2 * m.kv_heads) * d
            + m.heads * d * m.hidden
            + 3 * m.hidden * m.ffn;
        let weights = (m.layers * linear + m.vocab * m.hidden) as f64;
        let sum = |prefix: &str| -> f64 {
            p.rows
                .iter()
                .filter(|r| r.class.starts_with(prefix))
                .map(|r| r.flops)
                .sum()
        };
        assert_eq!(sum("GEMM") + sum("LM head"), 6.0 * tokens * weights);
        let pairs = (m.seq_len * (m.seq_len + 1) / 2) as f64;
        let sequences = tokens / m.seq_len as f64;
        let per_product = 2.0 * sequences * m.heads as f64 * pairs * d as f64;
        assert_eq!(
            sum("attention forward"),
            2.0 * per_product * m.layers as f64
        );
        assert_eq!(
            sum("attention backward"),
            5.0 * per_product * m.layers as f64
        );
        let adamw = p.rows.iter().find(|r| r.class == "AdamW").unwrap();
        assert_eq!(adamw.bytes, 7.0 * 4.0 * m.num_params() as f64);
        assert!(p.step_seconds > 0.0 && p.outside_kernels < p.step_seconds);
        // One thread: every class's busy cores lie in (0, 1] but for other threads of the
        // test process; the idle core-seconds inside kernels are the rows' own sum.
        assert!(p
            .rows
            .iter()
            .all(|r| r.cores_busy > 0.0 && r.cores_busy.is_finite()));
        let idle: f64 = p
            .rows
            .iter()
            .map(|r| (1.0 - r.cores_busy).max(0.0) * r.seconds)
            .sum();
        assert_eq!(p.idle_in_kernels, idle);
        let in_kernels: f64 = p.rows.iter().map(|r| r.seconds).sum();
        assert!(p.idle_in_kernels <= in_kernels);
    }
}
