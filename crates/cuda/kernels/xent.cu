// The LM head's cross-entropy on a chunk of logits (`xent.rs`): one block per row.

// Per row of lg ([n, v]): loss[row] = logsumexp - lg[target] (f64); with `scale` != 0 the
// row becomes scale * (softmax - onehot(target)), the gradient of scale * loss.
extern "C" __global__ void softmax_xent(float* lg, const u32* targets, double* loss,
                                       unsigned int v, float scale, int with_grad) {
    float* row = lg + (unsigned long long)blockIdx.x * v;
    float mx = NEG_INF;
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, row[j]);
    mx = block_max(mx);
    double sum = 0.0;
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x) sum += exp((double)(row[j] - mx));
    sum = block_sum_f64(sum);
    double lse = (double)mx + log(sum);
    unsigned int target = targets[blockIdx.x];
    if (threadIdx.x == 0) loss[blockIdx.x] = lse - (double)row[target];
    __syncthreads();
    if (!with_grad) return;
    for (unsigned int j = threadIdx.x; j < v; j += blockDim.x) {
        float p = (float)exp((double)row[j] - lse) * scale;
        row[j] = j == target ? p - scale : p;
    }
}

// The maximum of each row of this rank's logits ([n, vl]).
extern "C" __global__ void logits_row_max(float* out, const float* lg, unsigned int vl) {
    const float* row = lg + (unsigned long long)blockIdx.x * vl;
    float mx = NEG_INF;
    for (unsigned int j = threadIdx.x; j < vl; j += blockDim.x) mx = fmaxf(mx, row[j]);
    mx = block_max(mx);
    if (threadIdx.x == 0) out[blockIdx.x] = mx;
}

// out[i] = max over the ranks' gathered maxima ([ranks, n]).
extern "C" __global__ void max_over_ranks(float* out, const float* gathered, unsigned int n,
                                         unsigned int ranks) {
    GRID_STRIDE(i, n) {
        float mx = NEG_INF;
        for (unsigned int r = 0; r < ranks; r++) mx = fmaxf(mx, gathered[r * n + i]);
        out[i] = mx;
    }
}

// out[row] = sum of exp(z - row_max) over this slice; out[n + row] = the target's logit if
// this slice [v0, v0 + vl) holds it, else 0. One block per row.
extern "C" __global__ void logits_exp_stats(float* out, const float* lg, const u32* targets,
                                           const float* row_max, unsigned int n,
                                           unsigned int vl, unsigned int v0) {
    const float* row = lg + (unsigned long long)blockIdx.x * vl;
    double sum = 0.0;
    float mx = row_max[blockIdx.x];
    for (unsigned int j = threadIdx.x; j < vl; j += blockDim.x) sum += exp((double)(row[j] - mx));
    sum = block_sum_f64(sum);
    if (threadIdx.x == 0) {
        unsigned int target = targets[blockIdx.x];
        out[blockIdx.x] = (float)sum;
        out[n + blockIdx.x] = (target >= v0 && target < v0 + vl) ? row[target - v0] : 0.0f;
    }
}

// lse[i] = row_max[i] + ln(stats[i]); loss[i] = lse[i] - stats[n + i].
extern "C" __global__ void vocab_lse(double* lse, double* loss, const float* row_max,
                                    const float* stats, unsigned int n) {
    GRID_STRIDE(i, n) {
        double l = (double)row_max[i] + log((double)stats[i]);
        lse[i] = l;
        loss[i] = l - (double)stats[n + i];
    }
}

// This rank's logits ([n, vl], rows [v0, v0 + vl)) become scale * (softmax - onehot).
extern "C" __global__ void vocab_softmax_grad(float* lg, const u32* targets, const double* lse,
                                             unsigned int n, unsigned int vl, unsigned int v0,
                                             float scale) {
    unsigned long long total = (unsigned long long)n * vl;
    GRID_STRIDE(k, total) {
        unsigned int row = (unsigned int)(k / vl), j = (unsigned int)(k % vl);
        float p = (float)exp((double)lg[k] - lse[row]) * scale;
        lg[k] = (targets[row] == v0 + j) ? p - scale : p;
    }
}
