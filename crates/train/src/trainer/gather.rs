//! Gathering a rank's shards back into whole-model values: ZeRO shards over data
//! parallelism, experts over expert parallelism, tensor-parallel slices, pipeline stages.
//! Collective: every rank calls these.

use std::collections::HashMap;

use ferrotron_comm::GroupKind;
use ferrotron_model::{ParamLayout, Shard};
use ferrotron_tensor::{Category, Store};

use super::Trainer;
use crate::optim::{full_master, full_weights, CHECKPOINT};
use crate::state::store_dtype;
use crate::TrainError;
use ferrotron_parallel::pipeline::stage_parts;

impl Trainer {
    /// Every parameter's full fp32 value (the master weights), gathered from all shards.
    /// Collective: every data-parallel rank must call it.
    pub fn full_params(&self) -> Result<Vec<f32>, TrainError> {
        let local = self.local_params()?;
        self.gather_tensor_parallel(local)
    }

    /// This rank's parameters (fp32 master), in its own layout ([`Trainer::model`]'s): its
    /// pipeline stage, tensor-parallel slices (a padded vocabulary's rows included) and
    /// experts, gathered over ZeRO. Collective over the data-parallel group.
    pub fn local_params(&self) -> Result<Vec<f32>, TrainError> {
        let dev = self.device.dev();
        Ok(self
            .device
            .pool
            .install(|| full_master(&self.state, self.reduce_groups(), dev))?)
    }

    /// The full-model gradients of the step computed so far (before the optimizer step),
    /// gathered over tensor parallelism. Collective over the tensor-parallel group. Only
    /// without ZeRO over more than one rank: ZeRO-1 reduces each rank's shard only (the rest
    /// of its buffer holds its own micro-batches' gradients), ZeRO-2/3 keep only the shard.
    pub fn full_grads(&self) -> Result<Vec<f32>, TrainError> {
        if self.state.zero >= 1 && self.mesh.link(GroupKind::DpCp).is_some() {
            return Err(TrainError::Layout(format!(
                "full_grads reads whole reduced gradients, which ZeRO-{} over several \
                 data-parallel ranks does not keep: use parallel.zero = 0",
                self.state.zero
            )));
        }
        let local = self.local_grads();
        self.gather_tensor_parallel(local)
    }

    /// This rank's gradients of the step computed so far, in its own layout (see
    /// [`Trainer::local_params`]; under ZeRO only its shard is reduced).
    pub fn local_grads(&self) -> Vec<f32> {
        let dev = self.device.dev();
        dev.ledger.download(
            CHECKPOINT,
            &self
                .state
                .grads
                .optimizer_view(dev, 0..self.model.layout.total),
        )
    }

    /// Every expert of this stage's tensor-parallel slice from every expert-parallel
    /// member's local values, laid out as with one expert-parallel rank.
    fn gather_experts(&self, local: Vec<f32>) -> Result<Vec<f32>, TrainError> {
        let Some(ep) = self.mesh.link(GroupKind::Ep) else {
            return Ok(local);
        };
        let cfg = &self.config;
        let lay = &self.model.layout;
        let parts = stage_parts(cfg, self.pipeline.as_ref().map(|p| p.rank).unwrap_or(0));
        let (n, members) = (local.len(), ep.group.size());
        let all = self.all_gather_host(ep, &local, vec![n; members])?;
        let whole = ParamLayout::stage(&cfg.model, lay.tp, lay.tp_rank, &parts);
        let index: HashMap<&str, usize> = whole
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.as_str(), i))
            .collect();
        let mut out = vec![0.0f32; whole.total];
        for r in 0..members {
            let shard = Shard {
                tp: lay.tp,
                tp_rank: lay.tp_rank,
                ep: members,
                ep_rank: r,
            };
            for spec in &ParamLayout::sharded(&cfg.model, shard, &parts).params {
                let target = &whole.params[index[spec.name.as_str()]];
                let from = r * n + spec.offset;
                out[target.range()].copy_from_slice(&all[from..from + spec.numel()]);
            }
        }
        Ok(out)
    }

    /// Reassembles full-model values from every rank's local values: experts over expert
    /// parallelism and tensor-parallel slices into this stage's parameters, then every
    /// pipeline stage's parameters by name.
    fn gather_tensor_parallel(&self, local: Vec<f32>) -> Result<Vec<f32>, TrainError> {
        let local = self.gather_experts(local)?;
        let cfg = &self.config;
        let pp_rank = self.pipeline.as_ref().map(|p| p.rank).unwrap_or(0);
        let stage_layout = |s: usize| ParamLayout::stage(&cfg.model, 1, 0, &stage_parts(cfg, s));
        let stage_full = match self.mesh.link(GroupKind::Tp) {
            None => local,
            Some(tp) => {
                let t = tp.group.size();
                let n = local.len();
                let gathered = self.all_gather_host(tp, &local, vec![n; t])?;
                let full = stage_layout(pp_rank);
                let mine =
                    ParamLayout::stage(&cfg.model, t, tp.group.index, &stage_parts(cfg, pp_rank));
                let mut out = vec![0.0f32; full.total];
                for r in 0..t {
                    let part = &gathered[r * n..(r + 1) * n];
                    for (spec, full_spec) in mine.params.iter().zip(&full.params) {
                        ParamLayout::place_slice(
                            spec,
                            t,
                            r,
                            &part[spec.range()],
                            &mut out[full_spec.range()],
                        );
                    }
                }
                out
            }
        };
        let Some(pp) = self.pipeline.as_ref().and_then(|p| p.group.as_ref()) else {
            return Ok(stage_full);
        };
        let layouts: Vec<ParamLayout> = (0..pp.group.size()).map(stage_layout).collect();
        let counts = layouts.iter().map(|l| l.total).collect();
        let all = self.all_gather_host(pp, &stage_full, counts)?;
        let full_layout = ParamLayout::new(&cfg.model);
        let mut out = vec![0.0f32; full_layout.total];
        let mut at = 0;
        for layout in &layouts {
            for spec in &layout.params {
                let target = full_layout
                    .find(&spec.name)
                    .expect("stage parameters exist in the full model");
                out[target.range()]
                    .copy_from_slice(&all[at + spec.offset..at + spec.offset + spec.numel()]);
            }
            at += layout.total;
        }
        Ok(out)
    }

    /// The whole model (every tensor-parallel slice, every ZeRO shard) in its storage dtype,
    /// with the full layout, e.g. to save it. Collective: every rank must call it.
    pub fn gather_model(&self) -> Result<(ParamLayout, Store), TrainError> {
        if self.mesh.link(GroupKind::Tp).is_none()
            && self.pipeline.is_none()
            && self.mesh.link(GroupKind::Ep).is_none()
        {
            return Ok((self.model.layout.clone(), self.full_weight_store()?));
        }
        let full = self.full_params()?;
        let layout = ParamLayout::new(&self.config.model);
        let dtype = store_dtype(self.config.train.dtype);
        // The stored weights are the master rounded once, so rounding the gathered master
        // reproduces them exactly.
        let dev = self.device.dev();
        let store = Store::keep(
            dev,
            Category::Workspace,
            dtype,
            dev.ledger.upload(Category::Workspace, CHECKPOINT, &full),
        );
        Ok((layout, store))
    }

    /// The full weights in their storage dtype (gathered under ZeRO-3). Collective.
    pub fn full_weight_store(&self) -> Result<Store, TrainError> {
        Ok(full_weights(
            &self.state,
            self.reduce_groups(),
            self.device.dev(),
        )?)
    }

    /// Host values of every member of `g` concatenated (`counts` elements each): to the
    /// device, all-gathered, back to the host (transfers counted as [`CHECKPOINT`]).
    fn all_gather_host(
        &self,
        g: &ferrotron_parallel::GroupComm,
        local: &[f32],
        counts: Vec<usize>,
    ) -> Result<Vec<f32>, TrainError> {
        let ledger = &self.device.ledger;
        let mine = ledger.upload(Category::Communication, CHECKPOINT, local);
        let all = g
            .comm
            .all_gather(&g.group, ferrotron_comm::CommBuf::F32(mine), counts)
            .wait()?
            .into_f32()
            .unwrap_or_else(|_| unreachable!("f32 gathers return f32"));
        Ok(ledger.download(CHECKPOINT, &all))
    }
}
