//! The host matmul's packing scratch, which the engine counts and the estimator predicts
//! from this one place.
//!
//! For each product `[m×k]·[k×n]`, `gemm` 0.19 may allocate packed copies of its operands
//! for the duration of the call: at most `kc × n` and `kc × m` elements, each side rounded up
//! to its register tile (at most 64), where `kc` is the depth `k` cut into equal blocks of at
//! most [`GEMM_DEPTH_BLOCK`]. One step's largest such product (on medium: the LM head's
//! weight gradient, `kc` = 256 tokens × 32,000 vocabulary rows, 31 MiB) is counted as
//! workspace for the whole run on the CPU. Measured against the allocations `gemm` makes:
//! `crates/tensor/tests/gemm_scratch.rs`.

use crate::{Matmul, ModelConfig, ParallelConfig};

/// The largest side of one call into OpenBLAS (`train.matmul = "openblas"`): the engine cuts
/// every product into blocks of at most this many rows, columns and depth.
pub const BLAS_BLOCK: usize = 1024;

/// Bytes OpenBLAS may keep touched in one calling thread's packing buffer, which it holds for
/// the life of the process: a packed block of each operand, at most `BLAS_BLOCK` deep and
/// `BLAS_BLOCK` wide, each side rounded up to its register tile (at most 64), plus the
/// buffer's offsets and page rounding (64 KiB).
pub const BLAS_SCRATCH_PER_THREAD: u64 =
    (2 * BLAS_BLOCK * (BLAS_BLOCK + MR_MAX) * 4 + 64 * 1024) as u64;

/// Depth (elements of `k`) of one block the bf16 products (`train.matmul = "bf16"`) pack.
pub const BF16_GEMM_DEPTH: usize = 512;
/// Columns of the right operand the bf16 products pack at once (a multiple of their
/// 48-column register tile).
pub const BF16_GEMM_COLS: usize = 1536;
/// The most rows of the left operand one task of the bf16 products packs at once.
pub const BF16_GEMM_ROWS: usize = 64;
/// Bytes of the bf16 products' packed right-operand block, one per call (4 bytes per pair of
/// bf16).
pub const BF16_GEMM_SHARED_BYTES: u64 = (BF16_GEMM_DEPTH / 2 * BF16_GEMM_COLS * 4) as u64;
/// Bytes of the bf16 products' packed left-operand block, one per compute thread.
pub const BF16_GEMM_PER_THREAD_BYTES: u64 = (BF16_GEMM_ROWS * BF16_GEMM_DEPTH / 2 * 4) as u64;

/// The host kernels' scratch for one rank of `threads` compute threads, counted as workspace
/// for the whole run: the matmul library's (`gemm`'s largest packing of a step,
/// [`step_gemm_pack_bytes`], OpenBLAS's buffer per thread, or the bf16 products' blocks) and
/// the attention tiles' per thread ([`attention_scratch_per_thread`]).
pub fn step_matmul_scratch_bytes(
    matmul: Matmul,
    threads: usize,
    model: &ModelConfig,
    parallel: &ParallelConfig,
    (micro_batch, loss_chunk): (usize, usize),
) -> u64 {
    let attention = threads.max(1) as u64 * attention_scratch_per_thread(model);
    attention
        + match matmul {
            Matmul::Gemm => step_gemm_pack_bytes(model, parallel, micro_batch, loss_chunk),
            Matmul::OpenBlas => threads.max(1) as u64 * BLAS_SCRATCH_PER_THREAD,
            Matmul::Bf16 => {
                BF16_GEMM_SHARED_BYTES + threads.max(1) as u64 * BF16_GEMM_PER_THREAD_BYTES
            }
        }
}

/// Query rows of one attention tile.
pub const ATTENTION_TILE_ROWS: usize = 32;
/// Keys of one attention chunk: the widest score tile.
pub const ATTENTION_TILE_KEYS: usize = 128;

/// The leading dimension of a head the attention tiles lay out with `cols` columns: 16 past a
/// multiple of 16, and 16 more where that is a power of two (rows 2ⁿ floats apart share a
/// few L1 sets).
pub fn attention_head_ld(cols: usize) -> usize {
    let ld = cols.next_multiple_of(16) + 16;
    if ld.is_power_of_two() {
        ld + 16
    } else {
        ld
    }
}

/// Bytes one compute thread holds while it runs the attention tiles (at most `seq_len` query
/// and key rows per block): the backward's `Kᵀ` and `Vᵀ` (head dimension × keys), `K`, a
/// query head's `Q` and `dO` (rows × head dimension), and two score tiles; the forward holds
/// less (`Kᵀ`, `V`, one score tile and one tile of output rows).
pub fn attention_scratch_per_thread(model: &ModelConfig) -> u64 {
    let (s, d) = (model.seq_len, model.head_dim());
    let transposed = 2 * d * attention_head_ld(s);
    let rows = 3 * s * attention_head_ld(d);
    let tiles = 2 * ATTENTION_TILE_ROWS * ATTENTION_TILE_KEYS;
    (4 * (transposed + rows + tiles)) as u64
}

/// The largest depth block `gemm` packs on x86 (its `kc`, or `k` when smaller): 512 with
/// its AVX-512 kernels, up to 1,024 with its AVX2 kernels on a 12- or 16-way L1 cache; the
/// bound takes the larger.
pub const GEMM_DEPTH_BLOCK: usize = 1024;

/// The smallest register-tile height (`MR`) of `gemm`'s f32 kernels on x86 (SSE); AVX2 and
/// AVX-512 use taller tiles, so they pack in fewer cases than the bound assumes.
const MR_MIN: usize = 8;
/// The tallest register tile (rows of the left operand's micro-panel) of any `gemm` kernel.
const MR_MAX: usize = 64;

/// The three products of a linear layer `y[t×out] = x[t×in]·Wᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearProduct {
    /// `y = x·Wᵀ`.
    Forward,
    /// `dx = dy·W`.
    BackwardInput,
    /// `dW += dyᵀ·x`.
    BackwardWeight,
}

/// `kc`: `k` cut into equal blocks of at most [`GEMM_DEPTH_BLOCK`].
fn depth_block(k: usize) -> usize {
    k.div_ceil(k.div_ceil(GEMM_DEPTH_BLOCK))
}

/// Tokens a forward product needs before copying its weight transposed pays
/// ([`forward_transposes_weight`]): the copy costs about one pass over the weight, the
/// product `2·t` flops per weight element, of which the copy saves 10–25%.
pub const TRANSPOSED_FORWARD_MIN_TOKENS: usize = 512;

/// Whether the forward product of a linear layer over `t` tokens (`y = x·Wᵀ`, `W` as
/// `[out, in]`) reads its weight from a transposed copy (`[in, out]`) made for the call:
/// where `gemm` would otherwise pack the strided weight ahead of its threads (`out ≤
/// 16·MR`), and the product has [`TRANSPOSED_FORWARD_MIN_TOKENS`] tokens to repay the copy.
/// Measured on small's and medium's shapes (1,024 tokens, 2 threads): 1.1–1.3× the product
/// as stored, the copy included.
pub fn forward_transposes_weight(t: usize, d_in: usize, d_out: usize) -> bool {
    t >= TRANSPOSED_FORWARD_MIN_TOKENS && d_in > 0 && d_out <= 16 * MR_MAX
}

/// Bytes `gemm` may allocate for one product of a linear layer of `t` tokens (an upper
/// bound), and for a forward product that reads its weight transposed
/// ([`forward_transposes_weight`]) the copy too. The engine's matrices are row-major, so
/// `gemm` computes the transposed product: its `m` is the output's columns, its right
/// operand the output's rows. It packs that right operand (`kc` × its rows, tile-rounded)
/// when its rows are strided and `m > 2·MR`, or when they are contiguous and `m > 128·MR`;
/// and it packs the left operand ahead (`kc × m`) when `m` fits two row blocks (≤ 16·MR)
/// and is strided or not a multiple of the 16-lane vector.
pub fn linear_pack_bytes(product: LinearProduct, t: usize, d_in: usize, d_out: usize) -> u64 {
    if t == 0 || d_in == 0 || d_out == 0 {
        return 0;
    }
    // (gemm's m, the right operand's rows, depth, right operand strided, left operand strided)
    match product {
        LinearProduct::Forward if forward_transposes_weight(t, d_in, d_out) => {
            (4 * d_in * d_out) as u64 + gemm_pack_bytes(d_out, t, d_in, false, false)
        }
        LinearProduct::Forward => gemm_pack_bytes(d_out, t, d_in, false, true),
        LinearProduct::BackwardInput => gemm_pack_bytes(d_in, t, d_out, false, false),
        LinearProduct::BackwardWeight => gemm_pack_bytes(d_in, d_out, t, true, false),
    }
}

/// [`linear_pack_bytes`] of one call into `gemm` in its own (column-major) terms.
fn gemm_pack_bytes(m: usize, n: usize, k: usize, rhs_strided: bool, lhs_strided: bool) -> u64 {
    let kc = depth_block(k);
    let pack_rhs = if rhs_strided {
        m > 2 * MR_MIN
    } else {
        m > 128 * MR_MIN
    };
    let prepack_lhs = m <= 16 * MR_MAX && (lhs_strided || !m.is_multiple_of(16));
    let elems = if pack_rhs {
        kc * n.next_multiple_of(MR_MAX)
    } else {
        0
    } + if prepack_lhs {
        kc * m.next_multiple_of(MR_MAX)
    } else {
        0
    };
    // Two cache-line-aligned blocks.
    if elems == 0 {
        0
    } else {
        (4 * elems + 2 * 128) as u64
    }
}

/// The largest [`linear_pack_bytes`] over one rank's products in a training step: every
/// linear layer's three products over `t` tokens, `t` the rank's tokens per micro-batch
/// (`b·s/cp`, the gathered tokens under sequence parallelism), tensor-parallel layers split
/// by `tp`, the experts whole (at most `t` tokens each) and their router, and the LM head
/// over `loss_chunk` tokens.
pub fn step_gemm_pack_bytes(
    model: &ModelConfig,
    parallel: &ParallelConfig,
    micro_batch: usize,
    loss_chunk: usize,
) -> u64 {
    let products = [
        LinearProduct::Forward,
        LinearProduct::BackwardInput,
        LinearProduct::BackwardWeight,
    ];
    step_linears(model, parallel, micro_batch, loss_chunk)
        .into_iter()
        .flat_map(|(t, i, o)| products.map(|p| linear_pack_bytes(p, t, i, o)))
        .max()
        .unwrap_or(0)
}

/// One rank's linear products in a training step, as `(tokens, in, out)`: see
/// [`step_gemm_pack_bytes`].
fn step_linears(
    model: &ModelConfig,
    parallel: &ParallelConfig,
    micro_batch: usize,
    loss_chunk: usize,
) -> Vec<(usize, usize, usize)> {
    let tp = parallel.tp.max(1);
    let tokens = micro_batch * model.seq_len / parallel.cp.max(1);
    let (h, hd) = (model.hidden, model.head_dim());
    let (q, kv, f) = (
        model.heads * hd / tp,
        model.kv_heads * hd / tp,
        model.ffn / tp,
    );
    let mut linears = vec![
        (tokens, h, q),
        (tokens, h, kv),
        (tokens, q, h),
        (tokens, h, f),
    ];
    linears.push((tokens, f, h));
    if model.experts > 0 {
        // A held expert gets rows from every expert-parallel member: up to `tokens · ep`.
        let rows = tokens * parallel.ep.max(1);
        linears.extend([(rows, h, model.ffn), (rows, model.ffn, h)]);
        linears.push((tokens, h, model.experts));
    }
    // The head's products see a rank's real vocabulary rows only: rank 0 has the most.
    linears.push((loss_chunk.min(tokens), h, model.vocab_valid_rows(tp, 0)));
    linears
}

/// Where a GPU's bf16 products (`train.matmul = "bf16"` with `train.device = "cuda"`) put
/// the second of a product's two rounded operands: this many bytes into the scratch.
pub fn device_bf16_second_operand(first_elems: usize) -> usize {
    (2 * first_elems).next_multiple_of(BF16_OPERAND_ALIGN)
}

/// Alignment of each bf16 operand in a GPU's product scratch (what cuBLASLt's tensor-core
/// kernels want, with room to spare).
pub const BF16_OPERAND_ALIGN: usize = 256;

/// The device scratch of a GPU's bf16 products: both operands of the step's largest linear
/// product ([`step_gemm_pack_bytes`]'s products, the LM head's chunks among them) rounded to
/// bf16, the second at [`device_bf16_second_operand`]. The CUDA backend allocates exactly
/// this, and the engine and the estimator count it as workspace for the whole run.
pub fn device_bf16_operand_bytes(
    model: &ModelConfig,
    parallel: &ParallelConfig,
    (micro_batch, loss_chunk): (usize, usize),
) -> u64 {
    step_linears(model, parallel, micro_batch, loss_chunk)
        .into_iter()
        .flat_map(|(t, i, o)| {
            // (first, second) operand elements: forward W·x, input gradient W·dy, weight
            // gradient x·dy (the order the backend rounds them in).
            [(o * i, t * i), (o * i, t * o), (t * i, t * o)]
        })
        .map(|(a, b)| (device_bf16_second_operand(a) + 2 * b) as u64)
        .max()
        .unwrap_or(0)
}

/// The most bytes one score buffer of a GPU's attention products may take
/// ([`attention_score_rows`] shrinks the chunk to fit, down to [`ATTENTION_SCORE_MIN_ROWS`]).
pub const ATTENTION_SCORE_BUDGET: usize = 256 << 20;
/// Query rows per chunk of a GPU's attention products at most: a causal chunk skips the
/// keys past its last row.
pub const ATTENTION_SCORE_MAX_ROWS: usize = 512;
/// Query rows per chunk at least, whatever the budget.
pub const ATTENTION_SCORE_MIN_ROWS: usize = 16;

/// Query rows per chunk of a GPU's attention products (`train.attention = "products"`) over
/// sequences of `seq` positions with `kv_heads` key/value heads on the rank: one chunk's
/// scores are `kv_heads × rows × seq` f32.
pub fn attention_score_rows(seq: usize, kv_heads: usize) -> usize {
    let per_row = kv_heads.max(1) * seq.max(1) * 4;
    (ATTENTION_SCORE_BUDGET / per_row)
        .clamp(ATTENTION_SCORE_MIN_ROWS, ATTENTION_SCORE_MAX_ROWS)
        .min(seq.max(1))
}

/// The device workspace of a GPU's attention products (`train.attention = "products"`;
/// else 0): two score buffers (the backward's probabilities and their gradient) of a chunk
/// of [`attention_score_rows`] query rows, with the rank's kv heads (`kv_heads / tp`). The
/// CUDA backend allocates exactly this, and the engine and the estimator count it as
/// workspace for the whole run.
pub fn device_attention_score_bytes(
    model: &ModelConfig,
    parallel: &ParallelConfig,
    attention: crate::Attention,
) -> u64 {
    if attention != crate::Attention::Products || parallel.cp > 1 {
        return 0;
    }
    let kv = model.kv_heads / parallel.tp.max(1);
    let rows = attention_score_rows(model.seq_len, kv);
    (2 * 4 * kv * rows * model.seq_len) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpus_bf16_scratch_holds_the_largest_products_two_operands() {
        let model = ModelConfig {
            vocab: 300,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            seq_len: 16,
            ..ModelConfig::default()
        };
        // 32 tokens; the largest is the LM head's input gradient over a chunk of 8: the
        // weight (300 × 64 = 19,200 bf16, 38,400 bytes, a multiple of 256) then the logits'
        // gradient (8 × 300 = 2,400 bf16, 4,800 bytes). The layers' largest (the MLP's
        // input gradient) takes 16,384 + 8,192.
        let p = ParallelConfig::default();
        assert_eq!(device_bf16_operand_bytes(&model, &p, (2, 8)), 43_200);
        // Without the LM head's weight in the way (a chunk of 1 and a vocabulary of 8), the
        // MLP's products decide.
        let small_head = ModelConfig { vocab: 8, ..model };
        assert_eq!(device_bf16_operand_bytes(&small_head, &p, (2, 1)), 24_576);
        assert_eq!(device_bf16_second_operand(100), 256);
        assert_eq!(device_bf16_second_operand(128), 256);
        assert_eq!(device_bf16_second_operand(129), 512);
    }

    #[test]
    fn the_depth_is_cut_into_equal_blocks() {
        assert_eq!(depth_block(256), 256);
        assert_eq!(depth_block(768), 768);
        assert_eq!(depth_block(2048), 1024);
        assert_eq!(depth_block(2049), 683);
        assert_eq!(linear_pack_bytes(LinearProduct::Forward, 0, 64, 64), 0);
    }

    #[test]
    fn the_lm_head_gradient_dominates_a_large_vocabulary() {
        let model = ModelConfig {
            vocab: 32000,
            hidden: 768,
            layers: 12,
            heads: 12,
            kv_heads: 12,
            ffn: 2048,
            seq_len: 512,
            ..ModelConfig::default()
        };
        // dW of the head: [768 × 256]·[256 × 32000] with the 32,000 rows packed.
        let dw = |p: &ParallelConfig| step_gemm_pack_bytes(&model, p, 2, 256);
        assert_eq!(dw(&ParallelConfig::default()), 4 * 256 * 32000 + 256);
        let tp2 = ParallelConfig {
            tp: 2,
            ..ParallelConfig::default()
        };
        assert_eq!(dw(&tp2), 4 * 256 * 16000 + 256);
    }

    #[test]
    fn a_gpus_attention_scores_are_two_chunks_of_the_ranks_kv_heads() {
        // The 1B Llama: 8 kv heads of 2,048 positions, 64 KiB of scores per row: 512 rows.
        assert_eq!(attention_score_rows(2048, 8), 512);
        // 128k positions: 4 MiB per row, 64 rows in 256 MiB; far past it, the floor.
        assert_eq!(attention_score_rows(131072, 8), 64);
        assert_eq!(attention_score_rows(1 << 22, 8), ATTENTION_SCORE_MIN_ROWS);
        assert_eq!(attention_score_rows(100, 2), 100);
        let model = ModelConfig {
            kv_heads: 8,
            seq_len: 2048,
            ..ModelConfig::default()
        };
        let tp2 = ParallelConfig {
            tp: 2,
            ..ParallelConfig::default()
        };
        let products = crate::Attention::Products;
        assert_eq!(
            device_attention_score_bytes(&model, &tp2, products),
            2 * 4 * 4 * 512 * 2048
        );
        let cp2 = ParallelConfig {
            cp: 2,
            ..ParallelConfig::default()
        };
        assert_eq!(device_attention_score_bytes(&model, &cp2, products), 0);
        let one = ParallelConfig::default();
        assert_eq!(
            device_attention_score_bytes(&model, &one, crate::Attention::Tiles),
            0
        );
    }
}
