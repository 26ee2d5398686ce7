// A mixture of experts' row movement (`moe/dispatch.rs`). Tables from `Dispatch`: token[r],
// the token of grouped row r ([t*k] less the dropped); row[a], the grouped row of assignment
// a = token*k + slot, or DROPPED when its expert was over capacity (it then adds nothing).
#define DROPPED 0xFFFFFFFFu

// dst[r] = src[token[r]] (rows of h).
extern "C" __global__ void moe_gather_rows(float* dst, const float* src, const u32* token,
                                          unsigned int rows, unsigned int h) {
    unsigned long long n = (unsigned long long)rows * h;
    GRID_STRIDE(k, n) dst[k] = src[(unsigned long long)token[k / h] * h + k % h];
}

// dst[tok] += sum over its k slots of src[row[tok*k + s]]. One thread per (token, feature).
extern "C" __global__ void moe_scatter_add_rows(float* dst, const float* src, const u32* row,
                                               unsigned int t, unsigned int h, unsigned int k) {
    unsigned long long n = (unsigned long long)t * h;
    GRID_STRIDE(e, n) {
        unsigned int tok = (unsigned int)(e / h), i = (unsigned int)(e % h);
        float acc = 0.0f;
        for (unsigned int s = 0; s < k; s++) {
            unsigned int r = row[tok * k + s];
            if (r != DROPPED) acc += src[(unsigned long long)r * h + i];
        }
        dst[e] += acc;
    }
}

// out[tok] = sum over slots of gate * expert_out[row].
extern "C" __global__ void moe_combine_forward(float* out, const float* expert_out,
                                              const u32* row, const float* gates,
                                              unsigned int t, unsigned int h, unsigned int k) {
    unsigned long long n = (unsigned long long)t * h;
    GRID_STRIDE(e, n) {
        unsigned int tok = (unsigned int)(e / h), i = (unsigned int)(e % h);
        float acc = 0.0f;
        for (unsigned int s = 0; s < k; s++) {
            unsigned int r = row[tok * k + s];
            if (r != DROPPED) acc += gates[tok * k + s] * expert_out[(unsigned long long)r * h + i];
        }
        out[e] = acc;
    }
}

// d_expert_out[row] = gate * d_out[tok]; d_gates[a] = d_out[tok] . expert_out[row]. One
// warp per assignment a = tok*k + s.
extern "C" __global__ void moe_combine_backward(float* d_expert_out, float* d_gates,
                                               const float* d_out, const float* expert_out,
                                               const u32* row, const float* gates,
                                               unsigned int t, unsigned int h, unsigned int k) {
    unsigned int warps = blockDim.x / 32, lane = threadIdx.x & 31;
    unsigned int a = blockIdx.x * warps + threadIdx.x / 32;
    if (a >= t * k) return;
    unsigned int tok = a / k;
    if (row[a] == DROPPED) {
        if (lane == 0) d_gates[a] = 0.0f;
        return;
    }
    unsigned long long r = (unsigned long long)row[a] * h, o = (unsigned long long)tok * h;
    float g = gates[a], dot = 0.0f;
    for (unsigned int i = lane; i < h; i += 32) {
        d_expert_out[r + i] = g * d_out[o + i];
        dot += d_out[o + i] * expert_out[r + i];
    }
    dot = warp_sum(dot);
    if (lane == 0) d_gates[a] = dot;
}
