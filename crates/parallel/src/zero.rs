//! ZeRO (playbook §3): optimizer states, gradients and weights sharded over the data × context
//! parallel ranks, each rank owning its pieces of every gradient bucket
//! ([`crate::buckets::BucketPlan`]).
//!
//! - ZeRO-1/2: the optimizer steps this rank's pieces; the updated weights are all-gathered
//!   (the trainer's optimizer step). ZeRO-2 also reduce-scatters each bucket's gradients on
//!   every micro-batch into this rank's gradient shard ([`crate::data_parallel::StepSink`]).
//! - Saving: [`gather_buckets`] makes every bucket whole again from the ranks' pieces.
//! - ZeRO-3: [`Zero3Weights`] all-gathers a unit's weights before its forward and again
//!   before its backward, prefetches the next unit in the same direction, and frees gathered
//!   copies when the unit is left.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use ferrotron_comm::{CommBuf, CommError, Handle};
use ferrotron_model::{HookError, ParamLayout, Phase, Unit, WeightSource};
use ferrotron_tensor::{bf16, Buf, Category, Device, Store, View};

use crate::buckets::BucketPlan;
use crate::data_parallel::{
    comm_of_store, write_store, ReduceGroups, Reduction, MAX_REDUCTIONS_IN_FLIGHT,
};

/// ZeRO-1/2 after the optimizer step: every rank updated its `pieces` of `weights`; gather
/// the rest, bucket by bucket, with at most
/// [`MAX_REDUCTIONS_IN_FLIGHT`] gathers (a piece and its gathered bucket each) held at once.
pub fn gather_updated_weights(
    weights: &mut Store,
    plan: &BucketPlan,
    pieces: &[(usize, std::ops::Range<usize>, usize)],
    reduce: ReduceGroups<'_>,
    dev: Device<'_>,
) -> Result<(), CommError> {
    let mut in_flight = VecDeque::new();
    for (k, range, _) in pieces {
        let Some(dp) = reduce.of(plan, *k) else {
            continue;
        };
        let mine = comm_of_store(dev, weights, range.clone());
        let h = dp.comm.all_gather(&dp.group, mine, plan.counts(*k));
        in_flight.push_back((*k, dp, h));
        while in_flight.len() > MAX_REDUCTIONS_IN_FLIGHT {
            let (k, dp, h) = in_flight.pop_front().expect("more than the cap in flight");
            let full = dp.comm.wait(h, "zero all-gather")?;
            write_store(dev.backend, weights, plan.buckets[k].range.start, &full);
        }
    }
    while let Some((k, dp, h)) = in_flight.pop_front() {
        let full = dp.comm.wait(h, "zero all-gather")?;
        write_store(dev.backend, weights, plan.buckets[k].range.start, &full);
    }
    Ok(())
}

/// Every bucket whole, from every rank's pieces, e.g. to save or export the model:
/// `mine(range, at)` is this rank's piece of a bucket (its flat `range`, stored at `at` in
/// the rank's shard); where the plan shards, the pieces are all-gathered over the bucket's
/// group, else this rank's piece is the bucket. `write(start, bucket)` receives each whole
/// bucket at its flat start. Collective over the data-parallel groups when sharded.
///
/// # Errors
///
/// A failed all-gather.
pub fn gather_buckets(
    plan: &BucketPlan,
    rank: usize,
    groups: ReduceGroups<'_>,
    mine: impl Fn(&Range<usize>, usize) -> CommBuf,
    mut write: impl FnMut(usize, &CommBuf),
) -> Result<(), CommError> {
    let mut handles = Vec::new();
    for (k, range, at) in plan.pieces(rank) {
        let piece = mine(&range, at);
        match groups.of(plan, k).filter(|_| plan.sharded) {
            Some(dp) => handles.push((k, dp.comm.all_gather(&dp.group, piece, plan.counts(k)))),
            // ZeRO-0, or a group of one: this rank's piece is the whole bucket.
            None => write(range.start, &piece),
        }
    }
    for (k, h) in handles {
        write(plan.buckets[k].range.start, &h.wait()?);
    }
    Ok(())
}

enum Gathered {
    Pending(Handle<CommBuf>),
    F32(Arc<Buf<f32>>),
    Bf16(Arc<Buf<bf16>>),
}

/// ZeRO-3 weights: this rank's shard, gathered one unit at a time.
pub struct Zero3Weights<'a> {
    shard: &'a Store,
    layout: &'a ParamLayout,
    plan: &'a BucketPlan,
    groups: ReduceGroups<'a>,
    dev: Device<'a>,
    dp_rank: usize,
    units: Vec<Unit>,
    gathered: Mutex<HashMap<Unit, Gathered>>,
}

impl<'a> Zero3Weights<'a> {
    /// A source over `shard` (this rank's pieces of every unit-bucket of `r.plan`).
    pub fn new(shard: &'a Store, layout: &'a ParamLayout, r: Reduction<'a>) -> Self {
        Zero3Weights {
            shard,
            layout,
            plan: r.plan,
            groups: r.groups,
            dev: r.dev,
            dp_rank: r.dp_rank,
            units: layout.units(),
            gathered: Mutex::new(HashMap::new()),
        }
    }

    fn launch(&self, unit: Unit) -> Gathered {
        let k = self.plan.bucket_of(unit);
        let (_, piece, at) = self.plan.pieces(self.dp_rank)[k].clone();
        let mine = comm_of_store(self.dev, self.shard, at..at + piece.len());
        match self.groups.of(self.plan, k) {
            Some(dp) => Gathered::Pending(dp.comm.all_gather(&dp.group, mine, self.plan.counts(k))),
            None => ready(mine),
        }
    }

    fn ensure(&self, unit: Unit) -> Result<(), CommError> {
        let mut g = self.gathered.lock().expect("gather table lock");
        let state = match g.remove(&unit) {
            Some(Gathered::Pending(h)) => ready(self.wait(h)?),
            Some(other) => other,
            None => match self.launch(unit) {
                Gathered::Pending(h) => ready(self.wait(h)?),
                other => other,
            },
        };
        g.insert(unit, state);
        Ok(())
    }

    fn wait(&self, h: Handle<CommBuf>) -> Result<CommBuf, CommError> {
        match self.groups.dp.or(self.groups.edp) {
            Some(dp) => dp.comm.wait(h, "zero-3 gather"),
            None => h.wait(),
        }
    }

    fn prefetch(&self, unit: Unit) {
        let mut g = self.gathered.lock().expect("gather table lock");
        g.entry(unit).or_insert_with(|| self.launch(unit));
    }
}

fn ready(buf: CommBuf) -> Gathered {
    match buf {
        CommBuf::F32(b) => Gathered::F32(Arc::new(b)),
        CommBuf::Bf16(b) => Gathered::Bf16(Arc::new(b)),
    }
}

impl WeightSource for Zero3Weights<'_> {
    fn view(&self, dev: Device<'_>, range: Range<usize>) -> View<'_> {
        let unit = self.layout.unit_of(range.start);
        let base = self.layout.unit_range(unit).start;
        let local = range.start - base..range.end - base;
        let g = self.gathered.lock().expect("gather table lock");
        match g.get(&unit) {
            Some(Gathered::F32(b)) => View::Shared(b.clone(), local),
            Some(Gathered::Bf16(b)) => {
                let mut out = dev.ledger.zeros::<f32>(Category::Workspace, local.len());
                dev.backend.widen_bf16(&mut out, &b[local]);
                View::Owned(out)
            }
            _ => panic!("unit {unit:?} used before it was entered"),
        }
    }

    fn enter(&self, unit: Unit, phase: Phase) -> Result<(), HookError> {
        self.ensure(unit)?;
        let i = self
            .units
            .iter()
            .position(|u| *u == unit)
            .expect("known unit");
        let next = match phase {
            Phase::Forward => self.units.get(i + 1).copied(),
            // The embedding's backward reads no weights: nothing to prefetch below block 0.
            Phase::Backward => i
                .checked_sub(1)
                .map(|j| self.units[j])
                .filter(|u| *u != Unit::Embed),
        };
        if let Some(next) = next {
            self.prefetch(next);
        }
        Ok(())
    }

    fn leave(&self, unit: Unit, _phase: Phase) -> Result<(), HookError> {
        self.gathered
            .lock()
            .expect("gather table lock")
            .remove(&unit);
        Ok(())
    }
}
