// Causal attention blocks with global positions (`ring_attention.rs`), which flash attention
// over whole sequences is a case of (positions 0..s on both sides). Layouts: q, out, dq:
// [b, sq, heads, d]; k, v, dk, dv: [b, skv, kv_heads, d]; lse, delta: [b, heads, sq].
// Query row i sees key j when kv_pos[j] <= q_pos[i]. Grouped-query attention: query head hq
// reads kv head hq / (heads / kv_heads). head_dim at most 256.
//
// One warp per query row, keys in order with the online softmax; each lane holds d/32
// features. A row that sees no key gets out = 0 and lse = -inf.

#define MAX_PER_LANE 8

struct Shape {
    unsigned int batch, sq, skv, heads, kv_heads, d;
};

extern "C" __global__ void attention_block_forward(float* out, float* lse, const float* q,
                                                  const float* k, const float* v,
                                                  const u32* q_pos, const u32* kv_pos,
                                                  Shape sh, float scale) {
    unsigned int lane = threadIdx.x & 31;
    WarpRow w;
    if (!warp_row(sh.batch, sh.heads, sh.sq, &w)) return;
    unsigned long long task = w.task;
    unsigned int i = w.pos, hq = w.head, b = w.b;
    unsigned int hk = hq / (sh.heads / sh.kv_heads), d = sh.d;
    const float* qr = q + (((unsigned long long)b * sh.sq + i) * sh.heads + hq) * d;
    float qv[MAX_PER_LANE], acc[MAX_PER_LANE];
    for (int c = 0; c < MAX_PER_LANE; c++) {
        unsigned int f = lane + 32 * c;
        qv[c] = f < d ? qr[f] : 0.0f;
        acc[c] = 0.0f;
    }
    float mx = NEG_INF, sum = 0.0f;
    u32 qp = q_pos[i];
    for (unsigned int j = 0; j < sh.skv; j++) {
        if (kv_pos[j] > qp) continue;
        unsigned long long kr = (((unsigned long long)b * sh.skv + j) * sh.kv_heads + hk) * d;
        float s = 0.0f;
        for (int c = 0; c < MAX_PER_LANE; c++) {
            unsigned int f = lane + 32 * c;
            if (f < d) s += qv[c] * k[kr + f];
        }
        s = warp_sum(s) * scale;
        float m2 = fmaxf(mx, s);
        float alpha = expf(mx - m2), p = expf(s - m2);
        sum = sum * alpha + p;
        for (int c = 0; c < MAX_PER_LANE; c++) {
            unsigned int f = lane + 32 * c;
            if (f < d) acc[c] = acc[c] * alpha + p * v[kr + f];
        }
        mx = m2;
    }
    float* orow = out + (((unsigned long long)b * sh.sq + i) * sh.heads + hq) * d;
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int c = 0; c < MAX_PER_LANE; c++) {
        unsigned int f = lane + 32 * c;
        if (f < d) orow[f] = acc[c] * inv;
    }
    if (lane == 0)
        lse[((unsigned long long)b * sh.heads + hq) * sh.sq + i] =
            sum > 0.0f ? mx + logf(sum) : NEG_INF;
}

// Merges a partial result (part_out, part_lse) into (out, lse) with the online softmax.
extern "C" __global__ void attention_merge(float* out, float* lse, const float* part_out,
                                          const float* part_lse, Shape sh) {
    unsigned long long n = (unsigned long long)sh.batch * sh.sq * sh.heads * sh.d;
    GRID_STRIDE(e, n) {
        unsigned long long row = e / sh.d;  // (b, i, h)
        unsigned int h = (unsigned int)(row % sh.heads);
        unsigned long long bi = row / sh.heads;
        unsigned int i = (unsigned int)(bi % sh.sq), b = (unsigned int)(bi / sh.sq);
        unsigned long long idx = ((unsigned long long)b * sh.heads + h) * sh.sq + i;
        float l = lse[idx], pl = part_lse[idx];
        if (pl == NEG_INF) continue;
        if (l == NEG_INF) {
            out[e] = part_out[e];
            continue;
        }
        float m = fmaxf(l, pl) + log1pf(expf(fminf(l, pl) - fmaxf(l, pl)));
        out[e] = expf(l - m) * out[e] + expf(pl - m) * part_out[e];
    }
}

// lse = log(exp(lse) + exp(part_lse)), after `attention_merge` has read the old values.
extern "C" __global__ void attention_merge_lse(float* lse, const float* part_lse,
                                              unsigned long long n) {
    GRID_STRIDE(i, n) {
        float l = lse[i], pl = part_lse[i];
        if (pl == NEG_INF) continue;
        if (l == NEG_INF) {
            lse[i] = pl;
            continue;
        }
        float hi = fmaxf(l, pl), lo = fminf(l, pl);
        lse[i] = hi + log1pf(expf(lo - hi));
    }
}

// delta[b, h, i] = dout . out of the row. One warp per row.
extern "C" __global__ void attention_delta(float* delta, const float* dout, const float* out,
                                          Shape sh) {
    unsigned int lane = threadIdx.x & 31;
    WarpRow w;
    if (!warp_row(sh.batch, sh.heads, sh.sq, &w)) return;
    unsigned long long task = w.task;
    unsigned int i = w.pos, h = w.head, b = w.b;
    unsigned long long r = (((unsigned long long)b * sh.sq + i) * sh.heads + h) * sh.d;
    float acc = 0.0f;
    for (unsigned int f = lane; f < sh.d; f += 32) acc += dout[r + f] * out[r + f];
    acc = warp_sum(acc);
    if (lane == 0) delta[task] = acc;
}

// p and ds = p * (dp - delta) of query row i against key j (both warp-wide values).
__device__ __forceinline__ void probs(const float* qr, const float* kr, const float* dor,
                                      const float* vr, unsigned int d, float scale, float l,
                                      float dl, float* p, float* ds) {
    unsigned int lane = threadIdx.x & 31;
    float s = 0.0f, dp = 0.0f;
    for (unsigned int f = lane; f < d; f += 32) {
        s += qr[f] * kr[f];
        dp += dor[f] * vr[f];
    }
    s = warp_sum(s);
    dp = warp_sum(dp);
    *p = expf(s * scale - l);
    *ds = *p * (dp - dl);
}

// dq[row] += scale * sum_j ds_ij k_j. One warp per query row (keys in order).
extern "C" __global__ void attention_block_backward_q(float* dq, const float* dout,
                                                     const float* q, const float* k,
                                                     const float* v, const float* lse,
                                                     const float* delta, const u32* q_pos,
                                                     const u32* kv_pos, Shape sh, float scale) {
    unsigned int lane = threadIdx.x & 31;
    WarpRow w;
    if (!warp_row(sh.batch, sh.heads, sh.sq, &w)) return;
    unsigned long long task = w.task;
    unsigned int i = w.pos, hq = w.head, b = w.b;
    unsigned int hk = hq / (sh.heads / sh.kv_heads), d = sh.d;
    float l = lse[task], dl = delta[task];
    if (l == NEG_INF) return;
    unsigned long long qr = (((unsigned long long)b * sh.sq + i) * sh.heads + hq) * d;
    float acc[MAX_PER_LANE];
    for (int c = 0; c < MAX_PER_LANE; c++) acc[c] = 0.0f;
    for (unsigned int j = 0; j < sh.skv; j++) {
        if (kv_pos[j] > q_pos[i]) continue;
        unsigned long long kr = (((unsigned long long)b * sh.skv + j) * sh.kv_heads + hk) * d;
        float p, ds;
        probs(q + qr, k + kr, dout + qr, v + kr, d, scale, l, dl, &p, &ds);
        for (int c = 0; c < MAX_PER_LANE; c++) {
            unsigned int f = lane + 32 * c;
            if (f < d) acc[c] += ds * k[kr + f];
        }
    }
    for (int c = 0; c < MAX_PER_LANE; c++) {
        unsigned int f = lane + 32 * c;
        if (f < d) dq[qr + f] += scale * acc[c];
    }
}

// dk[row] = scale * sum ds_ij q_i and dv[row] = sum p_ij dout_i over every query row i of the
// kv head's query heads (overwritten). One warp per key row.
extern "C" __global__ void attention_block_backward_kv(float* dk, float* dv, const float* dout,
                                                      const float* q, const float* k,
                                                      const float* v, const float* lse,
                                                      const float* delta, const u32* q_pos,
                                                      const u32* kv_pos, Shape sh,
                                                      float scale) {
    unsigned int lane = threadIdx.x & 31;
    WarpRow w;
    if (!warp_row(sh.batch, sh.kv_heads, sh.skv, &w)) return;
    unsigned int j = w.pos, hk = w.head, b = w.b;
    unsigned int group = sh.heads / sh.kv_heads, d = sh.d;
    unsigned long long kr = (((unsigned long long)b * sh.skv + j) * sh.kv_heads + hk) * d;
    float gk[MAX_PER_LANE], gv[MAX_PER_LANE];
    for (int c = 0; c < MAX_PER_LANE; c++) gk[c] = gv[c] = 0.0f;
    for (unsigned int hq = hk * group; hq < (hk + 1) * group; hq++) {
        for (unsigned int i = 0; i < sh.sq; i++) {
            if (kv_pos[j] > q_pos[i]) continue;
            unsigned long long row = ((unsigned long long)b * sh.heads + hq) * sh.sq + i;
            float l = lse[row];
            if (l == NEG_INF) continue;
            unsigned long long qr = (((unsigned long long)b * sh.sq + i) * sh.heads + hq) * d;
            float p, ds;
            probs(q + qr, k + kr, dout + qr, v + kr, d, scale, l, delta[row], &p, &ds);
            for (int c = 0; c < MAX_PER_LANE; c++) {
                unsigned int f = lane + 32 * c;
                if (f < d) {
                    gk[c] += ds * q[qr + f];
                    gv[c] += p * dout[qr + f];
                }
            }
        }
    }
    for (int c = 0; c < MAX_PER_LANE; c++) {
        unsigned int f = lane + 32 * c;
        if (f < d) {
            dk[kr + f] = scale * gk[c];
            dv[kr + f] = gv[c];
        }
    }
}
