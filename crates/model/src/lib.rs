//! The Llama model: its parameters as named views of one flat buffer, initialisation that is
//! independent of any parallel layout, and forward and backward written out per layer.
//!
//! - [`layout`]: every parameter's Hugging Face name, shape and offset in the flat buffer.
//! - [`init`]: each full parameter drawn from a seed derived from (seed, name).
//! - [`access`]: how the model reaches weights and delivers gradients (the hooks DP and ZeRO use).
//! - [`grads`]: where backward writes weight gradients (f32, bf16, bf16 + fp32 accumulation).
//! - [`llama`]: the model on one rank, the embedding and the final norm fused with head+loss.
//! - [`block`]: one transformer block, forward and backward; [`passes`]: a micro-batch's
//!   whole forward and backward and runs of blocks (a pipeline chunk).
//! - [`strategy`]: where parallelism enters the model — tensor + sequence, context and expert
//!   parallelism as traits the model calls (implemented in `crates/parallel`); the model
//!   names no communicator, group or rank.
//! - [`tp`]: Megatron's conjugate operators `f`, `f̄`, `g`, `ḡ` over the tensor-parallel strategy.
//! - [`recompute`]: activation recomputation, what a block keeps and how backward restores the rest.
//! - [`decode`]: inference through the model and the backend, with a key/value cache on the
//!   device (`generate`).
//! - [`documents`]: document masking, packed documents that attend only within themselves.
//! - [`moe`]: mixture-of-experts blocks, their load-balancing loss and the routing tables of
//!   expert parallelism.

#![warn(missing_docs)]

pub mod access;
mod attention;
pub mod block;
mod ctx;
pub mod decode;
pub mod documents;
mod fp8;
mod fp8_history;
pub mod grads;
pub mod init;
pub mod layout;
pub mod llama;
pub mod moe;
pub mod passes;
pub mod recompute;
pub mod strategy;
pub mod tp;

pub use access::{GradSink, HookError, Phase, Unit, WeightSource};
pub use block::DeferredGrad;
pub use ctx::{ROUTING, TOKEN_IDS};
pub use documents::Documents;
pub use fp8::Fp8Layer;
pub use fp8_history::{Fp8History, Role as Fp8Role};
pub use grads::{Grads, OptimizerGrads};
pub use init::{init_params, init_range};
pub use layout::{LayerParams, Mlp, MoeParams, ParamLayout, ParamSpec, Shard, Split, StageParts};
pub use llama::{Llama, LossTargets, StepCtx};
pub use moe::{MoeReport, MoeStep};
pub use passes::BlockRun;
pub use recompute::BlockActs;
pub use strategy::{ContextParallel, ExpertParallel, TensorParallel};
