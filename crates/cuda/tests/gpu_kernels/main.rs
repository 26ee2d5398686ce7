//! The GPU check, part 1: every kernel of the CUDA backend against the CPU backend on random
//! inputs, forward and backward. Needs an NVIDIA GPU, so the tests are ignored by default;
//! `scripts/gpu-check` runs them (`--ignored`). f32 results agree within a normwise relative
//! error of 1e-5 (GEMMs in f32, TF32 off); copies, fills and bf16 casts bit for bit.

#![cfg(feature = "cuda")]

#[path = "../twin/mod.rs"]
mod twin;

use ferrotron_cuda::CudaOptions;
use ferrotron_tensor::adamw::AdamW;
use ferrotron_tensor::moe::Dispatch;
use ferrotron_tensor::muon::MuonMomentum;
use ferrotron_tensor::xent::XentGrads;
use ferrotron_tensor::{bf16, f16, DeviceSlice, Operand};
use ferrotron_tensor::{AuxLoss, HeadShape, LinearShape, NormSaved, RouteShape, Routed};
use twin::{close, random, Twin, F32};

const T: usize = 37;
const H: usize = 96;
const O: usize = 160;

/// Binds the buffers with these ids (distinct) of one side's store, by the same names.
macro_rules! take {
    ($v:expr; $($id:ident),+) => {
        let [$($id),+] = $v.get_disjoint_mut([$($id),+]).expect("distinct buffer ids");
    };
}

mod attention;
use attention::rope_attention_and_ring_blocks;

fn linear_layers(tw: &mut Twin) {
    let (x, w, y) = (tw.f32s(T * H, 1), tw.f32s(O * H, 2), tw.f32s(T * O, 3));
    tw.each(|be, _, s| {
        take!(s.f; y, x, w);
        be.linear_forward(y, x.operand(), w.operand(), LinearShape::new(T, H, O))
    });
    tw.same("linear forward", y, F32);
    let (dx, dw) = (tw.f32s(T * H, 4), tw.f32s(O * H, 5));
    for accumulate in [true, false] {
        tw.each(|be, _, s| {
            take!(s.f; dx, y, w);
            be.linear_backward_input(
                dx,
                y.operand(),
                w.operand(),
                LinearShape::new(T, H, O),
                accumulate,
            )
        });
        tw.same(
            &format!("linear backward input (accumulate {accumulate})"),
            dx,
            F32,
        );
    }
    tw.each(|be, _, s| {
        take!(s.f; dw, y, x);
        be.linear_backward_weight(dw, y.operand(), x.operand(), LinearShape::new(T, H, O))
    });
    tw.same("linear backward weight", dw, F32);
    // The biases on fresh rows, the same bits on both sides: `y` above holds each side's own
    // product, which differs in the last bits, so adding to it could not be compared exactly.
    let (b, db, z) = (tw.f32s(O, 6), tw.f32s(O, 7), tw.f32s(T * O, 8));
    tw.each(|be, _, s| {
        take!(s.f; z, b);
        be.bias_forward(z, b)
    });
    tw.exact("bias forward", z);
    tw.each(|be, _, s| {
        take!(s.f; db, z);
        be.bias_backward(db, z)
    });
    tw.exact("bias backward", db);
}

/// bf16 products on the other side (its operands rounded to bf16 there, f32 sums) against
/// the CPU's f32 products of operands rounded beforehand: the same exact products, summed in
/// another order. `rounds`: the other side rounds (a GPU with bf16 products); else it is given
/// the rounded operands too (the arena, which has no bf16 products).
fn linear_layers_in_bf16(tw: &mut Twin, rounds: bool) {
    let rounded =
        |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect() };
    let mut pair = |n: usize, seed: u64| {
        let v = random(n, seed);
        let r = rounded(v.clone());
        tw.f32_sides(&r, if rounds { &v } else { &r })
    };
    let (x, w, dy) = (pair(T * H, 11), pair(O * H, 12), pair(T * O, 13));
    let (y, dx, dw) = (tw.zeros(T * O), tw.f32s(T * H, 14), tw.f32s(O * H, 15));
    tw.each(|be, _, s| {
        take!(s.f; y, x, w);
        be.linear_forward(y, x.operand(), w.operand(), LinearShape::new(T, H, O))
    });
    tw.same("bf16 products: linear forward", y, F32);
    tw.each(|be, _, s| {
        take!(s.f; dx, dy, w);
        be.linear_backward_input(
            dx,
            dy.operand(),
            w.operand(),
            LinearShape::new(T, H, O),
            true,
        )
    });
    tw.same("bf16 products: linear backward input (accumulate)", dx, F32);
    tw.each(|be, _, s| {
        take!(s.f; dw, dy, x);
        be.linear_backward_weight(dw, dy.operand(), x.operand(), LinearShape::new(T, H, O))
    });
    tw.same("bf16 products: linear backward weight", dw, F32);
    // The precision seam: bf16 operands where they are stored (bf16 products read them as
    // they are; f32 products and the CPU widen them) give the products of their values.
    let (xb, wb, dyb) = (
        tw.bf16_of(&random(T * H, 11)),
        tw.bf16_of(&random(O * H, 12)),
        tw.bf16_of(&random(T * O, 13)),
    );
    let (y2, dw2) = (tw.zeros(T * O), tw.zeros(O * H));
    let sh = LinearShape::new(T, H, O);
    tw.each(|be, _, s| {
        let (x, w) = (s.b[xb].operand(), s.b[wb].operand());
        be.linear_forward(&mut s.f[y2], x, w, sh)
    });
    tw.same("bf16 operands: linear forward", y2, F32);
    tw.each(|be, _, s| {
        let (dy, x) = (s.b[dyb].operand(), s.b[xb].operand());
        be.linear_backward_weight(&mut s.f[dw2], dy, x, sh)
    });
    tw.same("bf16 operands: linear backward weight", dw2, F32);
}

fn rmsnorm_swiglu_and_elementwise(tw: &mut Twin) {
    let (x, w, y, rstd) = (
        tw.f32s(T * H, 1),
        tw.f32s(H, 2),
        tw.zeros(T * H),
        tw.zeros(T),
    );
    tw.each(|be, _, s| {
        take!(s.f; y, rstd, x, w);
        be.rmsnorm_forward(y, rstd, x, w, H, 1e-5)
    });
    tw.same("rmsnorm forward", y, F32);
    tw.same("rmsnorm rstd", rstd, F32);
    let (dy, dx, dw, y2) = (
        tw.f32s(T * H, 3),
        tw.f32s(T * H, 4),
        tw.f32s(H, 5),
        tw.zeros(T * H),
    );
    for accumulate in [true, false] {
        tw.each(|be, _, s| {
            take!(s.f; dx, dw, dy, x, rstd, w);
            be.rmsnorm_backward(dx, dw, dy, NormSaved { x, rstd, w, h: H }, accumulate)
        });
        tw.same(
            &format!("rmsnorm backward dx (accumulate {accumulate})"),
            dx,
            F32,
        );
        tw.same("rmsnorm backward dw (accumulated)", dw, F32);
    }
    tw.each(|be, _, s| {
        take!(s.f; y2, x, rstd, w);
        be.rmsnorm_apply(y2, NormSaved { x, rstd, w, h: H })
    });
    tw.same("rmsnorm apply", y2, F32);
    rmsnorm_weight_gradient_over_many_rows(tw);
    let (g, u, act, dg, du) = (
        tw.f32s(T * O, 6),
        tw.f32s(T * O, 7),
        tw.zeros(T * O),
        tw.zeros(T * O),
        tw.zeros(T * O),
    );
    tw.each(|be, _, s| {
        take!(s.f; act, g, u);
        be.swiglu_forward(act, g, u)
    });
    tw.same("swiglu forward", act, F32);
    tw.each(|be, _, s| {
        take!(s.f; dg, du, act, g, u);
        be.swiglu_backward(dg, du, act, g, u)
    });
    tw.same("swiglu backward gate", dg, F32);
    tw.same("swiglu backward up", du, F32);
    let sum = tw.zeros(T * O);
    tw.each(|be, _, s| {
        take!(s.f; sum, g, u);
        be.add(sum, g, u)
    });
    tw.exact("add", sum);
    tw.each(|be, _, s| {
        take!(s.f; sum, g);
        be.add_assign(sum, g);
        be.scale(sum, 0.37);
        be.copy(g, sum);
    });
    tw.exact("add_assign, scale, copy", g);
    tw.each(|be, _, s| be.fill(&mut s.f[sum], -2.5));
    tw.exact("fill", sum);
    let [c, gq] = tw.each(|be, l, s| be.sum_squares(l, &s.f[u]));
    close("sum of squares", &[c as f32], &[gq as f32], 1e-6);
    // Every range's squared norm in one readback, f32 and bf16 elements: each the same as
    // the one-range kernel's (the GPU's bit for bit, the same reductions).
    let n = T * O;
    let ranges = [0..n, 3..n / 2, n / 2..n / 2 + 1, n - 7..n, 5..5];
    let [cf, gf] = tw.each(|be, l, s| be.sum_squares_ranges(l, Operand::F32(&s.f[u]), &ranges));
    let one = tw.each(|be, l, s| {
        ranges
            .iter()
            .map(|r| be.sum_squares(l, &s.f[u][r.clone()]))
            .collect::<Vec<f64>>()
    });
    assert_eq!(gf, one[1], "the GPU's ranges as its one-range kernel");
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    close("squared norms of ranges", &f32s(&cf), &f32s(&gf), 1e-6);
    let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let b = tw.bf16_of(&values);
    let [cb, gb] = tw.each(|be, l, s| be.sum_squares_ranges(l, Operand::Bf16(&s.b[b]), &ranges));
    close("squared norms of bf16 ranges", &f32s(&cb), &f32s(&gb), 1e-6);
}

/// RMSNorm's weight gradient over many rows (each of the 32 warps of a block sums several)
/// and a partial last block of features.
fn rmsnorm_weight_gradient_over_many_rows(tw: &mut Twin) {
    let (rows, h) = (1500, 40);
    let (x, w, dy, dx, dw, rstd, y) = (
        tw.f32s(rows * h, 6),
        tw.f32s(h, 7),
        tw.f32s(rows * h, 8),
        tw.zeros(rows * h),
        tw.f32s(h, 9),
        tw.zeros(rows),
        tw.zeros(rows * h),
    );
    tw.each(|be, _, s| {
        take!(s.f; y, rstd, x, w);
        be.rmsnorm_forward(y, rstd, x, w, h, 1e-5)
    });
    tw.each(|be, _, s| {
        take!(s.f; dx, dw, dy, x, rstd, w);
        be.rmsnorm_backward(dx, dw, dy, NormSaved { x, rstd, w, h }, false)
    });
    tw.same("rmsnorm backward dw (1,500 rows of 40)", dw, F32);
}

fn bf16_casts_copies_and_sums(tw: &mut Twin) {
    let mut vals = random(1000, 9);
    vals.extend([
        0.0,
        -0.0,
        1e-40,
        3.4e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0 + 1.0 / 256.0, // halfway between two bf16 values: ties to even
        1.0 + 3.0 / 256.0,
    ]);
    let n = vals.len();
    let (x, b, b2, w) = (
        tw.f32_of(&vals),
        tw.bf16_of(&vec![0.0; n]),
        tw.bf16_of(&random(n, 3)),
        tw.zeros(n),
    );
    tw.each(|be, _, s| be.round_bf16(&mut s.b[b], &s.f[x]));
    tw.exact_bf16("round to bf16 (nearest even)", b);
    tw.each(|be, _, s| be.widen_bf16(&mut s.f[w], &s.b[b]));
    tw.exact("widen bf16", w);
    let small = tw.f32s(n, 4);
    tw.each(|be, _, s| be.add_assign_bf16(&mut s.b[b2], &s.f[small]));
    tw.exact_bf16("bf16 add_assign", b2);
    tw.each(|be, _, s| {
        take!(s.b; b, b2);
        be.copy_bf16(b, b2);
        be.fill_bf16(b2, bf16::from_f32(0.75));
    });
    tw.exact_bf16("bf16 copy", b);
    tw.exact_bf16("bf16 fill", b2);
}

/// The IEEE-half casts at their edges: subnormals (down to 2⁻²⁴ and the ties below it),
/// the largest finite value and the first that rounds to infinity, ties to even, NaN.
fn f16_casts_and_sums(tw: &mut Twin) {
    let mut vals: Vec<f32> = random(1000, 21).iter().map(|x| x * 70000.0).collect();
    vals.extend([
        0.0,
        -0.0,
        5.960_464_5e-8, // 2^-24, the smallest subnormal
        2.980_232_2e-8, // 2^-25: a tie, to even (zero)
        8.940_697e-8,   // 3·2^-25: a tie, to even (2^-23)
        6.097_555e-5,   // just below 2^-14, the smallest normal
        65504.0,
        65519.0, // rounds down to 65504
        65520.0, // a tie past 65504: to infinity
        -1e9,
        f32::INFINITY,
        f32::NAN,
        1.0 + 1.0 / 2048.0, // halfway between two halves: ties to even
        1.0 + 3.0 / 2048.0,
    ]);
    let n = vals.len();
    let (x, h, h2, w) = (
        tw.f32_of(&vals),
        tw.f16_of(&vec![0.0; n]),
        tw.f16_of(&random(n, 5)),
        tw.zeros(n),
    );
    tw.each(|be, _, s| be.round_f16(&mut s.h[h], &s.f[x]));
    tw.exact_f16("round to f16 (nearest even)", h);
    tw.each(|be, _, s| be.widen_f16(&mut s.f[w], &s.h[h]));
    tw.exact("widen f16", w);
    let small = tw.f32s(n, 6);
    tw.each(|be, _, s| be.add_assign_f16(&mut s.h[h2], &s.f[small]));
    tw.exact_f16("f16 add_assign", h2);
    tw.each(|be, _, s| be.fill_f16(&mut s.h[h2], f16::from_f32(0.75)));
    tw.exact_f16("f16 fill", h2);
}

fn embedding_cross_entropy_and_vocab_parallel_pieces(tw: &mut Twin) {
    let (v, v0, vl) = (300usize, 100usize, 150usize);
    let tokens: Vec<u32> = (0..T).map(|i| ((i * 131) % v) as u32).collect();
    let tok = tw.u32_of(&tokens);
    let (table, x, slice) = (tw.f32s(v * H, 1), tw.zeros(T * H), tw.f32s(vl * H, 2));
    tw.each(|be, _, s| {
        take!(s.f; x, table);
        be.embedding_forward(x, table, &s.u[tok], H)
    });
    tw.exact("embedding forward", x);
    tw.each(|be, _, s| {
        take!(s.f; x, slice);
        be.embedding_forward_slice(x, slice, &s.u[tok], H, v0)
    });
    tw.exact("embedding forward (vocabulary slice)", x);
    let dx = tw.f32s(T * H, 3);
    tw.each(|be, _, s| {
        take!(s.f; table, dx);
        be.embedding_backward(table, dx, &s.u[tok], H)
    });
    tw.same("embedding backward", table, F32);
    tw.each(|be, _, s| {
        take!(s.f; slice, dx);
        be.embedding_backward_slice(slice, dx, &s.u[tok], H, v0)
    });
    tw.same("embedding backward (vocabulary slice)", slice, F32);
    // The chunked LM head with cross-entropy: loss, and the input and weight gradients.
    let (xn, w, dxn, dw) = (
        tw.f32s(T * H, 4),
        tw.f32s(v * H, 5),
        tw.zeros(T * H),
        tw.f32s(v * H, 6),
    );
    let [c, g] = tw.each(|be, l, s| {
        be.lm_head_xent(
            l,
            &s.f[xn],
            s.f[w].operand(),
            &s.u[tok],
            HeadShape { h: H, v, chunk: 16 },
            None,
        )
    });
    close("cross-entropy loss", &[c as f32], &[g as f32], 1e-6);
    let [c, g] = tw.each(|be, l, s| {
        take!(s.f; xn, w, dxn, dw);
        let grads: XentGrads<'_, DeviceSlice<f32>> = XentGrads {
            dx: dxn,
            dw,
            scale: 1.0 / T as f32,
        };
        be.lm_head_xent(
            l,
            xn,
            w.operand(),
            &s.u[tok],
            HeadShape { h: H, v, chunk: 16 },
            Some(grads),
        )
    });
    close(
        "cross-entropy loss (with gradients)",
        &[c as f32],
        &[g as f32],
        1e-6,
    );
    tw.same("cross-entropy dx", dxn, F32);
    tw.same("cross-entropy dw", dw, F32);
    // The vocabulary-parallel pieces on logits [T, vl] of rows [v0, v0 + vl).
    let (lg, mx, mx2, gathered, stats) = (
        tw.f32s(T * vl, 7),
        tw.zeros(T),
        tw.zeros(T),
        tw.f32s(3 * T, 8),
        tw.zeros(2 * T),
    );
    tw.each(|be, _, s| {
        take!(s.f; mx, lg);
        be.logits_row_max(mx, lg, vl)
    });
    tw.exact("logits row max", mx);
    tw.each(|be, _, s| {
        take!(s.f; mx2, gathered);
        be.max_over_ranks(mx2, gathered, 3)
    });
    tw.exact("max over ranks", mx2);
    tw.each(|be, _, s| {
        take!(s.f; stats, lg, mx);
        be.logits_exp_stats(stats, lg, &s.u[tok], mx, (vl, v0))
    });
    tw.same("logits exp stats", stats, F32);
    let lse = tw.f64_zeros(T);
    let [c, g] = tw.each(|be, l, s| be.vocab_lse(l, &mut s.d[lse], &s.f[mx], &s.f[stats]));
    close("vocabulary-parallel loss", &[c as f32], &[g as f32], 1e-6);
    tw.same_f64("vocabulary-parallel lse", lse, 1e-6);
    tw.each(|be, _, s| be.vocab_softmax_grad(&mut s.f[lg], &s.u[tok], &s.d[lse], (vl, v0), 0.5));
    tw.same("vocabulary-parallel softmax gradient", lg, F32);
}

/// FP8 emulation over each axis and format: the same grid points, so the same values bit for
/// bit (the scales and roundings are each one IEEE operation).
fn fp8_emulation(tw: &mut Twin) {
    use ferrotron_tensor::fp8::{groups, Fp8Axis, Fp8Format, Fp8Quant};
    let (rows, cols) = (T, 3 * H + 5);
    let (src, dst) = (tw.f32s(rows * cols, 21), tw.zeros(rows * cols));
    let amax = tw.zeros(rows.max(cols));
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for axis in [Fp8Axis::Tensor, Fp8Axis::Rows, Fp8Axis::Cols] {
            let q = Fp8Quant {
                format,
                axis,
                rows,
                cols,
            };
            let n = groups(q);
            tw.each(|be, _, s| {
                take!(s.f; dst, src, amax);
                be.fp8_amax(&mut amax[..n], src, q);
                be.fp8_apply(dst, src, &amax[..n], q)
            });
            tw.exact(&format!("fp8 maxima {format:?} {axis:?}"), amax);
            tw.exact(&format!("fp8 {format:?} {axis:?}"), dst);
        }
    }
}

/// Muon's momentum kernel, with and without Nesterov, on gradient buffer `g` of `n`.
fn muon_momentum(tw: &mut Twin, g: usize, n: usize) {
    let (u, mm) = (tw.f32_of(&vec![0.0; n]), tw.f32s(n, 5));
    for nesterov in [true, false] {
        let h = MuonMomentum {
            beta: 0.95,
            nesterov,
        };
        tw.each(|be, _, s| {
            take!(s.f; u, mm, g);
            be.muon_momentum(u, mm, g, 0.5, h)
        });
        tw.same(&format!("muon momentum (nesterov {nesterov})"), u, F32);
        tw.same(&format!("muon momentum's m (nesterov {nesterov})"), mm, F32);
    }
}

/// The row movement of a mixture of experts under `dispatch` (of `rc`): gather, scatter-add,
/// combine and its backward; returns the gates' gradient. `tag` names the dispatch.
fn moe_rows(
    tw: &mut Twin,
    rc: &ferrotron_tensor::moe::Routing,
    dispatch: &Dispatch,
    tag: &str,
) -> usize {
    let (k, n) = (dispatch.top_k(), dispatch.len());
    let (x, grouped, back) = (tw.f32s(T * H, 5), tw.zeros(n * H), tw.f32s(T * H, 6));
    tw.each(|be, _, s| {
        take!(s.f; grouped, x);
        be.moe_gather_rows(grouped, x, H, dispatch)
    });
    tw.exact(&format!("moe gather{tag}"), grouped);
    tw.each(|be, _, s| {
        take!(s.f; back, grouped);
        be.moe_scatter_add_rows(back, grouped, H, dispatch)
    });
    tw.same(&format!("moe scatter-add{tag}"), back, F32);
    let (eo, out) = (tw.f32s(n * H, 7), tw.zeros(T * H));
    tw.each(|be, _, s| {
        take!(s.f; out, eo);
        be.moe_combine_forward(
            out,
            eo,
            H,
            Routed {
                routing: rc,
                dispatch,
            },
        )
    });
    tw.same(&format!("moe combine forward{tag}"), out, F32);
    let (dout, deo, dgates) = (tw.f32s(T * H, 8), tw.zeros(n * H), tw.zeros(T * k));
    tw.each(|be, _, s| {
        take!(s.f; deo, dgates, dout, eo);
        be.moe_combine_backward(
            deo,
            dgates,
            dout,
            eo,
            H,
            Routed {
                routing: rc,
                dispatch,
            },
        )
    });
    tw.same(
        &format!("moe combine backward (experts' outputs){tag}"),
        deo,
        F32,
    );
    tw.same(&format!("moe combine backward (gates){tag}"), dgates, F32);
    dgates
}

fn adamw_and_mixture_of_experts(tw: &mut Twin) {
    let n = 10_000;
    let (p, g, m, v) = (
        tw.f32s(n, 1),
        tw.f32s(n, 2),
        tw.f32s(n, 3),
        tw.f32_of(&vec![0.01; n]),
    );
    let hyper = AdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
    };
    tw.each(|be, _, s| {
        take!(s.f; p, g, m, v);
        be.adamw(p, g, m, v, 0.5, hyper)
    });
    for (name, id) in [("param", p), ("m", m), ("v", v)] {
        tw.same(&format!("adamw {name}"), id, F32);
    }
    muon_momentum(tw, g, n);
    let (experts, k) = (6usize, 2usize);
    let logits = tw.f32s(T * experts, 4);
    let [rc, rg] = tw.each(|be, l, s| {
        be.moe_route(
            l,
            &s.f[logits],
            None,
            RouteShape {
                t: T,
                experts,
                top_k: k,
            },
        )
    });
    assert_eq!(rc, rg, "routing from the same logits");
    let capped = Dispatch::with_capacity(&rc, (T, experts, k), Some(T * k / experts / 2));
    assert!(capped.dropped() > 0);
    moe_rows(tw, &rc, &capped, " with dropped tokens");
    let dgates = moe_rows(tw, &rc, &Dispatch::new(&rc, T, experts, k), "");
    let dz = tw.zeros(T * experts);
    tw.each(|be, _, s| {
        take!(s.f; dz, dgates);
        be.moe_route_backward(
            dz,
            dgates,
            &rc,
            RouteShape {
                t: T,
                experts,
                top_k: k,
            },
        )
    });
    tw.same("moe route backward", dz, F32);
    let stats = ferrotron_tensor::moe::aux_stats(&rc, T, experts, k);
    tw.each(|be, _, s| {
        be.moe_aux_loss_backward(
            &mut s.f[dz],
            AuxLoss {
                coef: 0.01,
                stats: &stats,
                tokens: T,
            },
            &rc,
            RouteShape {
                t: T,
                experts,
                top_k: k,
            },
        )
    });
    tw.same("moe load-balancing backward", dz, F32);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn linear_layers_on_the_gpu() {
    linear_layers(&mut Twin::new());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn linear_layers_with_bf16_products_on_the_gpu() {
    // The scratch for the largest of the three products' two operands.
    let second = ferrotron_config::device_bf16_second_operand(O * H);
    let options = CudaOptions {
        bf16_products: Some(second + 2 * T * O.max(H)),
        ..CudaOptions::default()
    };
    linear_layers_in_bf16(&mut Twin::gpu(options), true);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn rmsnorm_swiglu_and_elementwise_on_the_gpu() {
    rmsnorm_swiglu_and_elementwise(&mut Twin::new());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn bf16_casts_copies_and_sums_on_the_gpu() {
    bf16_casts_copies_and_sums(&mut Twin::new());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn f16_casts_and_sums_on_the_gpu() {
    f16_casts_and_sums(&mut Twin::new());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn rope_attention_and_ring_blocks_on_the_gpu() {
    rope_attention_and_ring_blocks(&mut Twin::new());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn embedding_cross_entropy_and_vocab_parallel_pieces_on_the_gpu() {
    embedding_cross_entropy_and_vocab_parallel_pieces(&mut Twin::new());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn adamw_and_mixture_of_experts_on_the_gpu() {
    adamw_and_mixture_of_experts(&mut Twin::new());
}

/// The checks themselves, run with the arena backend (the CPU kernels over one arena of
/// device memory) in place of the GPU: every shape and argument of every check is valid and
/// each comparison passes where it must (bit for bit here), so a GPU run tests the kernels,
/// not this file.
#[test]
fn every_check_runs_with_the_arena_backend_in_place_of_the_gpu() {
    linear_layers(&mut Twin::arena());
    linear_layers_in_bf16(&mut Twin::arena(), false);
    rmsnorm_swiglu_and_elementwise(&mut Twin::arena());
    bf16_casts_copies_and_sums(&mut Twin::arena());
    f16_casts_and_sums(&mut Twin::arena());
    rope_attention_and_ring_blocks(&mut Twin::arena());
    embedding_cross_entropy_and_vocab_parallel_pieces(&mut Twin::arena());
    adamw_and_mixture_of_experts(&mut Twin::arena());
    fp8_emulation(&mut Twin::arena());
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu-check runs it"]
fn fp8_emulation_on_the_gpu() {
    fp8_emulation(&mut Twin::new());
}
