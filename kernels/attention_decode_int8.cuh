// attention_decode_int8.cuh: the tensor-core pieces of attention_decode.cu's decode over an int8 cache: q as int8
// code planes (stage_q_codes), q·k on int8 mma (mma_s8), p·v on bf16 mma (pv_int8), and the XOR swizzles of the
// K and V rows in a ring stage (k_chunk, v_chunk). Included by attention_decode.cu only; no op lives here.
#pragma once
#include "attention.cuh"

namespace {

// ---- int8 caches: q·k on the int8 tensor cores (mma m16n8k32, exact int32 sums)
// q row c = s_c·(c1 + c2/254 + c3/254²) + e with codes c1..c3 in [-127, 127], s_c = max|q_c|/127 and
// |e| <= s_c/(2·254²) = max|q_c|·6.1e-8 (the rounding of q itself), so three mmas per 32 dims give every score to
// the fp32 path's accuracy. A-fragment k slots 4t..4t+3 / 16+4t.. of a 32-dim block are dims 8t..8t+3 / 8t+4..8t+7
// (for q and k alike: the mma sums over k), so a lane's K fragment is one 8-byte run of its key's row.
constexpr int kQTerms = 3;
constexpr float kQBase = 254.f;

// q code planes: rows of D bytes; at D = 256 padded by 32 (the 8-byte fragment reads of 16 lanes then hit
// distinct banks), and read per mma there: 48 fragment registers would spill at 3 blocks per SM.
template <int D>
struct QCodes {
    static constexpr bool IN_REGS = D <= 128;
    static constexpr int STRIDE = D + (D == 256 ? 32 : 0);
    static_assert(kQTerms * STRIDE + 4 <= D * 4, "a row's codes and scale fit its fp32 space");
};

__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Where 16-byte chunk ch of K row r sits in a ring stage: XOR-swizzled by the row, so the 8 keys' 8-byte runs that
// one mma reads (lane 4g + t: key g, bytes 32j + 8t ..) fall in distinct banks.
template <int RB>
__device__ __forceinline__ int k_chunk(int r, int ch) { return ch ^ ((2 * r) & (RB / 16 - 1)); }

// The block's ROWS query rows r0 .. (zeros past R) as kQTerms int8 code planes [term][row][STRIDE] and row scales
// s[ROWS]: 16 threads per row (a block of 16·ROWS threads), each 16 consecutive dims.
template <int D, int ROWS>
__device__ __forceinline__ void stage_q_codes(const float* __restrict__ q, int b, int T, int nH, int kvh, int G,
                                              int R, int r0, int8_t* codes, float* s) {
    const int tid = threadIdx.x, c = tid >> 4, i0 = (tid & 15) * (D / 16);
    const int rr = r0 + c;
    float v[D / 16];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) v[i] = 0.f;
    if (rr < R) {
        const int tt = rr / G, j = rr - tt * G;
        const float* src = q + ((size_t)(b * T + tt) * nH + kvh * G + j) * D + i0;
#pragma unroll
        for (int i = 0; i < D / 16; i += 2) {
            const float2 x = *reinterpret_cast<const float2*>(src + i);
            v[i] = x.x, v[i + 1] = x.y;
        }
    }
#pragma unroll
    for (int i = 0; i < D / 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
    const float sr = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / sr;
    if ((tid & 15) == 0) s[c] = sr;
    // rint by the 1.5·2^23 shift (|x| <= 127: the sum's low byte is the int8 code), not F2I at a quarter of the
    // float rate; a thread's D/16 codes of a term packed into words, one shared-memory store instead of D/16
    constexpr int NB = D / 16, NW = (NB + 3) / 4;
    uint32_t w[kQTerms][NW];
#pragma unroll
    for (int i = 0; i < NB; ++i) {
        float x = fminf(fmaxf(v[i] * inv, -127.f), 127.f);
#pragma unroll
        for (int term = 0; term < kQTerms; ++term) {
            const float t = __fadd_rn(x, 12582912.f);
            const float cq = __fsub_rn(t, 12582912.f);  // rint(x), in [-127, 127]
            const uint32_t byte = __float_as_uint(t) & 0xffu;
            w[term][i >> 2] = (i & 3) ? w[term][i >> 2] | byte << (8 * (i & 3)) : byte;
            x = __fmul_rn(__fsub_rn(x, cq), kQBase);  // x - cq is exact (|x - cq| <= 1/2 and both near)
        }
    }
#pragma unroll
    for (int term = 0; term < kQTerms; ++term) {
        int8_t* dst = codes + (term * ROWS + c) * QCodes<D>::STRIDE + i0;  // NB-byte aligned
        if constexpr (NB == 16)
            *reinterpret_cast<uint4*>(dst) = make_uint4(w[term][0], w[term][1], w[term][2], w[term][3]);
        else if constexpr (NB == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(w[term][0], w[term][1]);
        else if constexpr (NB == 4) *reinterpret_cast<uint32_t*>(dst) = w[term][0];
        else *reinterpret_cast<uint16_t*>(dst) = (uint16_t)w[term][0];
    }
}

// D += A(16x8, row) * B(8x8, col), bf16 in, fp32 accumulate
__device__ __forceinline__ void mma_bf16_k8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// Where 16-byte chunk ch of V row r sits in an int8 ring stage: XOR-swizzled by the row, so the 4-byte runs of
// rows 2t (and of rows 2t + 1) that pv_int8's lanes read fall in distinct banks.
template <int RB>
__device__ __forceinline__ int v_chunk(int r, int ch) { return ch ^ (r & (RB / 16 - 1)); }

// int8 cache: o^T[dims, rows] += V^T[dims, 8 keys] · P^T[8 keys, 8 rows] on mma m16n8k8 (bf16), the value codes
// exact in bf16, P^T's fragment (lane 4g + t: row g, keys 2t, 2t+1) = (xa, xb), the lane's p times the value
// scale, as bf16 hi + lo (16 bits of the 24). m-tile pair pp: tile 2pp's rows g, g+8 are dims 32pp + 4g, +1 and
// tile 2pp+1's dims +2, +3, so the lane reads one 4-byte run (dims 32pp + 4g ..) of each of its keys' V rows and
// its C fragments o[pp][tile] hold rows 2t, 2t+1 of those dims.
template <int D>
__device__ __forceinline__ void pv_int8(float (&o)[D / 32][2][4], const unsigned char* vt, int g, int t, float xa,
                                        float xb) {
    const __nv_bfloat162 hi = __floats2bfloat162_rn(xa, xb);
    const __nv_bfloat162 lo = __floats2bfloat162_rn(xa - __low2float(hi), xb - __high2float(hi));
    const uint32_t bh = bf162_bits(hi), bl = bf162_bits(lo);
    const unsigned char* r0 = vt + (2 * t) * D + 4 * (g & 3);
    const unsigned char* r1 = r0 + D;
#pragma unroll
    for (int pp = 0; pp < D / 32; ++pp) {
        const int ch = 2 * pp + (g >> 2);
        const uint32_t w0 = *reinterpret_cast<const uint32_t*>(r0 + (v_chunk<D>(2 * t, ch) << 4)) ^ 0x80808080u;
        const uint32_t w1 = *reinterpret_cast<const uint32_t*>(r1 + (v_chunk<D>(2 * t + 1, ch) << 4)) ^ 0x80808080u;
#pragma unroll
        for (int u = 0; u < 2; ++u) {  // tile 2pp + u: dims 32pp + 4g + 2u (row g) and + 1 (row g + 8)
            const uint32_t a0 = pack_exact(i8_at(w0, 2 * u), i8_at(w1, 2 * u));
            const uint32_t a1 = pack_exact(i8_at(w0, 2 * u + 1), i8_at(w1, 2 * u + 1));
            mma_bf16_k8(o[pp][u], a0, a1, bh);
            mma_bf16_k8(o[pp][u], a0, a1, bl);
        }
    }
}

}  // namespace
