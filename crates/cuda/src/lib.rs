//! The CUDA backend's kernels: every kernel of a training step that is not a GEMM, written in
//! CUDA C (`kernels/*.cu`, each compiled with `kernels/prelude.cuh` in front of it) and
//! compiled at start-up with NVRTC for the GPU at hand. GEMMs go to cuBLASLt.
//!
//! Each source mirrors a CPU kernel of `ferrotron-tensor` (named in its header) with the same
//! layouts, so that the GPU check can compare them on random inputs:
//!
//! | source | kernels | CPU reference |
//! |---|---|---|
//! | `elementwise.cu` | copies, fills, sums, scaling, f32↔bf16 and f32↔f16 casts, biases, SwiGLU | `elementwise.rs`, `store.rs`, `linear.rs`, `swiglu.rs` |
//! | `norms.cu` | RMSNorm forward/backward/apply, RoPE, embedding (whole or a vocabulary slice) | `rmsnorm.rs`, `rope.rs`, `embedding.rs` |
//! | `optim.cu` | AdamW, Muon's momentum, the clipping's squared norm (f64) | `adamw.rs`, `muon.rs` |
//! | `xent.cu` | chunked cross-entropy, the vocabulary-parallel pieces | `xent.rs` |
//! | `moe.cu` | gather, scatter-add, combine forward/backward | `moe/dispatch.rs` |
//! | `scores.cu` | the row kernels of attention as batched products: causal softmax with its log-sum-exp, the probabilities again, their gradient | `score_attention.rs` (its tests) |
//! | `attention.cu` | attention blocks with global positions (flash and ring): tiled in shared memory for head_dim ≤ 64, one warp per row past it; merge, delta, backward | `ring_attention.rs` |
//!
//! Without the `cuda` feature this crate is the sources and their index. With it:
//! `nvrtc::compile` turns a source into PTX, `Gpu` opens a device and loads every kernel
//! compiled for it, and `CudaBackend` is one rank's [`Backend`](ferrotron_tensor::Backend)
//! on it: its stream, its caching allocator of managed memory (`memory`), cuBLASLt GEMMs
//! (`blas`) and the kernel launches.

#![warn(missing_docs)]

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
pub mod backend;
#[cfg(feature = "cuda")]
pub mod blas;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
pub mod launch;
#[cfg(feature = "cuda")]
pub mod memory;
#[cfg(feature = "cuda")]
pub mod nvrtc;
pub mod score_attention;
#[cfg(feature = "cuda")]
mod scores;
#[cfg(feature = "cuda")]
mod xent;

#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, CudaOptions};
#[cfg(feature = "cuda")]
pub use gpu::{Gpu, GpuError};

/// What every source is compiled with in front of it: bf16 conversion, reductions, loops.
pub const PRELUDE: &str = include_str!("../kernels/prelude.cuh");

/// One kernel source and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// File name without `.cu`.
    pub name: &'static str,
    /// The CUDA C text.
    pub text: &'static str,
    /// Its `extern "C" __global__` functions.
    pub kernels: &'static [&'static str],
}

impl Source {
    /// The program NVRTC compiles: [`PRELUDE`] then the source.
    pub fn program(&self) -> String {
        format!("{PRELUDE}\n{}", self.text)
    }
}

/// Every kernel source of the backend.
pub const SOURCES: [Source; 7] = [
    Source {
        name: "elementwise",
        text: include_str!("../kernels/elementwise.cu"),
        kernels: &[
            "copy_f32",
            "copy_bf16",
            "fill_f32",
            "fill_bf16",
            "add_f32",
            "bias_forward_f32",
            "bias_backward_f32",
            "add_assign_f32",
            "add_assign_bf16",
            "scale_f32",
            "round_bf16",
            "widen_bf16",
            "fill_f16",
            "add_assign_f16",
            "round_f16",
            "widen_f16",
            "swiglu_forward",
            "swiglu_backward",
            "fp8_amax",
            "fp8_apply",
        ],
    },
    Source {
        name: "norms",
        text: include_str!("../kernels/norms.cu"),
        kernels: &[
            "rmsnorm_forward",
            "rmsnorm_apply",
            "rmsnorm_backward_input",
            "rmsnorm_backward_weight",
            "rope",
            "embedding_forward",
            "embedding_backward",
        ],
    },
    Source {
        name: "optim",
        text: include_str!("../kernels/optim.cu"),
        kernels: &[
            "adamw",
            "muon_momentum",
            "sum_squares_partial",
            "sum_squares_partial_bf16",
            "sum_f64",
        ],
    },
    Source {
        name: "xent",
        text: include_str!("../kernels/xent.cu"),
        kernels: &[
            "softmax_xent",
            "logits_row_max",
            "max_over_ranks",
            "logits_exp_stats",
            "vocab_lse",
            "vocab_softmax_grad",
        ],
    },
    Source {
        name: "moe",
        text: include_str!("../kernels/moe.cu"),
        kernels: &[
            "moe_gather_rows",
            "moe_scatter_add_rows",
            "moe_combine_forward",
            "moe_combine_backward",
        ],
    },
    Source {
        name: "scores",
        text: include_str!("../kernels/scores.cu"),
        kernels: &["scores_softmax", "scores_probs", "scores_grad"],
    },
    Source {
        name: "attention",
        text: include_str!("../kernels/attention.cu"),
        kernels: &[
            "attention_block_forward",
            "attention_merge",
            "attention_merge_lse",
            "attention_delta",
            "attention_block_backward_q",
            "attention_block_backward_kv",
            "attention_tile_forward",
            "attention_tile_backward_q",
            "attention_tile_backward_kv",
        ],
    },
];

/// The GPU architectures the kernels are compiled and checked for (A100, H100/H200).
pub const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// The `extern "C" __global__` functions a CUDA source defines, in order.
pub fn defined_kernels(text: &str) -> Vec<&str> {
    text.split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(str::trim)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_a_source_defines_is_indexed_and_only_those() {
        let mut total = 0;
        for s in SOURCES {
            assert_eq!(defined_kernels(s.text), s.kernels, "{}.cu", s.name);
            assert!(s.program().starts_with(PRELUDE));
            total += s.kernels.len();
        }
        assert_eq!(total, 54);
        assert_eq!(
            defined_kernels(
                "extern \"C\" __global__ void a(int x) {}\nextern \"C\" __global__ void b() {}"
            ),
            ["a", "b"]
        );
    }
}
