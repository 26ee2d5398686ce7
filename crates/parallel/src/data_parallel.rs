//! Data parallelism (playbook §4) and the gradient side of ZeRO: where gradients go during
//! backward. (Where ZeRO-3 weights come from is [`crate::zero`].)
//!
//! - ZeRO-0/1: gradients accumulate in the full buffer over micro-batches; during the
//!   backward of the step's **last** micro-batch, each bucket's reduction starts
//!   asynchronously as soon as its last unit is done (all-reduce for ZeRO-0, reduce-scatter
//!   for ZeRO-1), and is skipped on earlier micro-batches.
//! - ZeRO-2/3: there is no full gradient buffer. Each bucket's gradients land in a transient
//!   bucket buffer (counted as communication) that is reduce-scattered as soon as the bucket
//!   is complete, on every micro-batch; this rank's piece is added into its gradient shard.
//! - Mixture-of-experts experts live in buckets of their own that are reduced (and, under
//!   ZeRO, sharded and gathered) over the expert-data group instead ([`ReduceGroups`]).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use ferrotron_comm::{CommBuf, CommError, Handle, ReduceOp};
use ferrotron_model::{GradSink, Grads, HookError, OptimizerGrads, Unit};
use ferrotron_tensor::trace::Track;
use ferrotron_tensor::{bf16, Backend, Category, Device, DeviceSlice, Store, StoreDType, View};

use crate::buckets::BucketPlan;

pub use crate::mesh::GroupComm;

/// The groups a rank's gradient buckets are reduced over.
#[derive(Clone, Copy, Default)]
pub struct ReduceGroups<'a> {
    /// Every data-parallel replica: dense parameters (None with one replica).
    pub dp: Option<&'a GroupComm>,
    /// The replicas of this rank's experts, the expert-data group: expert buckets (None
    /// when it has one member).
    pub edp: Option<&'a GroupComm>,
}

impl<'a> ReduceGroups<'a> {
    /// The group bucket `k` of `plan` is reduced over (None: a group of one).
    pub fn of(&self, plan: &BucketPlan, k: usize) -> Option<&'a GroupComm> {
        if plan.buckets[k].experts {
            self.edp
        } else {
            self.dp
        }
    }
}

/// Gradient reductions a rank keeps in flight. The communication worker runs them one at a
/// time, so one running and one queued keep it busy; more would only hold more bucket
/// copies (each `bucket_mb`, plus its result) without hiding more.
pub const MAX_REDUCTIONS_IN_FLIGHT: usize = 2;

/// A copy of `src` as a communication buffer.
pub fn comm_f32(dev: Device<'_>, src: &DeviceSlice<f32>) -> CommBuf {
    CommBuf::copy_of(dev, src)
}

/// A copy of `src` (bf16) as a communication buffer.
pub fn comm_bf16(dev: Device<'_>, src: &DeviceSlice<bf16>) -> CommBuf {
    let mut b = dev.ledger.zeros::<bf16>(Category::Communication, src.len());
    dev.backend.copy_bf16(&mut b, src);
    CommBuf::Bf16(b)
}

/// A copy of `range` of a store, in its dtype; fp16 stores travel widened to f32 (exactly:
/// the collectives carry f32 and bf16, and [`write_store`] rounds back without loss).
pub fn comm_of_store(dev: Device<'_>, store: &Store, range: Range<usize>) -> CommBuf {
    match store {
        Store::F32(b) => comm_f32(dev, &b[range]),
        Store::Bf16(b) => comm_bf16(dev, &b[range]),
        Store::F16(b) => {
            let mut out = dev.ledger.overwritten(Category::Communication, range.len());
            dev.backend.widen_f16(&mut out, &b[range]);
            CommBuf::F32(out)
        }
    }
}

/// Writes a received buffer into `range` of a store (dtypes match by construction; a
/// mismatch converts).
pub fn write_store(be: &dyn Backend, store: &mut Store, at: usize, buf: &CommBuf) {
    match (store, buf) {
        (Store::F32(d), CommBuf::F32(s)) => be.copy(&mut d[at..at + s.len()], s),
        (Store::Bf16(d), CommBuf::Bf16(s)) => be.copy_bf16(&mut d[at..at + s.len()], s),
        (Store::F32(d), CommBuf::Bf16(s)) => be.widen_bf16(&mut d[at..at + s.len()], s),
        (Store::Bf16(d), CommBuf::F32(s)) => be.round_bf16(&mut d[at..at + s.len()], s),
        (Store::F16(d), CommBuf::F32(s)) => be.round_f16(&mut d[at..at + s.len()], s),
        (Store::F16(_), CommBuf::Bf16(_)) => unreachable!("fp16 stores travel as f32"),
    }
}

/// `buf` as f32: borrowed, or widened into counted workspace.
fn as_f32<'a>(dev: Device<'_>, buf: &'a CommBuf) -> View<'a> {
    match buf {
        CommBuf::F32(b) => View::Borrowed(b),
        CommBuf::Bf16(b) => {
            let mut out = dev.ledger.zeros::<f32>(Category::Workspace, b.len());
            dev.backend.widen_bf16(&mut out, b);
            View::Owned(out)
        }
    }
}

/// Timing of the gradient reductions of one micro-batch, to measure overlap.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReductionTiming {
    /// Reductions launched.
    pub launched: usize,
    /// Total time the reductions executed (on the communication worker).
    pub busy: Duration,
    /// The part of `busy` that ran before backward ended, i.e. hidden behind compute.
    pub hidden: Duration,
    /// Time the rank spent blocked waiting for reductions after backward (exposed).
    pub exposed: Duration,
}

impl ReductionTiming {
    /// Adds another micro-batch's timing.
    pub fn add(&mut self, other: &ReductionTiming) {
        self.launched += other.launched;
        self.busy += other.busy;
        self.hidden += other.hidden;
        self.exposed += other.exposed;
    }
}

/// Where and how a rank's gradients are reduced: the bucket layout and its groups, the ZeRO
/// stage, this rank's index in the reduction group, and the gradients' storage dtype.
#[derive(Clone, Copy)]
pub struct Reduction<'a> {
    /// The buckets and this rank's pieces.
    pub plan: &'a BucketPlan,
    /// The groups buckets are reduced over.
    pub groups: ReduceGroups<'a>,
    /// The device transient buffers live on.
    pub dev: Device<'a>,
    /// ZeRO stage.
    pub zero: u8,
    /// This rank's index in the reduction group (data × context parallel).
    pub dp_rank: usize,
    /// Storage dtype of the gradients.
    pub dtype: StoreDType,
}

/// The gradient sink of one micro-batch on one rank.
pub struct StepSink<'a> {
    /// Full (ZeRO-0/1) or shard (ZeRO-2/3) gradients.
    pub grads: &'a mut Grads,
    plan: &'a BucketPlan,
    groups: ReduceGroups<'a>,
    dev: Device<'a>,
    zero: u8,
    dp_rank: usize,
    reduce_now: bool,
    dtype: StoreDType,
    done: Vec<usize>,
    buckets: HashMap<usize, Grads>,
    pending: VecDeque<(usize, Handle<CommBuf>)>,
    /// Reduction timing.
    pub timing: ReductionTiming,
}

impl<'a> StepSink<'a> {
    /// A sink for one micro-batch into `grads`; `last_micro` starts ZeRO-0/1 reductions.
    pub fn new(grads: &'a mut Grads, r: Reduction<'a>, last_micro: bool) -> Self {
        StepSink {
            grads,
            plan: r.plan,
            groups: r.groups,
            dev: r.dev,
            zero: r.zero,
            dp_rank: r.dp_rank,
            reduce_now: last_micro,
            dtype: r.dtype,
            done: vec![0; r.plan.buckets.len()],
            buckets: HashMap::new(),
            pending: VecDeque::new(),
            timing: ReductionTiming::default(),
        }
    }

    /// Starts the reduction of bucket `k`; beyond [`MAX_REDUCTIONS_IN_FLIGHT`], first
    /// completes the oldest, so that the copies in flight stay bounded whatever the network.
    fn launch(&mut self, k: usize, buf: CommBuf) -> Result<(), CommError> {
        let dp = self
            .groups
            .of(self.plan, k)
            .expect("reductions are launched only with a group");
        self.timing.launched += 1;
        let handle = match self.zero {
            0 => dp.comm.all_reduce(&dp.group, buf, ReduceOp::Sum),
            _ => dp.comm.reduce_scatter(&dp.group, buf, self.plan.counts(k)),
        };
        self.pending.push_back((k, handle));
        while self.pending.len() > MAX_REDUCTIONS_IN_FLIGHT {
            let (k, handle) = self.pending.pop_front().expect("more than the cap pending");
            self.complete(k, handle, Instant::now())?;
        }
        Ok(())
    }

    /// Waits for bucket `k`'s reduction and stores its result where the optimizer reads;
    /// the part of its run before `hidden_until` counts as hidden behind compute.
    fn complete(
        &mut self,
        k: usize,
        handle: Handle<CommBuf>,
        hidden_until: Instant,
    ) -> Result<(), CommError> {
        let blocked = Instant::now();
        let (result, timing) = handle.wait_timed()?;
        if let Some(t) = self.groups.of(self.plan, k).and_then(|d| d.comm.tracer()) {
            t.record(
                Track::Wait,
                "data-parallel reduction",
                "data-parallel",
                blocked,
                Instant::now(),
                Vec::new(),
            );
        }
        if let Some(t) = timing {
            self.timing.busy += t.finished - t.started;
            self.timing.hidden += hidden_until
                .min(t.finished)
                .saturating_duration_since(t.started);
        }
        match self.zero {
            0 => {
                let r = self.plan.buckets[k].range.clone();
                write_optimizer(self.dev, self.grads, r.start, &result);
            }
            1 => {
                let member = self.plan.member(k, self.dp_rank);
                let piece = self.plan.buckets[k].pieces[member].clone();
                write_optimizer(self.dev, self.grads, piece.start, &result);
            }
            _ => self.add_piece(k, &result),
        }
        Ok(())
    }

    /// Starts every bucket's reduction now (ZeRO-0/1 under pipeline parallelism, where a
    /// rank's last backward ends the step's gradient accumulation).
    pub fn launch_all(&mut self) -> Result<(), CommError> {
        if self.zero >= 2 {
            return Ok(());
        }
        for k in 0..self.plan.buckets.len() {
            if self.groups.of(self.plan, k).is_none() {
                continue;
            }
            let range = self.plan.buckets[k].range.clone();
            let buf = match self.grads.optimizer_store() {
                OptimizerGrads::F32(g) => comm_f32(self.dev, &g[range]),
                OptimizerGrads::Bf16(g) => comm_bf16(self.dev, &g[range]),
            };
            self.launch(k, buf)?;
        }
        Ok(())
    }

    /// Waits for every launched reduction and stores its result where the optimizer reads.
    /// Call once after the micro-batch's backward.
    pub fn finish(mut self) -> Result<ReductionTiming, CommError> {
        let end_of_backward = Instant::now();
        // ZeRO-2/3 with a single rank: the bucket is this rank's piece already.
        let local: Vec<(usize, Grads)> = self.buckets.drain().collect();
        for (k, bucket) in local {
            let buf = bucket_buf(bucket);
            self.add_piece(k, &buf);
        }
        while let Some((k, handle)) = self.pending.pop_front() {
            self.complete(k, handle, end_of_backward)?;
        }
        self.timing.exposed = end_of_backward.elapsed();
        Ok(self.timing)
    }

    /// Adds this rank's reduced piece of bucket `k` into the shard gradients.
    fn add_piece(&mut self, k: usize, piece: &CommBuf) {
        let at = self.plan.pieces(self.dp_rank)[k].2;
        let values = as_f32(self.dev, piece);
        self.grads.add_reduced(self.dev, at, &values);
    }
}

/// A ZeRO-2/3 bucket's micro-batch gradient as it is reduced: in its dtype, fp16 ones through
/// their fp32 accumulation buffer (the fp16 gradient widened, exactly).
fn bucket_buf(bucket: Grads) -> CommBuf {
    match (bucket.store, bucket.accum) {
        (Store::F32(b), _) => CommBuf::F32(b),
        (Store::Bf16(b), _) => CommBuf::Bf16(b),
        (Store::F16(_), Some(acc)) => CommBuf::F32(acc),
        (Store::F16(_), None) => unreachable!("fp16 gradients always accumulate in fp32"),
    }
}

/// Writes `buf` into the optimizer's gradient buffer at flat offset `at`.
fn write_optimizer(dev: Device<'_>, grads: &mut Grads, at: usize, buf: &CommBuf) {
    let be = dev.backend;
    match (grads.optimizer_store(), buf) {
        (OptimizerGrads::F32(d), CommBuf::F32(s)) => be.copy(&mut d[at..at + s.len()], s),
        (OptimizerGrads::Bf16(d), CommBuf::Bf16(s)) => be.copy_bf16(&mut d[at..at + s.len()], s),
        (OptimizerGrads::F32(d), CommBuf::Bf16(s)) => be.widen_bf16(&mut d[at..at + s.len()], s),
        (OptimizerGrads::Bf16(d), CommBuf::F32(s)) => be.round_bf16(&mut d[at..at + s.len()], s),
    }
}

impl GradSink for StepSink<'_> {
    fn accumulate(
        &mut self,
        dev: Device<'_>,
        range: Range<usize>,
        f: &mut dyn FnMut(&mut DeviceSlice<f32>),
    ) {
        if self.zero < 2 {
            return self.grads.accumulate(dev, range, f);
        }
        let k = self
            .plan
            .buckets
            .iter()
            .position(|b| b.range.contains(&range.start))
            .expect("range inside a bucket");
        let bucket = &self.plan.buckets[k];
        let (ledger, dtype, len) = (self.dev.ledger, self.dtype, bucket.range.len());
        let start = bucket.range.start;
        let buf = self.buckets.entry(k).or_insert_with(|| {
            Grads::counted_as(ledger, Category::Communication, dtype, false, len)
        });
        buf.accumulate(dev, range.start - start..range.end - start, f);
    }

    fn unit_done(&mut self, unit: Unit) -> Result<(), HookError> {
        let k = self.plan.bucket_of(unit);
        self.done[k] += 1;
        if self.done[k] < self.plan.buckets[k].units.len() {
            return Ok(());
        }
        if self.groups.of(self.plan, k).is_none() {
            return Ok(());
        }
        if self.zero >= 2 {
            // A bucket can close without any gradient: an expert bucket whose experts got
            // no tokens in this micro-batch. It still joins the reduce-scatter, as zeros.
            let (ledger, dtype) = (self.dev.ledger, self.dtype);
            let len = self.plan.buckets[k].range.len();
            let bucket = self.buckets.remove(&k).unwrap_or_else(|| {
                Grads::counted_as(ledger, Category::Communication, dtype, false, len)
            });
            let buf = bucket_buf(bucket);
            self.launch(k, buf)?;
        } else if self.reduce_now {
            let range = self.plan.buckets[k].range.clone();
            let buf = match self.grads.optimizer_store() {
                OptimizerGrads::F32(g) => comm_f32(self.dev, &g[range]),
                OptimizerGrads::Bf16(g) => comm_bf16(self.dev, &g[range]),
            };
            self.launch(k, buf)?;
        }
        Ok(())
    }
}
