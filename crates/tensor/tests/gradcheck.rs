//! Every kernel's backward against central finite differences.
//!
//! Each check uses the scalar objective `L = Σ rᵢ·yᵢ` with fixed pseudo-random `r`, so `dy = r`.
//! Central differences with step 1e-2 in f32, objective summed in f64. Tolerance: each
//! derivative within `2e-3 + 1e-2·|analytic|` (f32 rounding of the outputs, ~1e-7 relative,
//! divided by the step, bounds the difference error well below that).

use ferrotron_tensor::attention::{attention_backward, attention_forward, AttnSaved, AttnShape};
use ferrotron_tensor::embedding::{embedding_backward, embedding_forward};
use ferrotron_tensor::linear::{linear_backward_input, linear_backward_weight, linear_forward};
use ferrotron_tensor::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use ferrotron_tensor::rope::{rope_apply, RopeTable};
use ferrotron_tensor::swiglu::{swiglu_backward, swiglu_forward};
use ferrotron_tensor::xent::{lm_head_xent, XentGrads};
use ferrotron_tensor::Ledger;

const STEP: f32 = 1e-2;

fn vals(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 + 1.0) * seed).sin() * 0.9)
        .collect()
}

fn dot(r: &[f32], y: &[f32]) -> f64 {
    r.iter().zip(y).map(|(a, b)| *a as f64 * *b as f64).sum()
}

/// Compares `analytic` with central differences of `objective` w.r.t. `x`.
fn check(name: &str, x: &mut [f32], analytic: &[f32], mut objective: impl FnMut(&[f32]) -> f64) {
    assert_eq!(x.len(), analytic.len());
    for i in 0..x.len() {
        let orig = x[i];
        x[i] = orig + STEP;
        let plus = objective(x);
        x[i] = orig - STEP;
        let minus = objective(x);
        x[i] = orig;
        let fd = (plus - minus) / (2.0 * STEP as f64);
        let an = analytic[i] as f64;
        assert!(
            (fd - an).abs() <= 2e-3 + 1e-2 * an.abs(),
            "{name}[{i}]: finite difference {fd} vs analytic {an}"
        );
    }
}

#[test]
fn linear() {
    let (t, i, o) = (3, 4, 5);
    let (mut x, mut w, r) = (vals(t * i, 0.3), vals(o * i, 0.7), vals(t * o, 1.3));
    let mut dx = vec![0.0; t * i];
    let mut dw = vec![0.0; o * i];
    linear_backward_input(&mut dx, &r, &w, t, i, o, false);
    linear_backward_weight(&mut dw, &r, &x, t, i, o);
    let f = |x: &[f32], w: &[f32]| {
        let mut y = vec![0.0; t * o];
        linear_forward(&mut y, x, w, t, i, o);
        dot(&r, &y)
    };
    let w0 = w.clone();
    check("dx", &mut x.clone(), &dx, |x| f(x, &w0));
    check("dw", &mut w, &dw, |w| f(&x, w));
    x[0] += 0.0;
}

#[test]
fn rmsnorm() {
    let (t, h) = (3, 8);
    let (mut x, mut w, r) = (vals(t * h, 0.3), vals(h, 0.7), vals(t * h, 1.3));
    let f = |x: &[f32], w: &[f32]| {
        let (mut y, mut s) = (vec![0.0; t * h], vec![0.0; t]);
        rmsnorm_forward(&mut y, &mut s, x, w, h, 1e-5);
        dot(&r, &y)
    };
    let (mut y, mut rstd) = (vec![0.0; t * h], vec![0.0; t]);
    rmsnorm_forward(&mut y, &mut rstd, &x, &w, h, 1e-5);
    let (mut dx, mut dw) = (vec![0.0; t * h], vec![0.0; h]);
    rmsnorm_backward(&mut dx, &mut dw, &r, &x, &rstd, &w, h, false);
    let w0 = w.clone();
    check("dx", &mut x.clone(), &dx, |x| f(x, &w0));
    check("dw", &mut w, &dw, |w| f(&x, w));
    x[0] += 0.0;
}

#[test]
fn rope() {
    let (t, heads, d) = (5, 2, 8);
    let table = RopeTable::new(16, d, 10000.0);
    let positions: Vec<usize> = (0..t).map(|i| i * 3).collect();
    let (mut x, r) = (vals(t * heads * d, 0.3), vals(t * heads * d, 1.3));
    let f = |x: &[f32]| {
        let mut y = x.to_vec();
        rope_apply(&mut y, &positions, heads, &table, false);
        dot(&r, &y)
    };
    let mut dx = r.clone();
    rope_apply(&mut dx, &positions, heads, &table, true);
    check("dx", &mut x, &dx, f);
}

#[test]
fn rope_matches_hugging_face_rotate_half() {
    // HF: q·cos + rotate_half(q)·sin with cos/sin repeated over both halves.
    let d = 4;
    let table = RopeTable::new(8, d, 10000.0);
    let mut x = vec![1.0, 2.0, 3.0, 4.0];
    rope_apply(&mut x, &[5], 1, &table, false);
    let inv = [1.0f64, 1.0 / 100.0];
    let ang = [5.0 * inv[0], 5.0 * inv[1]];
    let q = [1.0f64, 2.0, 3.0, 4.0];
    let rot = [-q[2], -q[3], q[0], q[1]];
    for i in 0..4 {
        let want = q[i] * ang[i % 2].cos() + rot[i] * ang[i % 2].sin();
        assert!((x[i] as f64 - want).abs() < 1e-5, "{i}: {} vs {want}", x[i]);
    }
}

#[test]
fn swiglu() {
    let n = 12;
    let (mut g, mut u, r) = (vals(n, 0.3), vals(n, 0.7), vals(n, 1.3));
    let f = |g: &[f32], u: &[f32]| {
        let mut a = vec![0.0; n];
        swiglu_forward(&mut a, g, u);
        dot(&r, &a)
    };
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    swiglu_backward(&mut dg, &mut du, &r, &g, &u);
    let u0 = u.clone();
    check("dgate", &mut g.clone(), &dg, |g| f(g, &u0));
    check("dup", &mut u, &du, |u| f(&g, u));
    g[0] += 0.0;
}

#[test]
fn embedding() {
    let (v, h) = (5, 3);
    let tokens = [1u32, 4, 1, 0];
    let (mut table, r) = (vals(v * h, 0.3), vals(tokens.len() * h, 1.3));
    let f = |tb: &[f32]| {
        let mut x = vec![0.0; tokens.len() * h];
        embedding_forward(&mut x, tb, &tokens, h);
        dot(&r, &x)
    };
    let mut dt = vec![0.0; v * h];
    embedding_backward(&mut dt, &r, &tokens, h);
    check("dtable", &mut table, &dt, f);
}

#[test]
fn lm_head_cross_entropy_in_chunks() {
    let (t, h, v) = (7, 4, 11);
    let ledger = Ledger::new();
    let targets: Vec<u32> = (0..t as u32).map(|i| (i * 5) % v as u32).collect();
    let (mut x, mut w) = (vals(t * h, 0.3), vals(v * h, 0.7));
    let scale = 0.5f32;
    let f = |x: &[f32], w: &[f32]| {
        scale as f64 * lm_head_xent(&Default::default(), &ledger, x, w, &targets, h, v, 3, None)
    };
    let (mut dx, mut dw) = (vec![0.0; t * h], vec![0.0; v * h]);
    let loss = lm_head_xent(
        &Default::default(),
        &ledger,
        &x,
        &w,
        &targets,
        h,
        v,
        3,
        Some(XentGrads {
            dx: &mut dx,
            dw: &mut dw,
            scale,
        }),
    );
    // Chunking does not change the loss.
    let whole = lm_head_xent(
        &Default::default(),
        &ledger,
        &x,
        &w,
        &targets,
        h,
        v,
        64,
        None,
    );
    assert!((loss - whole).abs() < 1e-9 * whole.abs());
    let w0 = w.clone();
    check("dx", &mut x.clone(), &dx, |x| f(x, &w0));
    check("dw", &mut w, &dw, |w| f(&x, w));
    x[0] += 0.0;
}

#[test]
fn attention_grouped_query_across_tiles() {
    // 70 tokens crosses the 64-wide tile edge; 4 query heads share 2 kv heads.
    let sh = AttnShape {
        batch: 2,
        seq: 70,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
    };
    let (qn, kn) = (
        sh.batch * sh.seq * sh.heads * sh.head_dim,
        sh.batch * sh.seq * sh.kv_heads * sh.head_dim,
    );
    let (mut q, mut k, mut v, r) = (
        vals(qn, 0.31),
        vals(kn, 0.77),
        vals(kn, 0.13),
        vals(qn, 1.3),
    );
    let f = |q: &[f32], k: &[f32], v: &[f32]| {
        let mut out = vec![0.0; qn];
        let mut lse = vec![0.0; sh.batch * sh.heads * sh.seq];
        attention_forward(&mut out, &mut lse, q, k, v, sh);
        dot(&r, &out)
    };
    let mut out = vec![0.0; qn];
    let mut lse = vec![0.0; sh.batch * sh.heads * sh.seq];
    attention_forward(&mut out, &mut lse, &q, &k, &v, sh);
    let (mut dq, mut dk, mut dv) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
    let saved: AttnSaved = AttnSaved {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &lse,
    };
    let mut delta = vec![0.0; lse.len()];
    attention_backward(&mut dq, &mut dk, &mut dv, &mut delta, &r, saved, sh);
    // Check a strided subset to keep the test fast; it still covers every head and both tiles.
    let (k0, v0) = (k.clone(), v.clone());
    let pick = |n: usize| (0..n).step_by(7).collect::<Vec<_>>();
    for i in pick(qn) {
        let mut one = [q[i]];
        let base = q.clone();
        check("dq", &mut one, &[dq[i]], |x| {
            let mut qq = base.clone();
            qq[i] = x[0];
            f(&qq, &k0, &v0)
        });
    }
    for i in pick(kn) {
        let mut one = [k[i]];
        check("dk", &mut one, &[dk[i]], |x| {
            let mut kk = k0.clone();
            kk[i] = x[0];
            f(&q, &kk, &v0)
        });
        let mut one = [v[i]];
        check("dv", &mut one, &[dv[i]], |x| {
            let mut vv = v0.clone();
            vv[i] = x[0];
            f(&q, &k0, &vv)
        });
    }
    q[0] += 0.0;
    k[0] += 0.0;
    v[0] += 0.0;
}
