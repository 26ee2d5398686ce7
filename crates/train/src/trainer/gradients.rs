//! One step's forward and backward over its micro-batches — directly, or through the
//! pipeline schedule — with the gradients reduced where the optimizer reads them.

use std::time::Instant;

use ferrotron_comm::GroupKind;
use ferrotron_model::{MoeStep, StepCtx, WeightSource};
use ferrotron_tensor::trace::{traced, Track};
use ferrotron_tensor::Category;

use super::experts::moe_stats;
use super::Trainer;
use crate::optim::all_reduce_f64;
use crate::state::{store_dtype, TrainState};
use crate::TrainError;
use ferrotron_parallel::data_parallel::{ReductionTiming, StepSink};
use ferrotron_parallel::zero::Zero3Weights;

impl Trainer {
    /// Forward and backward of every micro-batch of the current step: gradients accumulated
    /// (and reduced over data and context parallelism) where the optimizer reads them.
    /// Returns the mean token loss of the global batch (the cross-entropy; a
    /// mixture-of-experts model's load-balancing loss is in the next
    /// [`super::StepStats::moe`]) and the timing of the gradient reductions.
    pub fn compute_gradients(&mut self) -> Result<(f64, ReductionTiming), TrainError> {
        let c = &self.config;
        let (b, s, m) = (c.train.micro_batch, c.model.seq_len, c.train.grad_accum);
        let (n_dp, dp_rank) = self.dp_coords();
        // ZeRO pieces are indexed within the reduction group (data × context parallel).
        let shard = self.state.dp_rank;
        // Context parallelism splits each sequence, not the batch: the global batch and the
        // loss scale stay those of the data-parallel ranks.
        let tokens = b * s * m * n_dp;
        let trace = self.tracer.as_deref().filter(|_| self.tracing);
        let cp = self
            .mesh
            .cp_ring(s, trace)
            .map_err(|e| TrainError::Layout(e.to_string()))?;
        // This rank's tokens of each sequence (n = s/cp of them) and their global positions.
        let keep: Option<Vec<usize>> = cp.as_ref().map(|cp| cp.positions().to_vec());
        let n = keep.as_ref().map_or(s, |k| k.len());
        let scale = 1.0 / tokens as f32;
        let dtype = store_dtype(c.train.dtype);
        let tp = self.mesh.tp_comm(c.parallel.sequence_parallel, trace);
        let ep = self.mesh.ep_comm(trace);
        let ctx = StepCtx {
            ledger: &self.ledger,
            backend: &self.backend,
            act_dtype: dtype,
            loss_chunk: c.train.loss_chunk,
            tp: tp.as_ref().map(|t| t as _),
            cp: cp.as_ref().map(|c| c as _),
            trace,
            micro_batch: Default::default(),
            recompute: c.parallel.recompute,
            // Every (data-parallel rank, micro-batch) pair's aux has the same weight.
            moe: MoeStep::new(
                &c.model,
                ep.as_ref().map(|e| e as _),
                c.model.router_aux_loss_coef / (n_dp * m) as f64,
            ),
        };
        let groups = ferrotron_parallel::data_parallel::ReduceGroups {
            dp: self.mesh.link(GroupKind::DpCp),
            edp: self.mesh.link(GroupKind::ExpertDataCp),
        };
        let mut sample = self.ledger.zeros::<u32>(Category::Workspace, s + 1);
        let mut inputs = self.ledger.zeros::<u32>(Category::Workspace, b * n);
        let mut targets = self.ledger.zeros::<u32>(Category::Workspace, b * n);
        let mut loss_sum = 0.0;
        let mut timing = ReductionTiming::default();
        let (model, state, data, step, dp, ledger) = (
            &self.model,
            &mut self.state,
            &self.data,
            self.step,
            self.mesh.link(GroupKind::DpCp),
            &self.ledger,
        );
        let fail_now = self.fail_at_step == Some(step + 1);
        // The global sample index depends on (samples consumed, micro-batch, dp rank, row)
        // only, so the global batch is the same for every layout and resumes exactly.
        let first = self.samples_done;
        let mut pipe_group = None;
        if let Some(pipe) = &self.pipeline {
            // Pipeline: the schedule interleaves the micro-batches' forwards and backwards;
            // the data-parallel reduction starts after this rank's last backward.
            let batch = |micro: usize| {
                let data_span = trace.map(|t| (t, Instant::now()));
                let mut sample = vec![0u32; s + 1];
                let (mut inputs, mut targets) = (vec![0u32; b * n], vec![0u32; b * n]);
                for row in 0..b {
                    let index = first + ((micro * n_dp + dp_rank) * b + row) as u64;
                    data.sample(index, &mut sample);
                    split_row(&sample, keep.as_deref(), row, &mut inputs, &mut targets);
                }
                if let Some((t, t0)) = data_span {
                    t.record(
                        Track::Compute,
                        "data",
                        "data",
                        t0,
                        Instant::now(),
                        Vec::new(),
                    );
                }
                (inputs, targets)
            };
            let rows = ctx.local_rows(b * n);
            let (loss, pipe_timing) = self.pool.install(|| -> Result<_, TrainError> {
                let TrainState {
                    weights,
                    grads,
                    plan,
                    zero,
                    ..
                } = state;
                let mut sink =
                    StepSink::new(grads, plan, groups, ledger, *zero, shard, false, dtype);
                let out = pipe.run(model, &ctx, weights, &mut sink, &batch, rows, scale)?;
                if fail_now {
                    return Err(TrainError::Hook(format!(
                        "injected failure at step {}",
                        step + 1
                    )));
                }
                traced(
                    trace,
                    Track::Compute,
                    "backward",
                    || "gradient buckets".into(),
                    Vec::new(),
                    || sink.launch_all(),
                )?;
                timing.add(&sink.finish()?);
                Ok(out)
            })?;
            self.last_pipeline_timing = pipe_timing;
            loss_sum = loss;
            if let Some(pp) = &pipe.group {
                loss_sum = all_reduce_f64(pp, ledger, loss_sum, "loss")?;
            }
            pipe_group = pipe.group.as_ref();
        } else {
            self.pool.install(|| -> Result<(), TrainError> {
                for micro in 0..m {
                    ctx.micro_batch
                        .store(micro, std::sync::atomic::Ordering::Relaxed);
                    traced(
                        trace,
                        Track::Compute,
                        "data",
                        || "data".into(),
                        Vec::new(),
                        || {
                            for row in 0..b {
                                let index = first + ((micro * n_dp + dp_rank) * b + row) as u64;
                                data.sample(index, &mut sample);
                                split_row(&sample, keep.as_deref(), row, &mut inputs, &mut targets);
                            }
                        },
                    );
                    let TrainState {
                        weights,
                        grads,
                        plan,
                        zero,
                        ..
                    } = state;
                    let mut sink = StepSink::new(
                        grads,
                        plan,
                        groups,
                        ledger,
                        *zero,
                        shard,
                        micro + 1 == m,
                        dtype,
                    );
                    let zero3;
                    let source: &dyn WeightSource = if *zero >= 3 {
                        zero3 =
                            Zero3Weights::new(weights, &model.layout, plan, groups, ledger, shard);
                        &zero3
                    } else {
                        weights
                    };
                    loss_sum += model.forward_backward(
                        &ctx,
                        source,
                        Some(&mut sink),
                        &inputs,
                        &targets,
                        scale,
                    )?;
                    timing.add(&sink.finish()?);
                    if fail_now {
                        return Err(TrainError::Hook(format!(
                            "injected failure at step {}",
                            step + 1
                        )));
                    }
                }
                Ok(())
            })?;
        }
        if let Some(dp) = dp {
            // Over data and context parallel ranks: every token of the global batch once.
            loss_sum = all_reduce_f64(dp, ledger, loss_sum, "loss")?;
        }
        let report = ctx.moe.report();
        drop(ctx);
        self.last_moe = moe_stats(&self.config, report, pipe_group, dp, ledger)?;
        Ok((loss_sum / tokens as f64, timing))
    }
}

/// Writes row `row` of a micro-batch from one sample (`s + 1` tokens): the inputs and
/// next-token targets at the positions `keep` (this rank's context-parallel share), or all
/// `s` of them. `inputs`, `targets`: `[b, n]` flattened, `n` = positions kept.
fn split_row(
    sample: &[u32],
    keep: Option<&[usize]>,
    row: usize,
    inputs: &mut [u32],
    targets: &mut [u32],
) {
    let s = sample.len() - 1;
    match keep {
        None => {
            inputs[row * s..(row + 1) * s].copy_from_slice(&sample[..s]);
            targets[row * s..(row + 1) * s].copy_from_slice(&sample[1..]);
        }
        Some(pos) => {
            let n = pos.len();
            for (i, &p) in pos.iter().enumerate() {
                inputs[row * n + i] = sample[p];
                targets[row * n + i] = sample[p + 1];
            }
        }
    }
}
