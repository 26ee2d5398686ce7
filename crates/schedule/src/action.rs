//! One step of a rank's pipeline program.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::Placement;

/// One action of a rank's ordered program.
///
/// `mb` is the micro-batch (`0..m`); `chunk` is the model chunk on *this* rank (`0..v`, 0
/// with one chunk per rank), which is a global virtual stage by the schedule's
/// [`crate::Placement`]: `chunk·p + rank`, or DualPipeV's V. Stage fields (`to_stage`,
/// `from_stage`) are pipeline ranks. A send or receive carries the chunk of its own rank: the
/// chunk whose forward produced (or whose forward will consume) the activation, and the chunk
/// whose backward produced (or will consume) the gradient. The two ends of a message
/// therefore carry the same `chunk`, except where interleaving wraps from rank `p−1` to rank
/// 0 (activations) or back (gradients): there the rank-0 end is one chunk higher.
/// [`Action::edge`] names the boundary both ends share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Action {
    /// Run the chunk's forward on the micro-batch and keep what backward needs.
    Forward {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank.
        chunk: usize,
    },
    /// Run the full backward (input and weight gradients) and free the activations.
    Backward {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank.
        chunk: usize,
    },
    /// Zero bubble's `B`: the input gradient only (on the critical path); the saved inputs
    /// stay alive for `BackwardWeight`.
    BackwardInput {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank.
        chunk: usize,
    },
    /// Zero bubble's `W`: the weight gradient, then free the activations.
    BackwardWeight {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank.
        chunk: usize,
    },
    /// Post the forward output of `(mb, chunk)` to the next virtual stage's rank.
    SendActivation {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank that produced it.
        chunk: usize,
        /// Receiving pipeline rank.
        to_stage: usize,
    },
    /// Receive the input of `(mb, chunk)` from the previous virtual stage's rank (blocking).
    RecvActivation {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank that will consume it.
        chunk: usize,
        /// Sending pipeline rank.
        from_stage: usize,
    },
    /// Post the input gradient of `(mb, chunk)` to the previous virtual stage's rank.
    SendGrad {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank that produced it.
        chunk: usize,
        /// Receiving pipeline rank.
        to_stage: usize,
    },
    /// Receive the output gradient of `(mb, chunk)` from the next virtual stage's rank
    /// (blocking).
    RecvGrad {
        /// Micro-batch.
        mb: usize,
        /// Model chunk on this rank that will consume it.
        chunk: usize,
        /// Sending pipeline rank.
        from_stage: usize,
    },
}

/// Which way a message flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Flow {
    /// Activations, from virtual stage `edge` to `edge + 1`.
    Activation,
    /// Gradients, from virtual stage `edge + 1` to `edge`.
    Grad,
}

impl Action {
    /// The micro-batch this action concerns.
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. }
            | Action::SendActivation { mb, .. }
            | Action::RecvActivation { mb, .. }
            | Action::SendGrad { mb, .. }
            | Action::RecvGrad { mb, .. } => mb,
        }
    }

    /// The model chunk on this action's rank.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. }
            | Action::SendActivation { chunk, .. }
            | Action::RecvActivation { chunk, .. }
            | Action::SendGrad { chunk, .. }
            | Action::RecvGrad { chunk, .. } => chunk,
        }
    }

    /// Whether this is computation (forward or a backward part) rather than communication.
    pub fn is_compute(&self) -> bool {
        matches!(
            self,
            Action::Forward { .. }
                | Action::Backward { .. }
                | Action::BackwardInput { .. }
                | Action::BackwardWeight { .. }
        )
    }

    /// The peer rank of a send or receive, `None` for computation.
    pub fn peer(&self) -> Option<usize> {
        match *self {
            Action::SendActivation { to_stage, .. } | Action::SendGrad { to_stage, .. } => {
                Some(to_stage)
            }
            Action::RecvActivation { from_stage, .. } | Action::RecvGrad { from_stage, .. } => {
                Some(from_stage)
            }
            _ => None,
        }
    }

    /// For a send or receive on `rank` of a `p`-stage pipeline laid out by `placement`: the
    /// flow and the boundary it crosses, named by the lower global virtual stage `e` of the
    /// pair `(e, e + 1)`. Both ends of one message give the same `(flow, edge)`. `None` for
    /// computation, and for a boundary that would fall outside the model (virtual stage 0 has
    /// no predecessor).
    pub fn edge(&self, rank: usize, p: usize, placement: Placement) -> Option<(Flow, usize)> {
        let vs = placement.stage(p, rank, self.chunk());
        match self {
            Action::SendActivation { .. } => Some((Flow::Activation, vs)),
            Action::RecvActivation { .. } => vs.checked_sub(1).map(|e| (Flow::Activation, e)),
            Action::SendGrad { .. } => vs.checked_sub(1).map(|e| (Flow::Grad, e)),
            Action::RecvGrad { .. } => Some((Flow::Grad, vs)),
            _ => None,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Action::Forward { mb, chunk } => write!(f, "Forward(mb={mb}, chunk={chunk})"),
            Action::Backward { mb, chunk } => write!(f, "Backward(mb={mb}, chunk={chunk})"),
            Action::BackwardInput { mb, chunk } => {
                write!(f, "BackwardInput(mb={mb}, chunk={chunk})")
            }
            Action::BackwardWeight { mb, chunk } => {
                write!(f, "BackwardWeight(mb={mb}, chunk={chunk})")
            }
            Action::SendActivation {
                mb,
                chunk,
                to_stage,
            } => {
                write!(f, "SendActivation(mb={mb}, chunk={chunk}, to={to_stage})")
            }
            Action::RecvActivation {
                mb,
                chunk,
                from_stage,
            } => {
                write!(
                    f,
                    "RecvActivation(mb={mb}, chunk={chunk}, from={from_stage})"
                )
            }
            Action::SendGrad {
                mb,
                chunk,
                to_stage,
            } => {
                write!(f, "SendGrad(mb={mb}, chunk={chunk}, to={to_stage})")
            }
            Action::RecvGrad {
                mb,
                chunk,
                from_stage,
            } => {
                write!(f, "RecvGrad(mb={mb}, chunk={chunk}, from={from_stage})")
            }
        }
    }
}
