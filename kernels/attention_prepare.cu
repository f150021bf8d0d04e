// attention_prepare.cu: the step of gated full attention before the split-KV kernels (attention.cu,
// attention_decode.cu): q/k RMSNorm and partial RoPE, and the new k/v rows into the KV cache
// (ninfer_rt/reference/model.py GatedAttention.__call__ from `qg, k, v` to the rotated q and cached k, v).
//
// attn_prepare_d{D}: for token t of sequence b (row m = b*T + t of M = B*T), position p = pos[b] + t:
//     q_h = rope(rms_norm_zc(q_h, q_norm)), k_h = rope(rms_norm_zc(k_h, k_norm)), v_h as is
//     (ops.rms_norm_zc, ops.rope_cos_sin + ops.apply_rope for text positions: NeoX rotate-half on the first rot dims,
//     angle_j = float(p) * inv_freq[j] in fp32, cos/sin accurate (double-precision range reduction + series, not the
//     fast intrinsics) times rope_scale). q -> q_out; k, v -> cache slot[b] at position p: bf16 round-to-nearest-even,
//     or int8 codes rint(x / s) clamped to +-127 with s = max|x| / 127 per (position, kv head); a zero vector stores
//     s = 0 and codes 0 (it dequantises to zeros).
//
// Layouts (row-major): qkvg fp32 [M, ld]: [q (nH*D) | k (nKV*D) | v (nKV*D) | gate (nH*D)]; q_out fp32 [M, nH, D];
//   cache k, v [slots, max_ctx, nKV, D] bf16 bits or int8 codes; k_scale, v_scale fp32 [slots, max_ctx, nKV].
#include "attention.cuh"

namespace {

// cos/sin of an fp32 angle, correctly rounded to fp32 in practice: reduction by pi/2 in double (fdlibm's 33-bit
// pio2_1 makes k*pio2_1 exact for |k| < 2^20, i.e. angles below ~1.6e6 rad), then Taylor series on |r| <= pi/4
// (truncation < 1e-16). Written out because --use_fast_math turns sincosf into the inaccurate __sincosf, and the
// library's double sincos drags in a local-memory slow path for huge arguments.
__device__ __forceinline__ void accurate_cos_sin(float angle, float& c, float& s) {
    const double a = (double)angle;
    const double k = rint(a * 6.36619772367581382433e-01);
    double r = fma(-k, 1.57079632673412561417e+00, a);
    r = fma(-k, 6.07710050650619224932e-11, r);
    const double r2 = r * r;
    double sp = -1.0 / 1307674368000.0;   // -1/15!
    sp = fma(sp, r2, 1.0 / 6227020800.0);
    sp = fma(sp, r2, -1.0 / 39916800.0);
    sp = fma(sp, r2, 1.0 / 362880.0);
    sp = fma(sp, r2, -1.0 / 5040.0);
    sp = fma(sp, r2, 1.0 / 120.0);
    sp = fma(sp, r2, -1.0 / 6.0);
    const double sr = fma(sp * r2, r, r);
    double cp = 1.0 / 20922789888000.0;   // 1/16!
    cp = fma(cp, r2, -1.0 / 87178291200.0);
    cp = fma(cp, r2, 1.0 / 479001600.0);
    cp = fma(cp, r2, -1.0 / 3628800.0);
    cp = fma(cp, r2, 1.0 / 40320.0);
    cp = fma(cp, r2, -1.0 / 720.0);
    cp = fma(cp, r2, 1.0 / 24.0);
    cp = fma(cp, r2, -0.5);
    const double cr = fma(cp, r2, 1.0);
    const int quad = (int)((long long)k & 3);
    const double sv = quad == 0 ? sr : quad == 1 ? cr : quad == 2 ? -sr : -cr;
    const double cv = quad == 0 ? cr : quad == 1 ? -sr : quad == 2 ? -cr : sr;
    c = (float)cv;
    s = (float)sv;
}

// cos_s[j], sin_s[j] (j < half) of position p: angle_j = float(p) · inv_freq[j], cos/sin times rope_scale;
// thread tid of nt
__device__ __forceinline__ void rope_table(float* cos_s, float* sin_s, int p, const float* __restrict__ inv_freq,
                                           float rope_scale, int half, int tid, int nt) {
    for (int j = tid; j < half; j += nt) {
        float c, s;
        accurate_cos_sin(__fmul_rn((float)p, inv_freq[j]), c, s);
        cos_s[j] = __fmul_rn(c, rope_scale);
        sin_s[j] = __fmul_rn(s, rope_scale);
    }
}

// gain[i] = 1 + w[lane + 32 i]: the zero-centred norm's gain of a warp's head
template <int D>
__device__ __forceinline__ void norm_gain_row(float (&gain)[D / 32], const float* __restrict__ w, int lane) {
#pragma unroll
    for (int i = 0; i < D / 32; ++i) gain[i] = __fadd_rn(1.f, w[lane + 32 * i]);
}

// x = rope(rms_norm_zc(x)) of one q or k head held by a warp (lane: elements lane + 32 i), ops.rms_norm_zc's
// operation order; xs: D floats of shared memory the warp may use (it holds the normed head afterwards)
template <int D>
__device__ __forceinline__ void norm_rope_row(float (&x)[D / 32], const float (&gain)[D / 32], float* xs,
                                              const float* cos_s, const float* sin_s, int half, int rot, float eps,
                                              int lane) {
    constexpr int PER = D / 32;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) ss += x[i] * x[i];
    ss = warp_sum(ss);
    // same operation order as ops.rms_norm_zc: x * (1 / sqrt(mean + eps)), then * (1 + w)
    const float inv = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)D), eps)));
#pragma unroll
    for (int i = 0; i < PER; ++i) x[i] = __fmul_rn(__fmul_rn(x[i], inv), gain[i]);
    if (half > 0) {
#pragma unroll
        for (int i = 0; i < PER; ++i) xs[lane + 32 * i] = x[i];
        __syncwarp();
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int e = lane + 32 * i;
            if (e < rot) {
                const int j = e < half ? e : e - half;
                const float other = e < half ? -xs[e + half] : xs[e - half];
                x[i] = __fadd_rn(__fmul_rn(x[i], cos_s[j]), __fmul_rn(other, sin_s[j]));
            }
        }
    }
}

// One k or v head (a warp's x) into cache row `row`: bf16 round-to-nearest-even, or int8 codes rint(x / s) clamped
// to +-127 with s = max|x| / 127 (scales[row] = s; a zero vector stores s = 0 and codes 0)
template <int D>
__device__ __forceinline__ void cache_row_store(const float (&x)[D / 32], void* cache, float* scales, size_t row,
                                                bool int8, int lane) {
    constexpr int PER = D / 32;
    if (!int8) {
        uint16_t* dst = static_cast<uint16_t*>(cache) + row * D;
#pragma unroll
        for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = f32_to_bf16(x[i]);
        return;
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) amax = fmaxf(amax, fabsf(x[i]));
    amax = warp_max(amax);
    const float scale = __fdiv_rn(amax, 127.f);
    int8_t* dst = static_cast<int8_t*>(cache) + row * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        int code = 0;
        if (scale > 0.f) code = max(-127, min(127, __float2int_rn(__fdiv_rn(x[i], scale))));
        dst[lane + 32 * i] = (int8_t)code;
    }
    if (lane == 0) scales[row] = scale;
}

// ------------------------------------------------------------------------------------------------ prepare

// grid (M, ceil((nH + 2 nKV) / 4)), block 128: warp w of block y handles head unit u = 4y + w of row m
// (u < nH: q head u; u < nH + nKV: k head u - nH; else v head u - nH - nKV).
template <int D>
__device__ __forceinline__ void prepare_impl(const float* __restrict__ qkvg, int ld, const float* __restrict__ q_norm,
                                             const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                                             float rope_scale, int rot, const int* __restrict__ pos,
                                             const int* __restrict__ slot, int T, int nH, int nKV, float eps,
                                             void* kc, void* vc, float* ks, float* vs, int slots, int max_ctx,
                                             int int8, float* __restrict__ q_out) {
    constexpr int PER = D / 32;
    __shared__ float cos_s[D / 2], sin_s[D / 2];
    __shared__ float x_s[4][D];
    const int m = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = m / T, t = m - b * T;
    // Before the wait: the positions (uploaded before the graph ran), the rotation and the norm's gains do not
    // depend on the predecessor, which only writes qkvg; the double-precision cos/sin chain is the longest part.
    const int p = pos[b] + t, sl = slot[b];
    const int half = rot / 2;
    rope_table(cos_s, sin_s, p, inv_freq, rope_scale, half, threadIdx.x, blockDim.x);
    const int u = blockIdx.y * 4 + warp;
    const bool is_v = u >= nH + nKV;
    float gain[PER];
    if (u < nH + nKV) norm_gain_row<D>(gain, u < nH ? q_norm : k_norm, lane);
    // The decode after it reads, before its wait, only the positions and cache rows of earlier steps: it may start
    // launching now, and its ring of those rows fills during this kernel (perf-history.md v53)
    ninfer_pdl_begin_early();
    __syncthreads();
    if (u >= nH + 2 * nKV) return;

    float x[PER];
    const float* src = qkvg + (size_t)m * ld + (size_t)u * D;  // q, k, v columns are contiguous: unit u at u*D
#pragma unroll
    for (int i = 0; i < PER; ++i) x[i] = src[lane + 32 * i];

    if (!is_v) {
        norm_rope_row<D>(x, gain, x_s[warp], cos_s, sin_s, half, rot, eps, lane);
        if (u < nH) {
            float* dst = q_out + ((size_t)m * nH + u) * D;
#pragma unroll
            for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = x[i];
            return;
        }
    }
    // a key or value head: into the cache (nothing is written for an out-of-range slot or position)
    if (sl < 0 || sl >= slots || p < 0 || p >= max_ctx) return;
    const int h = is_v ? u - nH - nKV : u - nH;
    const size_t row = ((size_t)sl * max_ctx + p) * nKV + h;
    cache_row_store<D>(x, is_v ? vc : kc, is_v ? vs : ks, row, int8 != 0, lane);
}

}  // namespace

// ------------------------------------------------------------------------------------------------ entry points

#define NINFER_PREPARE(D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) attn_prepare_d##D(                                         \
        const float* qkvg, int ld, const float* q_norm, const float* k_norm, const float* inv_freq,              \
        float rope_scale, int rot, const int* pos, const int* slot, int T, int nH, int nKV, float eps, void* kc,  \
        void* vc, float* ks, float* vs, int slots, int max_ctx, int int8, float* q_out) {                \
        prepare_impl<D>(qkvg, ld, q_norm, k_norm, inv_freq, rope_scale, rot, pos, slot, T, nH, nKV, eps, kc, vc, \
                        ks, vs, slots, max_ctx, int8, q_out);                                                     \
    }

NINFER_PREPARE(32)
NINFER_PREPARE(64)
NINFER_PREPARE(128)
NINFER_PREPARE(256)
