// The row kernels of attention as batched products (`score_attention.rs`, whose host
// implementation in its tests is the reference): a chunk's score matrices are `count`
// matrices of `rows × cols` f32, row-major and packed (`rows·cols` apart). Row i of matrix g
// is query position r0 + i and sees the columns j <= r0 + i; its log-sum-exp (or delta) is
// at stat[g·stat_stride + i]. One warp per row.

struct ScoreRows {
    unsigned int count, rows, cols, r0, stat_stride;
};

// The row of this warp: its first element, its statistic's index and how many columns it
// sees; false past the last row.
__device__ __forceinline__ bool score_row(ScoreRows r, unsigned long long* start,
                                          unsigned long long* stat, unsigned int* seen) {
    unsigned long long task = (unsigned long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (task >= (unsigned long long)r.count * r.rows) return false;
    unsigned int g = (unsigned int)(task / r.rows), i = (unsigned int)(task % r.rows);
    *start = task * r.cols;
    *stat = (unsigned long long)g * r.stat_stride + i;
    unsigned int last = r.r0 + i + 1;
    *seen = last < r.cols ? last : r.cols;
    return true;
}

// In place: P = softmax of the row's visible scores (0 past them); lse = max + log(sum).
extern "C" __global__ void scores_softmax(float* s, float* lse, ScoreRows r) {
    unsigned long long start, stat;
    unsigned int seen, lane = threadIdx.x & 31;
    if (!score_row(r, &start, &stat, &seen)) return;
    float* row = s + start;
    float mx = NEG_INF;
    for (unsigned int j = lane; j < seen; j += 32) mx = fmaxf(mx, row[j]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (unsigned int j = lane; j < seen; j += 32) sum += expf(row[j] - mx);
    sum = warp_sum(sum);
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (unsigned int j = lane; j < r.cols; j += 32) row[j] = j < seen ? expf(row[j] - mx) * inv : 0.0f;
    if (lane == 0) lse[stat] = sum > 0.0f ? mx + logf(sum) : NEG_INF;
}

// In place: P = exp(S - lse) over the visible scores (0 past them), the forward's P again.
extern "C" __global__ void scores_probs(float* s, const float* lse, ScoreRows r) {
    unsigned long long start, stat;
    unsigned int seen, lane = threadIdx.x & 31;
    if (!score_row(r, &start, &stat, &seen)) return;
    float* row = s + start;
    float l = lse[stat];
    for (unsigned int j = lane; j < r.cols; j += 32) row[j] = j < seen ? expf(row[j] - l) : 0.0f;
}

// In place: dP <- P * (dP - delta), the scores' gradient (0 where P is).
extern "C" __global__ void scores_grad(float* dp, const float* p, const float* delta, ScoreRows r) {
    unsigned long long start, stat;
    unsigned int seen, lane = threadIdx.x & 31;
    if (!score_row(r, &start, &stat, &seen)) return;
    float dl = delta[stat];
    for (unsigned int j = lane; j < r.cols; j += 32) dp[start + j] = p[start + j] * (dp[start + j] - dl);
}
