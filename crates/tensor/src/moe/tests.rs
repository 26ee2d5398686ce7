use super::*;
use crate::linear::{linear_backward_input, linear_backward_weight, linear_forward};
use crate::swiglu::{swiglu_backward, swiglu_forward};

/// Deterministic values in `[-scale, scale)` (xorshift64*), so the tests need no RNG crate.
fn rand_vec(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Each token's selected experts as a set: the slot order may change without changing the
/// layer, a different set would make the loss jump.
fn selected_sets(r: &Routing, k: usize) -> Vec<Vec<usize>> {
    r.ids
        .chunks(k)
        .map(|ids| {
            let mut v = ids.to_vec();
            v.sort();
            v
        })
        .collect()
}

/// A tiny Mixtral block: router `wg [E, h]`, per expert `w1`, `w3` `[f, h]` and `w2` `[h, f]`,
/// stored expert after expert. Loss = Σ out·R + coef·aux.
struct Layer {
    t: usize,
    h: usize,
    e: usize,
    k: usize,
    f: usize,
    coef: f64,
    /// Expert capacity (None: dropless).
    capacity: Option<usize>,
    x: Vec<f32>,
    wg: Vec<f32>,
    w1: Vec<f32>,
    w3: Vec<f32>,
    w2: Vec<f32>,
    r: Vec<f32>,
}

/// What the forward keeps for the backward.
struct Saved {
    logits: Vec<f32>,
    routing: Routing,
    dispatch: Dispatch,
    xg: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
}

impl Layer {
    fn forward(&self) -> (f64, Saved) {
        let (t, h, e, k, f) = (self.t, self.h, self.e, self.k, self.f);
        let mut logits = vec![0.0; t * e];
        linear_forward(&mut logits, &self.x, &self.wg, t, h, e);
        let routing = route(&logits, t, e, k);
        let dispatch = Dispatch::with_capacity(&routing, (t, e, k), self.capacity);
        let n = dispatch.len();
        let mut xg = vec![0.0; n * h];
        gather_rows(&mut xg, &self.x, h, &dispatch);
        let (mut gate, mut up, mut act) = (vec![0.0; n * f], vec![0.0; n * f], vec![0.0; n * f]);
        let mut y = vec![0.0; n * h];
        for ex in 0..e {
            let rows = dispatch.rows(ex);
            let n = rows.len();
            let (xr, fr) = (rows.start * h..rows.end * h, rows.start * f..rows.end * f);
            let (w1, w3, w2) = (
                &self.w1[ex * f * h..][..f * h],
                &self.w3[ex * f * h..][..f * h],
                &self.w2[ex * h * f..][..h * f],
            );
            linear_forward(&mut gate[fr.clone()], &xg[xr.clone()], w1, n, h, f);
            linear_forward(&mut up[fr.clone()], &xg[xr.clone()], w3, n, h, f);
            swiglu_forward(&mut act[fr.clone()], &gate[fr.clone()], &up[fr.clone()]);
            linear_forward(&mut y[xr], &act[fr], w2, n, f, h);
        }
        let mut out = vec![0.0; t * h];
        combine_forward(&mut out, &y, h, &routing, &dispatch);
        let aux = aux_loss(&aux_stats(&routing, t, e, k), t);
        let loss = dot(&out, &self.r) + self.coef * aux;
        (
            loss,
            Saved {
                logits,
                routing,
                dispatch,
                xg,
                gate,
                up,
                act,
                y,
            },
        )
    }

    /// Gradients of the loss: `[dx, dwg, dw1, dw3, dw2]`.
    fn backward(&self, s: &Saved) -> [Vec<f32>; 5] {
        let (t, h, e, k, f) = (self.t, self.h, self.e, self.k, self.f);
        let rows = s.dispatch.len();
        let (mut dy, mut dgates) = (vec![0.0; rows * h], vec![0.0; t * k]);
        combine_backward(
            &mut dy,
            &mut dgates,
            &self.r,
            &s.y,
            h,
            &s.routing,
            &s.dispatch,
        );
        let (mut dw1, mut dw3, mut dw2) = (
            vec![0.0; self.w1.len()],
            vec![0.0; self.w3.len()],
            vec![0.0; self.w2.len()],
        );
        let mut dxg = vec![0.0; rows * h];
        let (mut dact, mut dgate, mut dup) = (
            vec![0.0; rows * f],
            vec![0.0; rows * f],
            vec![0.0; rows * f],
        );
        for ex in 0..e {
            let rows = s.dispatch.rows(ex);
            let n = rows.len();
            let (xr, fr) = (rows.start * h..rows.end * h, rows.start * f..rows.end * f);
            let (wi, wo) = (ex * f * h..(ex + 1) * f * h, ex * h * f..(ex + 1) * h * f);
            linear_backward_input(
                &mut dact[fr.clone()],
                &dy[xr.clone()],
                &self.w2[wo.clone()],
                n,
                f,
                h,
                false,
            );
            linear_backward_weight(&mut dw2[wo], &dy[xr.clone()], &s.act[fr.clone()], n, f, h);
            let (g, u) = (&s.gate[fr.clone()], &s.up[fr.clone()]);
            swiglu_backward(
                &mut dgate[fr.clone()],
                &mut dup[fr.clone()],
                &dact[fr.clone()],
                g,
                u,
            );
            linear_backward_input(
                &mut dxg[xr.clone()],
                &dgate[fr.clone()],
                &self.w1[wi.clone()],
                n,
                h,
                f,
                false,
            );
            linear_backward_input(
                &mut dxg[xr.clone()],
                &dup[fr.clone()],
                &self.w3[wi.clone()],
                n,
                h,
                f,
                true,
            );
            linear_backward_weight(
                &mut dw1[wi.clone()],
                &dgate[fr.clone()],
                &s.xg[xr.clone()],
                n,
                h,
                f,
            );
            linear_backward_weight(&mut dw3[wi], &dup[fr], &s.xg[xr], n, h, f);
        }
        let mut dx = vec![0.0; t * h];
        scatter_add_rows(&mut dx, &dxg, h, &s.dispatch);
        let mut dlogits = vec![0.0; t * e];
        route_backward(&mut dlogits, &dgates, &s.routing, t, e, k);
        let stats = aux_stats(&s.routing, t, e, k);
        aux_loss_backward(&mut dlogits, self.coef, &stats, t, &s.routing, t, e);
        linear_backward_input(&mut dx, &dlogits, &self.wg, t, h, e, true);
        let mut dwg = vec![0.0; self.wg.len()];
        linear_backward_weight(&mut dwg, &dlogits, &self.x, t, h, e);
        [dx, dwg, dw1, dw3, dw2]
    }

    fn param(&mut self, i: usize) -> &mut Vec<f32> {
        match i {
            0 => &mut self.x,
            1 => &mut self.wg,
            2 => &mut self.w1,
            3 => &mut self.w3,
            _ => &mut self.w2,
        }
    }
}

fn tiny_layer() -> Layer {
    let (t, h, e, k, f) = (6, 8, 4, 2, 12);
    Layer {
        t,
        h,
        e,
        k,
        f,
        coef: 0.5,
        capacity: None,
        // Seeds 4 and 11 give every token a margin of ≥ 0.97 between its 2nd and 3rd logit
        // and assign 4, 3, 2, 3 rows to the experts.
        x: rand_vec(4, t * h, 1.0),
        wg: rand_vec(11, e * h, 1.0),
        w1: rand_vec(13, e * f * h, 0.6),
        w3: rand_vec(14, e * f * h, 0.6),
        w2: rand_vec(15, e * h * f, 0.5),
        r: rand_vec(16, t * h, 1.0),
    }
}

#[test]
fn layer_gradients_match_finite_differences() {
    layer_gradient_check(tiny_layer());
}

/// The same check with capacity 2 per expert: the 4, 3, 2, 3 assignments lose 4 (the least
/// probable of experts 0, 1 and 3), whose slots then add nothing and pass no gradient back.
#[test]
fn layer_gradients_with_dropped_tokens_match_finite_differences() {
    let layer = Layer {
        capacity: Some(2),
        ..tiny_layer()
    };
    let (_, saved) = layer.forward();
    assert_eq!(saved.dispatch.counts(), &[2, 2, 2, 2]);
    assert_eq!(saved.dispatch.dropped(), 4);
    layer_gradient_check(layer);
}

fn layer_gradient_check(mut layer: Layer) {
    let (_, saved) = layer.forward();
    // Clear margins between the k-th and (k+1)-th logit keep the selection fixed under the
    // finite-difference steps (|Δlogit| ≤ eps·max|x|, eps·max|wg| ≤ 1e-2 here).
    for z in saved.logits.chunks(layer.e) {
        let mut z = z.to_vec();
        z.sort_by(|a, b| b.total_cmp(a));
        assert!(
            z[layer.k - 1] - z[layer.k] > 0.05,
            "routing margin too small: {z:?}"
        );
    }
    let base_sets = selected_sets(&saved.routing, layer.k);
    let grads = layer.backward(&saved);
    let names = ["x", "wg", "w1", "w3", "w2"];
    let eps = 1e-2f32;
    for (p, name) in names.iter().enumerate() {
        let n = layer.param(p).len();
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for i in 0..n {
            let v = layer.param(p)[i];
            layer.param(p)[i] = v + eps;
            let (lp, sp) = layer.forward();
            layer.param(p)[i] = v - eps;
            let (lm, sm) = layer.forward();
            layer.param(p)[i] = v;
            assert_eq!(
                selected_sets(&sp.routing, layer.k),
                base_sets,
                "{name}[{i}] flips routing"
            );
            assert_eq!(
                selected_sets(&sm.routing, layer.k),
                base_sets,
                "{name}[{i}] flips routing"
            );
            for moved in [&sp, &sm] {
                let (a, b) = (moved.dispatch.row_table(), saved.dispatch.row_table());
                let dropped = |r: &[usize]| r.iter().map(|&x| x == DROPPED).collect::<Vec<_>>();
                assert_eq!(
                    dropped(a),
                    dropped(b),
                    "{name}[{i}] changes what is dropped"
                );
            }
            let fd = (lp - lm) / (2.0 * eps as f64);
            num += (fd - grads[p][i] as f64).powi(2);
            den += fd * fd;
        }
        let rel = (num / den).sqrt();
        eprintln!(
            "d/d{name}: relative error {rel:.2e} (|grad| = {:.3})",
            den.sqrt()
        );
        assert!(rel < 1e-2, "d/d{name}: relative error {rel}");
    }
}

#[test]
fn aux_loss_backward_matches_finite_differences() {
    let (t, e, k, coef) = (5, 4, 2, 0.7);
    let logits = rand_vec(11, t * e, 2.0);
    let loss = |z: &[f32]| {
        let r = route(z, t, e, k);
        (
            coef * aux_loss(&aux_stats(&r, t, e, k), t),
            selected_sets(&r, k),
        )
    };
    let r = route(&logits, t, e, k);
    let mut d = vec![0.0; t * e];
    aux_loss_backward(&mut d, coef, &aux_stats(&r, t, e, k), t, &r, t, e);
    let base_sets = selected_sets(&r, k);
    let eps = 1e-3f32;
    for i in 0..t * e {
        let (mut zp, mut zm) = (logits.clone(), logits.clone());
        zp[i] += eps;
        zm[i] -= eps;
        let ((lp, sp), (lm, sm)) = (loss(&zp), loss(&zm));
        assert!(
            sp == base_sets && sm == base_sets,
            "logit {i} flips routing"
        );
        let fd = (lp - lm) / (2.0 * eps as f64);
        assert!(
            (fd - d[i] as f64).abs() < 1e-4,
            "logit {i}: fd {fd} vs {}",
            d[i]
        );
    }
}

#[test]
fn route_breaks_ties_by_lower_index() {
    let logits = [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, 2.0, 2.0, 2.0];
    let r = route(&logits, 2, 5, 2);
    assert_eq!(r.ids, vec![1, 2, 0, 1]);
    assert_eq!(r.gates, vec![0.5; 4]);
}

#[test]
fn route_gates_sum_to_one() {
    let (t, e, k) = (7, 8, 3);
    let r = route(&rand_vec(21, t * e, 3.0), t, e, k);
    for (tok, g) in r.gates.chunks(k).enumerate() {
        assert!((g.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let p = &r.probs[tok * e..(tok + 1) * e];
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let ids = &r.ids[tok * k..(tok + 1) * k];
        // Slots are most probable first, and nothing left out beats what was selected.
        assert!(ids.windows(2).all(|w| p[w[0]] >= p[w[1]]));
        let kth = p[ids[k - 1]];
        assert!((0..e).filter(|x| !ids.contains(x)).all(|x| p[x] <= kth));
    }
}

#[test]
fn route_with_k_equal_e_gives_probs() {
    let (t, e) = (4, 5);
    let r = route(&rand_vec(31, t * e, 2.0), t, e, e);
    for tok in 0..t {
        for s in 0..e {
            let id = r.ids[tok * e + s];
            assert!((r.gates[tok * e + s] - r.probs[tok * e + id]).abs() < 1e-6);
        }
    }
}

/// t = 4, E = 3, k = 2 with dyadic probabilities, so every sum below is exact.
fn hand_routing() -> Routing {
    Routing {
        ids: vec![0, 1, 1, 2, 2, 0, 0, 1],
        gates: vec![0.5; 8],
        probs: vec![
            0.5, 0.25, 0.25, //
            0.125, 0.625, 0.25, //
            0.25, 0.25, 0.5, //
            0.5, 0.375, 0.125,
        ],
    }
}

#[test]
fn aux_loss_matches_hf_formula() {
    let (t, e, k) = (4, 3, 2);
    let r = hand_routing();
    // Line by line `load_balancing_loss_func`: one_hot [T, k, E], mean over T, times the
    // mean probability per expert, summed, times E.
    let mut tokens_per_expert = vec![vec![0.0f64; e]; k];
    for tok in 0..t {
        for s in 0..k {
            tokens_per_expert[s][r.ids[tok * k + s]] += 1.0 / t as f64;
        }
    }
    let router_prob_per_expert: Vec<f64> = (0..e)
        .map(|x| (0..t).map(|tok| r.probs[tok * e + x] as f64).sum::<f64>() / t as f64)
        .collect();
    let hf: f64 = tokens_per_expert
        .iter()
        .map(|row| {
            row.iter()
                .zip(&router_prob_per_expert)
                .map(|(a, b)| a * b)
                .sum::<f64>()
        })
        .sum::<f64>()
        * e as f64;
    let stats = aux_stats(&r, t, e, k);
    assert_eq!(stats.counts, vec![3.0, 3.0, 2.0]);
    assert_eq!(stats.prob_sums, vec![1.375, 1.5, 1.125]);
    // 3 · (3·1.375 + 3·1.5 + 2·1.125) / 16 = 32.625 / 16.
    assert_eq!(hf, 2.0390625);
    assert_eq!(aux_loss(&stats, t), 2.0390625);
}

#[test]
fn aux_loss_balanced_is_k() {
    let (t, e, k) = (4, 4, 2);
    let r = Routing {
        ids: vec![0, 1, 2, 3, 0, 1, 2, 3],
        gates: vec![0.5; 8],
        probs: vec![0.25; 16],
    };
    let stats = aux_stats(&r, t, e, k);
    assert_eq!(stats.counts, vec![2.0; 4]);
    // E · Σ_e (k/E)·(1/E) = k.
    assert_eq!(aux_loss(&stats, t), 2.0);
}

#[test]
fn dispatch_groups_by_expert_then_token() {
    let d = Dispatch::new(&hand_routing(), 4, 3, 2);
    assert_eq!(d.counts(), &[3, 3, 2]);
    assert_eq!(d.offsets(), &[0, 3, 6, 8]);
    assert_eq!(d.tokens(), &[0, 2, 3, 0, 1, 3, 1, 2]);
    for r in 0..d.len() {
        let (tok, s) = d.assignment(r);
        assert_eq!(d.row(tok, s), r);
    }
    assert_eq!(d.rows(2), 6..8);
}

#[test]
fn gather_and_scatter_are_adjoint() {
    let (t, e, k, h) = (9, 5, 2, 7);
    let r = route(&rand_vec(41, t * e, 2.0), t, e, k);
    let d = Dispatch::new(&r, t, e, k);
    let x = rand_vec(42, t * h, 1.0);
    let y = rand_vec(43, t * k * h, 1.0);
    let mut gx = vec![0.0; t * k * h];
    gather_rows(&mut gx, &x, h, &d);
    let mut sy = vec![0.0; t * h];
    scatter_add_rows(&mut sy, &y, h, &d);
    assert!((dot(&gx, &y) - dot(&x, &sy)).abs() < 1e-5);
}

#[test]
fn sharded_stats_match_whole() {
    let (t, e, k, coef) = (6, 4, 2, 0.3);
    let logits = rand_vec(51, t * e, 2.0);
    let whole = route(&logits, t, e, k);
    let stats = aux_stats(&whole, t, e, k);
    let mut d_whole = vec![0.0; t * e];
    aux_loss_backward(&mut d_whole, coef, &stats, t, &whole, t, e);

    let split = 2;
    let shards = [
        route(&logits[..split * e], split, e, k),
        route(&logits[split * e..], t - split, e, k),
    ];
    let mut global = aux_stats(&shards[0], split, e, k);
    global.add(&aux_stats(&shards[1], t - split, e, k));
    assert!((aux_loss(&global, t) - aux_loss(&stats, t)).abs() < 1e-6);
    let mut d_sharded = vec![0.0; t * e];
    let (d0, d1) = d_sharded.split_at_mut(split * e);
    aux_loss_backward(d0, coef, &global, t, &shards[0], split, e);
    aux_loss_backward(d1, coef, &global, t, &shards[1], t - split, e);
    for (a, b) in d_sharded.iter().zip(&d_whole) {
        assert!((a - b).abs() < 1e-6);
    }
}

/// Aux-loss-free balancing's bias picks the experts (by probability + bias) but not the
/// gates: those are the chosen experts' unbiased probabilities, renormalised, and the
/// backward is the same function of the routing.
#[test]
fn a_bias_changes_which_experts_are_chosen_but_not_their_gates() {
    // Probabilities of one token: expert 0 most probable, then 1, 2, 3.
    let logits = [2.0f32, 1.0, 0.5, 0.0];
    let plain = route(&logits, 1, 4, 2);
    assert_eq!(plain.ids, vec![0, 1]);
    assert_eq!(route_biased(&logits, Some(&[0.0; 4]), 1, 4, 2), plain);
    // A bias large enough to put experts 3 and 2 ahead of 0 and 1.
    let biased = route_biased(&logits, Some(&[0.0, 0.0, 0.5, 0.6]), 1, 4, 2);
    assert_eq!(biased.ids, vec![3, 2]);
    assert_eq!(
        biased.probs, plain.probs,
        "the probabilities are the router's"
    );
    let (p3, p2) = (plain.probs[3], plain.probs[2]);
    let want = [p3 / (p3 + p2), p2 / (p3 + p2)];
    for (g, w) in biased.gates.iter().zip(want) {
        assert!((g - w).abs() <= 1e-7, "{g} vs {w}");
    }
}

/// Over capacity an expert keeps its most probable assignments, ties to the earlier token;
/// the kept rows stay in token order, a dropped slot is [`DROPPED`], adds nothing to its
/// token's output and gets no gate gradient.
#[test]
fn capacity_keeps_the_most_probable_assignments() {
    // Four tokens, top-1 of two experts; expert 0 gets tokens 0, 1, 3 (probabilities 0.6,
    // 0.9, 0.6), expert 1 token 2.
    let r = Routing {
        ids: vec![0, 0, 1, 0],
        gates: vec![1.0; 4],
        probs: vec![0.6, 0.4, 0.9, 0.1, 0.3, 0.7, 0.6, 0.4],
    };
    let d = Dispatch::with_capacity(&r, (4, 2, 1), Some(2));
    assert_eq!(d.counts(), &[2, 1]);
    assert_eq!(d.tokens(), &[0, 1, 2], "token 3 loses the tie to token 0");
    assert_eq!(d.row_table(), &[0, 1, 2, DROPPED]);
    assert_eq!(d.dropped(), 1);
    let h = 2;
    let y = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let mut out = vec![9.0; 4 * h];
    combine_forward(&mut out, &y, h, &r, &d);
    assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]);
    let (mut dy, mut dg) = (vec![0.0; 3 * h], vec![9.0; 4]);
    combine_backward(&mut dy, &mut dg, &[1.0; 8], &y, h, &r, &d);
    assert_eq!(dg, [3.0, 7.0, 11.0, 0.0]);
    let mut dx = vec![0.0; 4 * h];
    scatter_add_rows(&mut dx, &y, h, &d);
    assert_eq!(dx, out, "the adjoint of the gather, dropped rows absent");
    // A capacity at or above every count drops nothing: the dropless plan.
    assert_eq!(
        Dispatch::with_capacity(&r, (4, 2, 1), Some(3)),
        Dispatch::new(&r, 4, 2, 1)
    );
}
