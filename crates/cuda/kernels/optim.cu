// AdamW over a flat buffer and the squared norm of the clipping (`adamw.rs`).

// The host computes step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t) and
// decay = 1 - lr * weight_decay, as `adamw_update` does.
extern "C" __global__ void adamw(float* param, const float* grad, float* m, float* v,
                                unsigned long long n, float grad_scale, float beta1,
                                float beta2, float eps, float decay, float step_size,
                                float bc2_sqrt) {
    GRID_STRIDE(i, n) {
        float g = grad[i] * grad_scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        param[i] = param[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

// Muon's momentum (`muon.rs`): g' = grad * grad_scale, m = beta * m + (1 - beta) * g', and
// the update u = (1 - beta) * g' + beta * m (nesterov != 0) or m.
extern "C" __global__ void muon_momentum(float* u, float* m, const float* grad,
                                         unsigned long long n, float grad_scale, float beta,
                                         int nesterov) {
    GRID_STRIDE(i, n) {
        float g = grad[i] * grad_scale;
        float mi = beta * m[i] + (1.0f - beta) * g;
        m[i] = mi;
        u[i] = nesterov ? (1.0f - beta) * g + beta * mi : mi;
    }
}

// out[blockIdx.x] = sum of squares (f64) of this block's grid-stride share of x; the host
// (or `sum_f64`) adds the per-block partials, so the result does not depend on atomics.
extern "C" __global__ void sum_squares_partial(double* out, const float* x,
                                              unsigned long long n) {
    double acc = 0.0;
    GRID_STRIDE(i, n) acc += (double)x[i] * (double)x[i];
    acc = block_sum_f64(acc);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// As sum_squares_partial, for bf16 elements (widened exactly).
extern "C" __global__ void sum_squares_partial_bf16(double* out, const bf16_t* x,
                                                   unsigned long long n) {
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)bf16_to_f32(x[i]);
        acc += v * v;
    }
    acc = block_sum_f64(acc);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

// out[0] = sum of x[0..n) (one block).
extern "C" __global__ void sum_f64(double* out, const double* x, unsigned int n) {
    double acc = 0.0;
    for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
    acc = block_sum_f64(acc);
    if (threadIdx.x == 0) out[0] = acc;
}
