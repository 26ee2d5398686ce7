// Element-wise kernels: copies, fills, sums, scaling, the f32 <-> bf16 casts, the residual
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
