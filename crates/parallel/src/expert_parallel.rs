//! Expert parallelism (playbook §4): the expert-parallel group as the model's
//! [`ExpertParallel`] strategy. Its `ep` ranks each hold `E/ep` consecutive experts; a
//! mixture-of-experts block sends each routed token row to the rank holding its expert and
//! the expert's output back, by two all-to-alls per direction (the per-expert counts, then
//! the rows with those uneven counts). The routing tables and the regrouping of arrived rows
//! by expert are the model's (`ferrotron_model::moe::Exchange`); the transport is here.

use ferrotron_comm::{Comm, CommBuf, Group};
use ferrotron_model::strategy::ExpertParallel;
use ferrotron_model::HookError;
use ferrotron_tensor::trace::Tracer;
use ferrotron_tensor::{Buf, Device, DeviceSlice};

/// This rank's expert-parallel group.
pub struct EpComm<'a> {
    /// The communicator.
    pub comm: &'a Comm,
    /// The expert-parallel group; member `j` holds experts `[j·E/ep, (j+1)·E/ep)`.
    pub group: &'a Group,
    /// Where waits are recorded (None: not tracing).
    pub trace: Option<&'a Tracer>,
}

impl ExpertParallel for EpComm<'_> {
    fn size(&self) -> usize {
        self.group.size()
    }

    fn all_to_all(
        &self,
        dev: Device<'_>,
        data: &DeviceSlice<f32>,
        send: Vec<usize>,
        recv: Vec<usize>,
    ) -> Result<Buf<f32>, HookError> {
        let input = CommBuf::copy_of(dev, data);
        let out = self
            .comm
            .all_to_all(self.group, input, send, recv)
            .wait_in(self.trace, "expert-parallel")?;
        Ok(out
            .into_f32()
            .unwrap_or_else(|_| unreachable!("f32 collectives return f32")))
    }
}
