// Shared by every kernel source: bf16 conversion (round to nearest even, as the `half`
// crate does), warp and block reductions, and a grid-stride loop. NVRTC compiles each
// source with this text in front of it; no system header is needed.

typedef unsigned short bf16_t;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t x) {
    return __uint_as_float(((u32)x) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0u) {
        return (bf16_t)((u >> 16) | 0x0040u);  // NaN stays NaN (quiet)
    }
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)((u + rounding) >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) total = w;
    }
    __syncthreads();
    float out = total;
    __syncthreads();
    return out;
}

__device__ double block_sum_f64(double v) {
    __shared__ double part[32];
    __shared__ double total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_f64(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double w = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
        w = warp_sum_f64(w);
        if (lane == 0) total = w;
    }
    __syncthreads();
    double out = total;
    __syncthreads();
    return out;
}

__device__ float block_max(float v) {
    __shared__ float part[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < (int)(blockDim.x >> 5) ? part[lane] : NEG_INF;
        w = warp_max(w);
        if (lane == 0) total = w;
    }
    __syncthreads();
    float out = total;
    __syncthreads();
    return out;
}

#define GRID_STRIDE(i, n)                                                        \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
         i < (unsigned long long)(n); i += (unsigned long long)blockDim.x * gridDim.x)
