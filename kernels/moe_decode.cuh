// moe_decode.cuh: what the MoE decode kernels share (moe.cu's fast paths, moe_fused.cu): the block shape, the
// zero-centred RMSNorm of one row by a whole block, and the raw quantized 32-element chunks a thread loads into
// registers before its activations are staged, then meets with the int16 activation codes (xcodes.cuh).
#pragma once
#include "common.cuh"
#include "xcodes.cuh"  // int16 activation codes and dp2a dot products; quant.cuh

#define MOE_THREADS 256   // gate_up and down blocks
#define MOE_WARPS (MOE_THREADS / 32)
#define MOE_DOWN_ROWS 8   // output rows of y per down block: H/8 blocks per token

// Zero-centred RMSNorm as norm.cu: each thread adds Σ x² of its elements, ss_partial puts the warp sums in
// s_red, and after the next barrier rms_scale gives every thread r = rsqrt(mean(x²) + eps), the same bits (the
// xor-shuffle tree sums in one order up to commutation); h = (x · r) · (1 + w).
__device__ __forceinline__ void ss_partial(float ss, float* s_red) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = ss;
}

__device__ __forceinline__ float rms_scale(const float* s_red, int H, float eps) {
    const float ss = warp_sum((threadIdx.x & 31) < MOE_WARPS ? s_red[threadIdx.x & 31] : 0.f);
    // correctly rounded divide and rsqrt: --use_fast_math would otherwise give 2-ulp approximations
    return __frsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(H)), eps));
}

__device__ __forceinline__ float norm_mul(float x, float r, float w) { return __fmul_rn(__fmul_rn(x, r), 1.f + w); }

__device__ __forceinline__ float4 norm_mul4(float4 x, float r, float4 w) {
    return make_float4(norm_mul(x.x, r, w.x), norm_mul(x.y, r, w.y), norm_mul(x.z, r, w.z), norm_mul(x.w, r, w.w));
}

// The raw bytes of one 32-element chunk of one row, as loaded (decoded later by chunk_dots).
template <int BITS>
struct QChunk {
    int4 a;                // codes (BITS 8: first 16 of 32 bytes)
    int4 b;                // BITS 8: last 16 bytes
    unsigned long long h;  // BITS 5: 32 high bits, BITS 6: 64
    unsigned short s;      // fp16 scale bits
};

template <int BITS, int GROUP>
__device__ __forceinline__ void qchunk_load(QChunk<BITS>& q, const uint8_t* qs, const uint8_t* qh, const __half* sc,
                                            long long row, int kp, int c) {
    const QRow r = q_row<BITS>(qs, qh, sc, row, kp, GROUP);
    if constexpr (BITS == 8) {
        const int4* p = reinterpret_cast<const int4*>(r.qs + 32LL * c);
        q.a = __ldg(p);
        q.b = __ldg(p + 1);
    } else {
        q.a = __ldg(reinterpret_cast<const int4*>(r.qs + 16LL * c));
    }
    if constexpr (BITS == 5) q.h = __ldg(reinterpret_cast<const uint32_t*>(r.qh) + c);
    if constexpr (BITS == 6) q.h = __ldg(reinterpret_cast<const unsigned long long*>(r.qh) + c);
    q.s = __ldg(reinterpret_cast<const unsigned short*>(r.sc) + (32 * c) / GROUP);
}

// A loaded chunk as the units compute_unit_q takes: nibble formats one unit of 32 elements, q8 two of 16 (half).
template <int BITS>
__device__ __forceinline__ Unit chunk_unit(const QChunk<BITS>& q, int half) {
    Unit u;
    u.q = half ? q.b : q.a;
    u.h0 = (uint32_t)q.h;
    u.h1 = (uint32_t)(q.h >> 32);
    u.sc = q.s;
    return u;
}

// acc[r][0] += W[r] chunk · x chunk for the 4 rows' loaded chunks q[r], x as the int16 chunk record rec.
template <int BITS>
__device__ __forceinline__ void chunk_dots(const QChunk<BITS> (&q)[4], const uint8_t* rec, float (&acc)[4][1]) {
#pragma unroll
    for (int half = 0; half < (BITS == 8 ? 2 : 1); ++half) {
        Unit d[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) d[r] = chunk_unit<BITS>(q[r], half);
        compute_unit_q<BITS, 1, 4>(d, rec, half, acc);
    }
}

// n4 float4s of src (a multiple of 32: every pass is whole warps, for the shuffles) as int16 chunk records in
// dst (xcodes.cuh, XQ order), 4 loads a thread in flight per pass. L2: load through L2 only (src was written
// by the same kernel), else by the read-only path.
template <int XQ, bool L2>
__device__ __forceinline__ void stage_codes(uint8_t* dst, const float4* __restrict__ src, int n4) {
    constexpr int CB = qchunk_bytes(1);
    for (int i0 = 0; i0 < n4; i0 += 4 * MOE_THREADS) {
        float4 v[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int i4 = i0 + MOE_THREADS * b + threadIdx.x;
            if (i4 < n4) v[b] = L2 ? __ldcg(src + i4) : __ldg(src + i4);
        }
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int i4 = i0 + MOE_THREADS * b + threadIdx.x;
            if (i4 < n4) store_codes4<1, XQ>(dst + (i4 >> 3) * CB, 0, 4 * (i4 & 7), v[b], true);
        }
    }
}

// stage_codes at compile-time counts, of src (N4 float4s) and, where NS4 > 0, of a second row src2 (NS4 float4s,
// NS4 <= MOE_THREADS) into dst2: every load is issued before the first is used. Over stage_codes' run-time count,
// ptxas makes the loop's first load wait on the scoreboard it shares with the weight loads issued before it, so the
// rows were requested only once those had landed (perf-history.md v58). The kernels take it at top-k MOE_STAGE_K.
#define MOE_STAGE_K 8
template <int XQ, int XQ2, bool L2, int N4, int NS4>
__device__ __forceinline__ void stage_codes_fixed(uint8_t* dst, const float* src, uint8_t* dst2 = nullptr,
                                                  const float* src2 = nullptr) {
    static_assert(N4 % MOE_THREADS == 0 && NS4 % 32 == 0 && NS4 <= MOE_THREADS, "whole warps in every pass");
    constexpr int CB = qchunk_bytes(1), P = N4 / MOE_THREADS;
    const float4* a4 = reinterpret_cast<const float4*>(src);
    const int tid = threadIdx.x;
    float4 v[P], vs = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int p = 0; p < P; ++p) v[p] = L2 ? __ldcg(a4 + MOE_THREADS * p + tid) : __ldg(a4 + MOE_THREADS * p + tid);
    const float4* s4 = reinterpret_cast<const float4*>(src2);
    if (tid < NS4) vs = L2 ? __ldcg(s4 + tid) : __ldg(s4 + tid);
#pragma unroll
    for (int p = 0; p < P; ++p) {
        const int i4 = MOE_THREADS * p + tid;
        store_codes4<1, XQ>(dst + (i4 >> 3) * CB, 0, 4 * (i4 & 7), v[p], true);
    }
    if (tid < NS4) store_codes4<1, XQ2>(dst2 + (tid >> 3) * CB, 0, 4 * (tid & 7), vs, true);
}

// A gate/up tile's weights into registers: warp w's bank rows e·2I + 32·tile + 4w .. +4 (a tile's 16 gate rows
// and their 16 up rows: moe.cu's interleave), lane the chunks lane + 32t (t < T), all 4·T loads in flight.
template <int BITS, int GROUP, int T>
__device__ __forceinline__ void tile_load(QChunk<BITS> (&q)[T][4], const uint8_t* qs, const uint8_t* qh,
                                          const __half* sc, int kp, int e, int I, int tile) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long row0 = (long long)e * (2LL * I) + 32LL * tile + 4 * warp;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int t = 0; t < T; ++t) qchunk_load<BITS, GROUP>(q[t][r], qs, qh, sc, row0 + r, kp, lane + 32 * t);
    }
}

// A gate/up tile's 32 row dots: warp w's 4 rows (q[t][r]: chunk lane + 32t of row r) against the records xs, summed
// over the warp; s_out[4w + r] = row r's total.
template <int BITS, int T>
__device__ __forceinline__ void tile_dots(const QChunk<BITS> (&q)[T][4], const uint8_t* xs, float* s_out) {
    constexpr int CB = qchunk_bytes(1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[4][1] = {{0.f}, {0.f}, {0.f}, {0.f}};
#pragma unroll
    for (int t = 0; t < T; ++t) chunk_dots<BITS>(q[t], xs + (lane + 32 * t) * CB, acc);
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[r][0] = warp_sum(acc[r][0]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < 4; ++r) s_out[4 * warp + r] = acc[r][0];
    }
}

// The down projections' per-half-warp rows: half h = lane / 16 holds 4 rows' partial dots in acc (lane % 16 its
// chunks); the 16 lanes' sum of row r goes to dst[4h + r].
__device__ __forceinline__ void half_rows_store(float (&acc)[4][1], float* dst) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) acc[r][0] += __shfl_xor_sync(0xffffffffu, acc[r][0], o);  // within a half
    }
    if ((lane & 15) == 0) {
#pragma unroll
        for (int r = 0; r < 4; ++r) dst[4 * (lane >> 4) + r] = acc[r][0];
    }
}

// Σ_j w[j] · part[j·stride] over the k experts in order j = 0..k-1 (one fma each, deterministic); NaN when an
// expert's id was invalid (s_e[j] < 0).
__device__ __forceinline__ float expert_sum(const int* s_e, const float* s_w, const float* part, int stride,
                                            int top_k) {
    float total = 0.f;
    for (int j = 0; j < top_k; ++j) total = s_e[j] < 0 ? __int_as_float(0x7fc00000) : fmaf(s_w[j], part[j * stride], total);
    return total;
}
