//! DualPipeV's compute order (DeepSeek's DualPipe folded into a V; torchtitan and Megatron
//! run it under this name).
//!
//! Rank `r` of `p` holds chunk 0 (virtual stage `r`) and chunk 1 (stage `2p−1−r`), so
//! micro-batches flow down the ranks in chunk 0 and back up in chunk 1; rank `p−1` hands
//! one chunk to the other in place. Over `m ≥ 2p` micro-batches the rank runs eight phases
//! (`F0` is a forward of chunk 0, `B1` a backward of chunk 1, `W` the oldest deferred
//! weight gradient):
//!
//! 1. `2(p−r−1)` × `F0`: fill the way down.
//! 2. `r+1` × `F0 F1`.
//! 3. `p−r−1` × `B1 W F1`, the `B1` split (zero bubble) and its `W` run at once.
//! 4. `m−2p+r+1` × `F0 B1 F1 B0`: the steady state, each forward paired with a backward of
//!    the other chunk (DeepSeek overlaps the pair's compute with its communication; here they
//!    run back to back and the pair's messages travel while the next action computes).
//! 5. `p−r−1` × `B1 F1 B0`.
//! 6. `r+1` × `B1 B0`, the second half split into `B` and deferred `W`.
//! 7. `p−r−1` × `W B0`, the `B0` split.
//! 8. `r+1` × `W`: the deferred weight gradients fill the drain.
//!
//! Each chunk's forwards and backwards take their micro-batches in ascending order, and the
//! weight gradients leave the FIFO in that order too: a full backward only runs while no
//! `W` is waiting, so every chunk's gradients accumulate in the single rank's order.

use std::collections::VecDeque;

use crate::Action;

/// Next micro-batch of each (kind, chunk) and the deferred weight gradients.
struct Order {
    out: Vec<Action>,
    fwd: [usize; 2],
    bwd: [usize; 2],
    deferred: VecDeque<(usize, usize)>,
}

impl Order {
    fn f(&mut self, chunk: usize) {
        let mb = self.fwd[chunk];
        self.fwd[chunk] += 1;
        self.out.push(Action::Forward { mb, chunk });
    }

    /// A backward of `chunk`: whole, or (`split`) its input half with the weight half queued.
    fn b(&mut self, chunk: usize, split: bool) {
        let mb = self.bwd[chunk];
        self.bwd[chunk] += 1;
        if split {
            self.out.push(Action::BackwardInput { mb, chunk });
            self.deferred.push_back((mb, chunk));
        } else {
            debug_assert!(self.deferred.is_empty(), "W waits behind a full backward");
            self.out.push(Action::Backward { mb, chunk });
        }
    }

    fn w(&mut self) {
        let (mb, chunk) = self.deferred.pop_front().expect("every W follows its B");
        self.out.push(Action::BackwardWeight { mb, chunk });
    }
}

/// The compute actions of rank `rank` of `p` over `m ≥ 2p` micro-batches.
pub(crate) fn compute(p: usize, m: usize, rank: usize) -> Vec<Action> {
    let mut o = Order {
        out: Vec::with_capacity(6 * m),
        fwd: [0; 2],
        bwd: [0; 2],
        deferred: VecDeque::new(),
    };
    let (down, up) = (p - rank - 1, rank + 1);
    for _ in 0..2 * down {
        o.f(0);
    }
    for _ in 0..up {
        o.f(0);
        o.f(1);
    }
    for _ in 0..down {
        o.b(1, true);
        o.w();
        o.f(1);
    }
    for _ in 0..(m + up) - 2 * p {
        o.f(0);
        o.b(1, false);
        o.f(1);
        o.b(0, false);
    }
    for _ in 0..down {
        o.b(1, false);
        o.f(1);
        o.b(0, false);
    }
    // The second half of these backwards is split; odd ranks switch one backward earlier.
    let half = up / 2;
    for i in 0..up {
        o.b(1, i > half || (i == half && rank % 2 == 1));
        o.b(0, i >= half);
    }
    for _ in 0..down {
        o.w();
        o.b(0, true);
    }
    for _ in 0..up {
        o.w();
    }
    debug_assert!(o.deferred.is_empty());
    o.out
}
