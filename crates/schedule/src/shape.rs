//! The shapes a schedule can have: the up-front checks of [`crate::schedule`] and
//! [`crate::Schedule::from_actions`].

use crate::kind::MAX_UNITS;
use crate::{ScheduleError, ScheduleKind};

/// The up-front validation of [`crate::schedule`], shared with
/// [`crate::Schedule::from_actions`].
pub(crate) fn check_shape(
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
) -> Result<(), ScheduleError> {
    if p == 0 {
        return Err(ScheduleError::ZeroStages);
    }
    if m == 0 {
        return Err(ScheduleError::ZeroMicroBatches);
    }
    if v == 0 {
        return Err(ScheduleError::ZeroVirtualStages);
    }
    let units = p.checked_mul(m).and_then(|pm| pm.checked_mul(v));
    if units.is_none_or(|u| u > MAX_UNITS) {
        return Err(ScheduleError::TooLarge { p, m, v });
    }
    match kind {
        ScheduleKind::Interleaved if v == 1 => Err(ScheduleError::InterleavedNeedsChunks),
        ScheduleKind::Interleaved if !m.is_multiple_of(p) => {
            Err(ScheduleError::MicroBatchesNotDivisible { m, p })
        }
        ScheduleKind::Interleaved => Ok(()),
        ScheduleKind::DualPipeV if v != 2 => Err(ScheduleError::DualPipeVChunks { v }),
        ScheduleKind::DualPipeV if m < 2 * p => Err(ScheduleError::DualPipeVMicroBatches { m, p }),
        ScheduleKind::DualPipeV => Ok(()),
        _ if v > 1 => Err(ScheduleError::ChunksNeedInterleaved { kind, v }),
        _ => Ok(()),
    }
}
