// attention_decode_int8.cuh: the tensor-core pieces of attention_decode.cu's decode over an int8 cache: q's int8
// code planes as mma fragments (stage_q_codes), q·k on int8 mma (mma_s8), p·v on bf16 mma (pv_int8), and the XOR
// swizzles of the K and V rows in a ring stage (k_chunk, v_chunk). Included by attention_decode.cu only; no op
// lives here.
#pragma once
#include "attention.cuh"

namespace {

// ---- int8 caches: q·k on the int8 tensor cores (mma m16n8k32, exact int32 sums)
// q row c = s_c·(c1 + c2/254 + c3/254²) + e with codes c1..c3 in [-127, 127], s_c = max|q_c|/127 and
// |e| <= s_c/(2·254²) = max|q_c|·6.1e-8 (the rounding of q itself), so the planes give every score to the fp32
// path's accuracy. A-fragment k slots 4t..4t+3 / 16+4t.. of a 32-dim block are dims 8t..8t+3 / 8t+4..8t+7 (for q
// and k alike: the mma sums over k), so a lane's K fragment is one 8-byte run of its key's row.
constexpr float kQBase = 254.f;

// q's code planes as the mma's A fragments (lane 4g + t: row g and row g + 8, k slots 4t.., 16 + 4t..). Plane 1 and
// 2 share one mma, plane 1 as rows 0-7 and plane 2 as rows 8-15; plane 3 takes a second with rows 8-15 zero. So a
// fragment is one 16-byte record and one LDS.128 lands it in the mma's four registers:
//   pair record (j, g, t) = {c1[8t..8t+3], c2[8t..8t+3], c1[8t+4..8t+7], c2[8t+4..8t+7]} of dims 32j + ..,
//   third record (j, g, t) = {c3[8t..8t+3], 0, c3[8t+4..8t+7], 0},
// at byte ((plane·D/32 + j)·ROWS + g)·64 + 16t: rows g and g + 1 of a quarter warp read one 128-byte run.
template <int D, int ROWS>
struct QFrags {
    static constexpr bool IN_REGS = D <= 128;  // at D = 256 the 32 fragment registers would spill at 3 blocks an SM
    static constexpr int BLOCK = ROWS * 64;    // bytes of one 32-dim block's records, all rows
    static constexpr int THIRD = D / 32 * BLOCK;
    static constexpr int BYTES = 2 * THIRD;    // = ROWS·D·4: the fp32 rows' space
};

__device__ __forceinline__ void mma_s8(int (&c)[4], uint4 a, uint2 b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
}

// The bits of a chunk index that the ring's swizzles flip: at most bits 1-2, which leaves bits 0, 3, 4 to the
// copies' immediate offsets (attention_decode.cu's issue)
template <int RB>
constexpr int kSwizzleMask = RB / 16 - 1 < 6 ? RB / 16 - 1 : 6;

// Where 16-byte chunk ch of K row r sits in a ring stage: XOR-swizzled by the row, so the 8 keys' 8-byte runs that
// one mma reads (lane 4g + t: key g, bytes 32j + 8t ..; a half warp's 4 keys) fall in distinct banks.
template <int RB>
__device__ __forceinline__ int k_chunk(int r, int ch) { return ch ^ ((2 * r) & kSwizzleMask<RB>); }

// The block's ROWS query rows r0 .. (zeros past R) as QFrags records and row scales s[ROWS]: 16 threads per row
// (a block of 16·ROWS threads), thread x coding records n = NR·x .. (n = 4j + t: dims 8n .. 8n + 7).
template <int D, int ROWS>
__device__ __forceinline__ void stage_q_codes(const float* __restrict__ q, int b, int T, int nH, int kvh, int G,
                                              int R, int r0, unsigned char* frags, float* s) {
    using QF = QFrags<D, ROWS>;
    constexpr int NREC = D / 8, NR = NREC >= 16 ? NREC / 16 : 1;
    const int tid = threadIdx.x, c = tid >> 4, n0 = (tid & 15) * NR;
    const int rr = r0 + c;
    const bool mine = n0 < NREC;  // D < 128: the row's records are fewer than its 16 threads
    float v[NR * 8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < NR * 8; ++i) v[i] = 0.f;
    if (rr < R && mine) {
        const int tt = rr / G, j = rr - tt * G;
        const float* src = q + ((size_t)(b * T + tt) * nH + kvh * G + j) * D + 8 * n0;
#pragma unroll
        for (int i = 0; i < NR * 8; i += 4) {
            const float4 x = *reinterpret_cast<const float4*>(src + i);
            v[i] = x.x, v[i + 1] = x.y, v[i + 2] = x.z, v[i + 3] = x.w;
        }
    }
#pragma unroll
    for (int i = 0; i < NR * 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
    const float sr = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / sr;
    if ((tid & 15) == 0) s[c] = sr;
    if (!mine) return;
    // rint by the 1.5·2^23 shift (|x| <= 127: the sum's low byte is the int8 code), not F2I at a quarter of the
    // float rate; w[plane][k]: the codes of dims 4k .. 4k + 3 of this thread's run, one word each
    uint32_t w[3][NR * 2];
#pragma unroll
    for (int i = 0; i < NR * 8; ++i) {
        float x = fminf(fmaxf(v[i] * inv, -127.f), 127.f);
#pragma unroll
        for (int plane = 0; plane < 3; ++plane) {
            const float t = __fadd_rn(x, 12582912.f);
            const float cq = __fsub_rn(t, 12582912.f);  // rint(x), in [-127, 127]
            const uint32_t byte = __float_as_uint(t) & 0xffu;
            w[plane][i >> 2] = (i & 3) ? w[plane][i >> 2] | byte << (8 * (i & 3)) : byte;
            x = __fmul_rn(__fsub_rn(x, cq), kQBase);  // x - cq is exact (|x - cq| <= 1/2 and both near)
        }
    }
#pragma unroll
    for (int k = 0; k < NR; ++k) {
        const int n = n0 + k, j = n >> 2, t = n & 3;
        unsigned char* dst = frags + (j * ROWS + c) * 64 + 16 * t;
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0][2 * k], w[1][2 * k], w[0][2 * k + 1], w[1][2 * k + 1]);
        *reinterpret_cast<uint4*>(dst + QF::THIRD) = make_uint4(w[2][2 * k], 0u, w[2][2 * k + 1], 0u);
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
__device__ __forceinline__ int v_chunk(int r, int ch) { return ch ^ (r & kSwizzleMask<RB>); }

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
