// Element-wise kernels: copies, fills, sums, scaling, the f32 <-> bf16 and f32 <-> f16 casts, the residual
// add, biases and SwiGLU. One thread per element (grid-stride). Match `elementwise.rs`,
// `store.rs` and `swiglu.rs`.

extern "C" __global__ void copy_f32(float* dst, const float* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = src[i];
}

extern "C" __global__ void copy_bf16(bf16_t* dst, const bf16_t* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = src[i];
}

extern "C" __global__ void fill_f32(float* dst, float value, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = value;
}

extern "C" __global__ void fill_bf16(bf16_t* dst, bf16_t value, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = value;
}

extern "C" __global__ void add_f32(float* out, const float* a, const float* b,
                                  unsigned long long n) {
    GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

// y[i, :] += b (y: [rows, n]): a linear layer's bias. Matches `linear.rs`.
extern "C" __global__ void bias_forward_f32(float* y, const float* b, unsigned long long n,
                                           unsigned long long total) {
    GRID_STRIDE(i, total) y[i] += b[i % n];
}

// db += sum over rows of dy (dy: [rows, n]), one thread per column, rows in order: the same
// sums, in the same order, as the CPU's `bias_backward`.
extern "C" __global__ void bias_backward_f32(float* db, const float* dy, unsigned long long n,
                                            unsigned long long rows) {
    GRID_STRIDE(j, n) {
        float s = db[j];
        for (unsigned long long r = 0; r < rows; ++r) s += dy[r * n + j];
        db[j] = s;
    }
}

extern "C" __global__ void add_assign_f32(float* dst, const float* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] += src[i];
}

extern "C" __global__ void add_assign_bf16(bf16_t* dst, const float* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = f32_to_bf16(bf16_to_f32(dst[i]) + src[i]);
}

extern "C" __global__ void scale_f32(float* dst, float s, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] *= s;
}

extern "C" __global__ void round_bf16(bf16_t* dst, const float* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = f32_to_bf16(src[i]);
}

extern "C" __global__ void widen_bf16(float* dst, const bf16_t* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = bf16_to_f32(src[i]);
}

extern "C" __global__ void fill_f16(f16_t* dst, f16_t value, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = value;
}

extern "C" __global__ void add_assign_f16(f16_t* dst, const float* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = f32_to_f16(f16_to_f32(dst[i]) + src[i]);
}

extern "C" __global__ void round_f16(f16_t* dst, const float* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = f32_to_f16(src[i]);
}

extern "C" __global__ void widen_f16(float* dst, const f16_t* src, unsigned long long n) {
    GRID_STRIDE(i, n) dst[i] = f16_to_f32(src[i]);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// act = silu(gate) * up
extern "C" __global__ void swiglu_forward(float* act, const float* gate, const float* up,
                                         unsigned long long n) {
    GRID_STRIDE(i, n) {
        float g = gate[i];
        act[i] = g * sigmoid(g) * up[i];
    }
}

extern "C" __global__ void swiglu_backward(float* dgate, float* dup, const float* dact,
                                          const float* gate, const float* up,
                                          unsigned long long n) {
    GRID_STRIDE(i, n) {
        float g = gate[i], s = sigmoid(g);
        dgate[i] = dact[i] * up[i] * s * (1.0f + g * (1.0f - s));
        dup[i] = dact[i] * g * s;
    }
}

// FP8 emulation (`fp8.rs`): |x| rounded to the E4M3 (e4m3 != 0) or E5M2 grid, nearest with
// ties to even, saturated at top.
__device__ __forceinline__ float fp8_round(float x, int e4m3, float top) {
    float a = fabsf(x);
    if (isnan(a) || a == 0.0f) return x;
    if (a >= top) return copysignf(top, x);
    int mantissa = e4m3 ? 3 : 2, min_exp = e4m3 ? -6 : -14;
    int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
    float step = ldexpf(1.0f, (e > min_exp ? e : min_exp) - mantissa);
    return copysignf(fminf(rintf(a / step) * step, top), x);
}

// out[blockIdx.x] = the largest magnitude of group blockIdx.x: len elements at
// src[blockIdx.x * step + i * stride] (the tensor, a row or a column).
extern "C" __global__ void fp8_amax(float* out, const float* src, unsigned int len,
                                   unsigned int stride, unsigned int step) {
    unsigned long long base = (unsigned long long)blockIdx.x * step;
    float amax = 0.0f;
    for (unsigned int i = threadIdx.x; i < len; i += blockDim.x)
        amax = fmaxf(amax, fabsf(src[base + (unsigned long long)i * stride]));
    amax = block_max(amax);
    if (threadIdx.x == 0) out[blockIdx.x] = amax;
}

// dst = src through FP8 at its group's scale top / max(amax, 1e-12): group 0 (axis 0), its
// row (axis 1) or its column (axis 2) of a row-major [*, cols] operand.
extern "C" __global__ void fp8_apply(float* dst, const float* src, const float* amax,
                                    unsigned long long n, unsigned int cols, int axis,
                                    int e4m3, float top) {
    GRID_STRIDE(k, n) {
        unsigned long long g = axis == 0 ? 0 : axis == 1 ? k / cols : k % cols;
        float scale = top / fmaxf(amax[g], 1e-12f);
        dst[k] = fp8_round(src[k] * scale, e4m3, top) / scale;
    }
}
