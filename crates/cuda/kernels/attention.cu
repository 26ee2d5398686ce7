// Causal attention blocks with global positions (`ring_attention.rs`), which flash attention
// over whole sequences is a case of (positions 0..s on both sides). Layouts: q, out, dq:
// [b, sq, heads, d]; k, v, dk, dv: [b, skv, kv_heads, d]; lse, delta: [b, heads, sq].
// Query row i sees key j when kv_pos[j] <= q_pos[i]; under document masking q_start (else
// null) holds each query's document start, [b, sq], and keys before it are hidden too
// (`KvBlock::q_start`). Grouped-query attention: query head hq
// reads kv head hq / (heads / kv_heads). head_dim at most 256.
//
// One warp per query row, keys in order with the online softmax; each lane holds d/32
// features. A row that sees no key gets out = 0 and lse = -inf.

#define MAX_PER_LANE 8

struct Shape {
    unsigned int batch, sq, skv, heads, kv_heads, d;
};

// The first key position query row i of sequence b sees: its document's start, or 0.
__device__ __forceinline__ u32 row_start(const u32* q_start, Shape sh, unsigned int b,
                                         unsigned int i) {
    return q_start ? q_start[(unsigned long long)b * sh.sq + i] : 0u;
}

extern "C" __global__ void attention_block_forward(float* out, float* lse, const float* q,
                                                  const float* k, const float* v,
                                                  const u32* q_pos, const u32* kv_pos,
                                                  const u32* q_start, Shape sh, float scale) {
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
    u32 qp = q_pos[i], q0 = row_start(q_start, sh, b, i);
    for (unsigned int j = 0; j < sh.skv; j++) {
        if (kv_pos[j] > qp || kv_pos[j] < q0) continue;
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
                                                     const u32* kv_pos, const u32* q_start,
                                                     Shape sh, float scale) {
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
    u32 q0 = row_start(q_start, sh, b, i);
    for (unsigned int j = 0; j < sh.skv; j++) {
        if (kv_pos[j] > q_pos[i] || kv_pos[j] < q0) continue;
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
                                                      const u32* kv_pos, const u32* q_start,
                                                      Shape sh, float scale) {
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
            if (kv_pos[j] > q_pos[i] || kv_pos[j] < row_start(q_start, sh, b, i)) continue;
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

// ---- Tiled kernels for head_dim <= 64 (flash attention's blocking, f32 FMAs) ----
// A block of 256 threads works on a tile of TB query rows (or key rows) and walks the tiles of
// the other side, keeping them in shared memory. Thread (ty, tx) = (threadIdx.x / 16,
// threadIdx.x % 16) holds rows ty*2, ty*2+1 of a 32 × 32 score tile against columns tx*2,
// tx*2+1, and features tx*4 .. tx*4+3 of a 32 × 64 result tile. Transposed tiles
// (feature-major, t[f * TP + r]) feed the score products; row-major ones (r[row * TD + f])
// the products with values. Features past head_dim and rows past the sequence are zeros;
// a tile of keys wholly after a tile's last query position is skipped. Same results as the
// kernels above up to f32 rounding (the sums run in another order).

#define TD 64
#define TB 32
#define TP (TB + 4)

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
    for (int o = 16; o > 0; o >>= 1) {
        u32 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

__device__ __forceinline__ u32 warp_min_u32(u32 v) {
    for (int o = 16; o > 0; o >>= 1) {
        u32 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// Max or sum over the 16 threads that share a row (lanes differing in their low 4 bits).
__device__ __forceinline__ float row_max16(float v) {
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float row_sum16(float v) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Rows r0 .. r0 + TB of `src` (row r at src[r * stride]), transposed: t[f * TP + r].
__device__ __forceinline__ void tile_t(float* t, const float* src, unsigned long long stride,
                                       unsigned int r0, unsigned int n, unsigned int d) {
    for (unsigned int e = threadIdx.x; e < TB * TD; e += blockDim.x) {
        unsigned int r = e / TD, f = e % TD;
        t[f * TP + r] = (r0 + r < n && f < d) ? src[(unsigned long long)(r0 + r) * stride + f] : 0.0f;
    }
}

// Rows r0 .. r0 + TB of `src`, row-major: t[r * TD + f].
__device__ __forceinline__ void tile_rows(float* t, const float* src, unsigned long long stride,
                                          unsigned int r0, unsigned int n, unsigned int d) {
    for (unsigned int e = threadIdx.x; e < TB * TD; e += blockDim.x) {
        unsigned int r = e / TD, f = e % TD;
        t[e] = (r0 + r < n && f < d) ? src[(unsigned long long)(r0 + r) * stride + f] : 0.0f;
    }
}

// Positions of rows r0 .. r0 + TB into pos (`pad` past n) and, by warp 0, their max (for query
// rows, pad 0) or min (for key rows, pad all ones) into *bound. Called by every thread.
__device__ __forceinline__ void tile_positions(u32* pos, u32* bound, const u32* src,
                                               unsigned int r0, unsigned int n, bool keys) {
    if (threadIdx.x < TB) {
        unsigned int r = r0 + threadIdx.x;
        u32 pad = keys ? 0xffffffffu : 0u;
        u32 p = r < n ? src[r] : pad;
        pos[threadIdx.x] = p;
        p = keys ? warp_min_u32(p) : warp_max_u32(p);
        if (threadIdx.x == 0) *bound = p;
    }
}

// Document starts of query rows r0 .. r0 + TB of sequence b into st (0 without masking or
// past n). Called by every thread.
__device__ __forceinline__ void tile_starts(u32* st, const u32* q_start, Shape sh,
                                            unsigned int b, unsigned int r0) {
    if (threadIdx.x < TB) {
        unsigned int r = r0 + threadIdx.x;
        st[threadIdx.x] = r < sh.sq ? row_start(q_start, sh, b, r) : 0u;
    }
}

// The 2 × 2 products of a thread: acc[a][b] += sum_f x[f * TP + rx + a] * y[f * TP + ry + b].
__device__ __forceinline__ void scores(float acc[2][2], const float* x, const float* y,
                                       unsigned int rx, unsigned int ry, unsigned int d) {
    for (unsigned int f = 0; f < d; f++) {
        float2 a = *reinterpret_cast<const float2*>(&x[f * TP + rx]);
        float2 b = *reinterpret_cast<const float2*>(&y[f * TP + ry]);
        acc[0][0] += a.x * b.x;
        acc[0][1] += a.x * b.y;
        acc[1][0] += a.y * b.x;
        acc[1][1] += a.y * b.y;
    }
}

// acc[a][f] += sum_c w[c * stride + ra + a] * rows[c * TD + fx + f]: a thread's 2 × 4 block of
// a product whose left factor is stored with its summed index first.
__device__ __forceinline__ void gather(float acc[2][4], const float* w, unsigned int stride,
                                       unsigned int ra, const float* rows, unsigned int fx) {
    for (unsigned int c = 0; c < TB; c++) {
        float2 a = *reinterpret_cast<const float2*>(&w[c * stride + ra]);
        float4 b = *reinterpret_cast<const float4*>(&rows[c * TD + fx]);
        acc[0][0] += a.x * b.x;
        acc[0][1] += a.x * b.y;
        acc[0][2] += a.x * b.z;
        acc[0][3] += a.x * b.w;
        acc[1][0] += a.y * b.x;
        acc[1][1] += a.y * b.y;
        acc[1][2] += a.y * b.z;
        acc[1][3] += a.y * b.w;
    }
}

// Grid (ceil(sq / TB), heads, batch): the forward of one tile of query rows.
extern "C" __global__ void attention_tile_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const u32* q_pos, const u32* kv_pos, const u32* q_start, Shape sh, float scale) {
    __shared__ __align__(16) float qt[TD * TP];
    __shared__ __align__(16) float kv[TD * TP];  // K transposed, then V row-major
    __shared__ __align__(16) float pt[TB * TP];  // P transposed: pt[c * TP + r]
    __shared__ u32 qp[TB], qst[TB], kp[TB], last_q, first_k;
    unsigned int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    unsigned int i0 = blockIdx.x * TB, hq = blockIdx.y, b = blockIdx.z;
    unsigned int hk = hq / (sh.heads / sh.kv_heads), d = sh.d;
    unsigned long long qs = (unsigned long long)sh.heads * d, ks = (unsigned long long)sh.kv_heads * d;
    const float* qb = q + ((unsigned long long)b * sh.sq * sh.heads + hq) * d;
    const float* kb = k + ((unsigned long long)b * sh.skv * sh.kv_heads + hk) * d;
    const float* vb = v + ((unsigned long long)b * sh.skv * sh.kv_heads + hk) * d;
    tile_t(qt, qb, qs, i0, sh.sq, d);
    tile_positions(qp, &last_q, q_pos, i0, sh.sq, false);
    tile_starts(qst, q_start, sh, b, i0);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f}, acc[2][4] = {};
    for (unsigned int j0 = 0; j0 < sh.skv; j0 += TB) {
        __syncthreads();
        tile_positions(kp, &first_k, kv_pos, j0, sh.skv, true);
        __syncthreads();
        if (first_k > last_q) continue;
        tile_t(kv, kb, ks, j0, sh.skv, d);
        __syncthreads();
        float s[2][2] = {};
        scores(s, qt, kv, ty * 2, tx * 2, d);
        for (int a = 0; a < 2; a++) {
            unsigned int r = ty * 2 + a;
            float x[2];
            for (int c = 0; c < 2; c++) {
                unsigned int col = tx * 2 + c;
                bool seen = i0 + r < sh.sq && j0 + col < sh.skv && kp[col] <= qp[r] &&
                            kp[col] >= qst[r];
                x[c] = seen ? s[a][c] * scale : NEG_INF;
            }
            float mn = fmaxf(m[a], row_max16(fmaxf(x[0], x[1])));
            float alpha = 1.0f, p0 = 0.0f, p1 = 0.0f;
            if (mn != NEG_INF) {
                alpha = expf(m[a] - mn);
                p0 = expf(x[0] - mn);
                p1 = expf(x[1] - mn);
            }
            l[a] = l[a] * alpha + row_sum16(p0 + p1);
            m[a] = mn;
            for (int f = 0; f < 4; f++) acc[a][f] *= alpha;
            pt[(tx * 2) * TP + r] = p0;
            pt[(tx * 2 + 1) * TP + r] = p1;
        }
        __syncthreads();
        tile_rows(kv, vb, ks, j0, sh.skv, d);
        __syncthreads();
        gather(acc, pt, TP, ty * 2, kv, tx * 4);
    }
    for (int a = 0; a < 2; a++) {
        unsigned int i = i0 + ty * 2 + a;
        if (i >= sh.sq) continue;
        float* orow = out + (((unsigned long long)b * sh.sq + i) * sh.heads + hq) * d;
        float inv = l[a] > 0.0f ? 1.0f / l[a] : 0.0f;
        for (int f = 0; f < 4; f++)
            if (tx * 4 + f < d) orow[tx * 4 + f] = acc[a][f] * inv;
        if (tx == 0)
            lse[((unsigned long long)b * sh.heads + hq) * sh.sq + i] =
                l[a] > 0.0f ? m[a] + logf(l[a]) : NEG_INF;
    }
}

// lse and delta of rows r0 .. r0 + TB of head h (lse −∞ past n: nothing seen).
__device__ __forceinline__ void tile_stats(float* ls, float* dl, const float* lse,
                                           const float* delta, unsigned long long base,
                                           unsigned int r0, unsigned int n) {
    if (threadIdx.x < TB) {
        unsigned int r = r0 + threadIdx.x;
        ls[threadIdx.x] = r < n ? lse[base + r] : NEG_INF;
        dl[threadIdx.x] = r < n ? delta[base + r] : 0.0f;
    }
}

// Grid (ceil(sq / TB), heads, batch): dq of one tile of query rows, added to dq.
extern "C" __global__ void attention_tile_backward_q(float* dq, const float* dout, const float* q, const float* k,
                          const float* v, const float* lse, const float* delta,
                          const u32* q_pos, const u32* kv_pos, const u32* q_start, Shape sh, float scale) {
    __shared__ __align__(16) float qt[TD * TP], dot[TD * TP];
    __shared__ __align__(16) float kt[TD * TP];  // K transposed, then row-major
    __shared__ __align__(16) float vt[TD * TP];
    __shared__ __align__(16) float dst[TB * TP];  // dS transposed: dst[c * TP + r]
    __shared__ u32 qp[TB], qst[TB], kp[TB], last_q, first_k;
    __shared__ float ls[TB], dl[TB];
    unsigned int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    unsigned int i0 = blockIdx.x * TB, hq = blockIdx.y, b = blockIdx.z;
    unsigned int hk = hq / (sh.heads / sh.kv_heads), d = sh.d;
    unsigned long long qs = (unsigned long long)sh.heads * d, ks = (unsigned long long)sh.kv_heads * d;
    unsigned long long qoff = ((unsigned long long)b * sh.sq * sh.heads + hq) * d;
    unsigned long long koff = ((unsigned long long)b * sh.skv * sh.kv_heads + hk) * d;
    tile_t(qt, q + qoff, qs, i0, sh.sq, d);
    tile_t(dot, dout + qoff, qs, i0, sh.sq, d);
    tile_positions(qp, &last_q, q_pos, i0, sh.sq, false);
    tile_starts(qst, q_start, sh, b, i0);
    tile_stats(ls, dl, lse, delta, ((unsigned long long)b * sh.heads + hq) * sh.sq, i0, sh.sq);
    float acc[2][4] = {};
    for (unsigned int j0 = 0; j0 < sh.skv; j0 += TB) {
        __syncthreads();
        tile_positions(kp, &first_k, kv_pos, j0, sh.skv, true);
        __syncthreads();
        if (first_k > last_q) continue;
        tile_t(kt, k + koff, ks, j0, sh.skv, d);
        tile_t(vt, v + koff, ks, j0, sh.skv, d);
        __syncthreads();
        float s[2][2] = {}, dp[2][2] = {};
        scores(s, qt, kt, ty * 2, tx * 2, d);
        scores(dp, dot, vt, ty * 2, tx * 2, d);
        for (int a = 0; a < 2; a++)
            for (int c = 0; c < 2; c++) {
                unsigned int r = ty * 2 + a, col = tx * 2 + c;
                bool seen = j0 + col < sh.skv && kp[col] <= qp[r] && kp[col] >= qst[r] &&
                            ls[r] != NEG_INF;
                float p = seen ? expf(s[a][c] * scale - ls[r]) : 0.0f;
                dst[col * TP + r] = p * (dp[a][c] - dl[r]);
            }
        __syncthreads();
        tile_rows(kt, k + koff, ks, j0, sh.skv, d);
        __syncthreads();
        gather(acc, dst, TP, ty * 2, kt, tx * 4);
    }
    for (int a = 0; a < 2; a++) {
        unsigned int r = ty * 2 + a, i = i0 + r;
        if (i >= sh.sq || ls[r] == NEG_INF) continue;
        float* row = dq + qoff + (unsigned long long)i * qs;
        for (int f = 0; f < 4; f++)
            if (tx * 4 + f < d) row[tx * 4 + f] += scale * acc[a][f];
    }
}

// Grid (ceil(skv / TB), kv_heads, batch): dk and dv of one tile of key rows over every query
// row of the kv head's query heads (overwritten).
extern "C" __global__ void attention_tile_backward_kv(float* dk, float* dv, const float* dout, const float* q,
                           const float* k, const float* v, const float* lse,
                           const float* delta, const u32* q_pos, const u32* kv_pos,
                           const u32* q_start, Shape sh, float scale) {
    __shared__ __align__(16) float kt[TD * TP], vt[TD * TP];
    __shared__ __align__(16) float qt[TD * TP], dot[TD * TP];  // transposed, then row-major
    __shared__ __align__(16) float ps[TB * TP], dss[TB * TP];  // P, dS by query row: ps[r * TP + c]
    __shared__ u32 qp[TB], qst[TB], kp[TB], last_q, first_k;
    __shared__ float ls[TB], dl[TB];
    unsigned int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    unsigned int j0 = blockIdx.x * TB, hk = blockIdx.y, b = blockIdx.z;
    unsigned int group = sh.heads / sh.kv_heads, d = sh.d;
    unsigned long long qs = (unsigned long long)sh.heads * d, ks = (unsigned long long)sh.kv_heads * d;
    unsigned long long koff = ((unsigned long long)b * sh.skv * sh.kv_heads + hk) * d;
    tile_t(kt, k + koff, ks, j0, sh.skv, d);
    tile_t(vt, v + koff, ks, j0, sh.skv, d);
    tile_positions(kp, &first_k, kv_pos, j0, sh.skv, true);
    float gk[2][4] = {}, gv[2][4] = {};
    for (unsigned int hq = hk * group; hq < (hk + 1) * group; hq++) {
        unsigned long long qoff = ((unsigned long long)b * sh.sq * sh.heads + hq) * d;
        for (unsigned int i0 = 0; i0 < sh.sq; i0 += TB) {
            __syncthreads();
            tile_positions(qp, &last_q, q_pos, i0, sh.sq, false);
            tile_starts(qst, q_start, sh, b, i0);
            tile_stats(ls, dl, lse, delta, ((unsigned long long)b * sh.heads + hq) * sh.sq, i0, sh.sq);
            __syncthreads();
            if (first_k > last_q) continue;
            tile_t(qt, q + qoff, qs, i0, sh.sq, d);
            tile_t(dot, dout + qoff, qs, i0, sh.sq, d);
            __syncthreads();
            // This thread's scores: keys ty*2 + a against query rows tx*2 + c.
            float s[2][2] = {}, dp[2][2] = {};
            scores(s, kt, qt, ty * 2, tx * 2, d);
            scores(dp, vt, dot, ty * 2, tx * 2, d);
            for (int a = 0; a < 2; a++)
                for (int c = 0; c < 2; c++) {
                    unsigned int key = ty * 2 + a, r = tx * 2 + c;
                    bool seen = j0 + key < sh.skv && kp[key] <= qp[r] && kp[key] >= qst[r] &&
                                ls[r] != NEG_INF;
                    float p = seen ? expf(s[a][c] * scale - ls[r]) : 0.0f;
                    ps[r * TP + key] = p;
                    dss[r * TP + key] = p * (dp[a][c] - dl[r]);
                }
            __syncthreads();
            tile_rows(qt, q + qoff, qs, i0, sh.sq, d);
            tile_rows(dot, dout + qoff, qs, i0, sh.sq, d);
            __syncthreads();
            gather(gv, ps, TP, ty * 2, dot, tx * 4);
            gather(gk, dss, TP, ty * 2, qt, tx * 4);
        }
    }
    for (int a = 0; a < 2; a++) {
        unsigned int j = j0 + ty * 2 + a;
        if (j >= sh.skv) continue;
        unsigned long long row = koff + (unsigned long long)j * ks;
        for (int f = 0; f < 4; f++)
            if (tx * 4 + f < d) {
                dk[row + tx * 4 + f] = scale * gk[a][f];
                dv[row + tx * 4 + f] = gv[a][f];
            }
    }
}
