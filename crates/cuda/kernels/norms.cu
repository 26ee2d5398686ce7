// RMSNorm (`rmsnorm.rs`) and RoPE (`rope.rs`). A row is one token's `h` features.

// y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps). One block per row.
extern "C" __global__ void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w,
                                          unsigned int h, float eps) {
    const float* xr = x + (unsigned long long)blockIdx.x * h;
    float* yr = y + (unsigned long long)blockIdx.x * h;
    float ss = 0.0f;
    for (unsigned int i = threadIdx.x; i < h; i += blockDim.x) ss += xr[i] * xr[i];
    float r = rsqrtf(block_sum(ss) / (float)h + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    for (unsigned int i = threadIdx.x; i < h; i += blockDim.x) yr[i] = xr[i] * r * w[i];
}

// The normed rows again from the saved reciprocal RMS (selective recomputation).
extern "C" __global__ void rmsnorm_apply(float* y, const float* x, const float* rstd,
                                        const float* w, unsigned int h) {
    unsigned long long off = (unsigned long long)blockIdx.x * h;
    float r = rstd[blockIdx.x];
    for (unsigned int i = threadIdx.x; i < h; i += blockDim.x) y[off + i] = x[off + i] * r * w[i];
}

// dx = rstd * (dy * w - n * mean(dy * w * n)), n = x * rstd; written or added. One block
// per row. The weight gradient is `rmsnorm_backward_weight`'s.
extern "C" __global__ void rmsnorm_backward_input(float* dx, const float* dy, const float* x,
                                                 const float* rstd, const float* w,
                                                 unsigned int h, int accumulate) {
    unsigned long long off = (unsigned long long)blockIdx.x * h;
    float r = rstd[blockIdx.x];
    float dot = 0.0f;
    for (unsigned int i = threadIdx.x; i < h; i += blockDim.x)
        dot += dy[off + i] * w[i] * x[off + i] * r;
    float mean = block_sum(dot) / (float)h;
    for (unsigned int i = threadIdx.x; i < h; i += blockDim.x) {
        float n = x[off + i] * r;
        float g = r * (dy[off + i] * w[i] - n * mean);
        dx[off + i] = accumulate ? dx[off + i] + g : g;
    }
}

// dw[i] += sum over rows of dy * x * rstd. A block per 32 features: warp w sums rows w,
// w + warps, ... of its lane's feature (each row's 32 features one coalesced load), then
// the warps' sums are added in warp order, so the result does not depend on timing.
extern "C" __global__ void rmsnorm_backward_weight(float* dw, const float* dy, const float* x,
                                                  const float* rstd, unsigned int rows,
                                                  unsigned int h) {
    __shared__ float part[32][33];
    unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    unsigned int i = blockIdx.x * 32 + lane;
    float acc = 0.0f;
    if (i < h) {
        for (unsigned int t = warp; t < rows; t += warps) {
            unsigned long long j = (unsigned long long)t * h + i;
            acc += dy[j] * x[j] * rstd[t];
        }
    }
    part[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && i < h) {
        float sum = 0.0f;
        for (unsigned int w = 0; w < warps; w++) sum += part[w][lane];
        dw[i] += sum;
    }
}

// Rotates x ([rows, heads, 2*half]) in place: feature i of a head pairs with i + half, both
// rotated by the angle of the row's position (`cos`, `sin`: [positions, half]). `inverse`
// applies the transposed rotation (the backward).
extern "C" __global__ void rope(float* x, const u32* positions, unsigned int rows,
                               unsigned int heads, unsigned int half, const float* cos_t,
                               const float* sin_t, int inverse) {
    unsigned long long n = (unsigned long long)rows * heads * half;
    float sign = inverse ? -1.0f : 1.0f;
    GRID_STRIDE(k, n) {
        unsigned int i = (unsigned int)(k % half);
        unsigned long long rh = k / half;  // row * heads + head
        unsigned int row = (unsigned int)(rh / heads);
        unsigned long long base = rh * 2ull * half;
        unsigned long long tab = (unsigned long long)positions[row] * half + i;
        float c = cos_t[tab], s = sign * sin_t[tab];
        float x1 = x[base + i], x2 = x[base + half + i];
        x[base + i] = x1 * c - x2 * s;
        x[base + half + i] = x2 * c + x1 * s;
    }
}

// Token rows of the embedding table (`embedding.rs`): rows of tokens outside this rank's
// vocabulary slice [v0, v0 + vl) are zero. The whole table: v0 = 0, vl = vocab.
extern "C" __global__ void embedding_forward(float* x, const float* table, const u32* tokens,
                                            unsigned int t, unsigned int h, unsigned int v0,
                                            unsigned int vl) {
    unsigned long long n = (unsigned long long)t * h;
    GRID_STRIDE(k, n) {
        unsigned int tok = tokens[k / h];
        x[k] = (tok >= v0 && tok < v0 + vl) ? table[(unsigned long long)(tok - v0) * h + k % h]
                                            : 0.0f;
    }
}

// dtable[token] += dx row, for the tokens in [v0, v0 + vl). Atomic adds: tokens repeat.
extern "C" __global__ void embedding_backward(float* dtable, const float* dx, const u32* tokens,
                                             unsigned int t, unsigned int h, unsigned int v0,
                                             unsigned int vl) {
    unsigned long long n = (unsigned long long)t * h;
    GRID_STRIDE(k, n) {
        unsigned int tok = tokens[k / h];
        if (tok >= v0 && tok < v0 + vl)
            atomicAdd(&dtable[(unsigned long long)(tok - v0) * h + k % h], dx[k]);
    }
}
