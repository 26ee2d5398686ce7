// Shared by every kernel source: bf16 and IEEE-half conversion (round to nearest even, as the
// `half` crate does), warp and block reductions, and a grid-stride loop. NVRTC compiles each
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

typedef unsigned short f16_t;

// IEEE half <-> f32, as the `half` crate converts: exact widening; rounding to nearest
// even, to infinity from 65520 up, to subnormals below 2^-14.
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 exp = ((u32)h >> 10) & 0x1fu, man = (u32)h & 0x3ffu;
    if (exp == 0x1fu) {  // infinity, or NaN made quiet (as F16C widens it)
        return __uint_as_float(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u));
    }
    if (exp == 0u) return __uint_as_float(sign | __float_as_uint((float)man * 5.9604644775390625e-8f));
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ f16_t f32_to_f16(float f) {
    u32 u = __float_as_uint(f);
    u32 sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (f16_t)(sign | 0x7e00u);  // NaN stays NaN (quiet)
    if (a >= 0x477ff000u) return (f16_t)(sign | 0x7c00u);  // rounds past 65504: infinity
    if (a < 0x38800000u) {  // below 2^-14: a subnormal count of 2^-24 (exact product)
        return (f16_t)(sign | (u32)rintf(__uint_as_float(a) * 16777216.0f));
    }
    u32 e = a - 0x38000000u;  // rebias the exponent 127 -> 15
    return (f16_t)(sign | ((e + 0xfffu + ((e >> 13) & 1u)) >> 13));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

struct Sum {
    template <typename T> __device__ static T warp(T v) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    }
    template <typename T> __device__ static T identity() { return T(0); }
};

struct Max {
    __device__ static float warp(float v) { return warp_max(v); }
    template <typename T> __device__ static T identity() { return NEG_INF; }
};

// `Op` over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
template <typename Op, typename T> __device__ T block_reduce(T v) {
    __shared__ T part[32];
    __shared__ T total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = Op::warp(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T w = lane < (int)(blockDim.x >> 5) ? part[lane] : Op::template identity<T>();
        w = Op::warp(w);
        if (lane == 0) total = w;
    }
    __syncthreads();
    T out = total;
    __syncthreads();
    return out;
}

__device__ float block_sum(float v) { return block_reduce<Sum>(v); }
__device__ double block_sum_f64(double v) { return block_reduce<Sum>(v); }
__device__ float block_max(float v) { return block_reduce<Max>(v); }

// The row a warp works on, among `rows` rows of [b, heads, s] (one warp per row): its
// (b, head, position), or false when the warp has no row.
struct WarpRow {
    unsigned long long task;
    unsigned int b, head, pos;
};

__device__ __forceinline__ bool warp_row(unsigned int batch, unsigned int heads,
                                         unsigned int seq, WarpRow* r) {
    r->task = (unsigned long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r->task >= (unsigned long long)batch * heads * seq) return false;
    r->pos = (unsigned int)(r->task % seq);
    r->head = (unsigned int)((r->task / seq) % heads);
    r->b = (unsigned int)(r->task / ((unsigned long long)seq * heads));
    return true;
}

#define GRID_STRIDE(i, n)                                                        \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
         i < (unsigned long long)(n); i += (unsigned long long)blockDim.x * gridDim.x)
