// gemv.cuh: what the two decode-GEMV files share (gemv.cu: M = 1..8 and the embedding gather; gemv_stream.cu:
// the persistent M = 1 kernel): format constants, unit decoding, the per-unit dot products, x̂ staging, and the
// kernels' common argument list. Layouts and semantics: the header comment of gemv.cu.
#pragma once
#include "quant.cuh"

namespace {

constexpr int kWarps = 8;  // warps per block (256 threads)
constexpr int kRows = 4;   // weight rows per warp
constexpr unsigned kFull = 0xffffffffu;

// Per-format constants. BITS = 16 is bf16. EU: elements of one 16-byte unit of the main plane.
template <int BITS>
struct Fmt {
    static constexpr int EU = BITS == 16 ? 8 : (BITS == 8 ? 16 : 32);
    static constexpr int NP = EU / 4;                   // 4-element pieces per unit (one float4 of x̂ each)
    static constexpr bool NIB = BITS <= 6;              // nibble plane: biased decode + Σx correction
    static constexpr float KB = (float)(1 << (BITS & 15));  // 2^b (NIB)
    static constexpr float CB = (float)((1 << (BITS & 15)) + (1 << ((BITS - 1) & 15)));  // 2^b + off (NIB)
};

__host__ __device__ constexpr int log2i(int n) { return n <= 1 ? 0 : 1 + log2i(n / 2); }
__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }
// Floats per 32-element chunk of x̂ for all M rows: row m at +36m; the stride is 4 (mod 8) float4s, so lanes
// reading consecutive units hit distinct banks.
__host__ __device__ constexpr int chunk_stride(int M) { return 36 * M + (M % 2 == 0 ? 4 : 0); }

// One unit of one row as loaded: 16 code bytes, high bits (q5: 32 bits, q6: 64 bits), fp16 scale bits.
struct Unit {
    int4 q;
    uint32_t h0, h1;
    unsigned short sc;
};

__device__ __forceinline__ uint32_t word_of(const int4& q, int j) {
    return (uint32_t)(j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w);
}

// (a & mask) | c as one LOP3: left to itself the compiler splits it in two when c is a constant too.
template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
    return d;
}

// Byte b of x placed at bits 16..23 under 0x3F: the byte's bit 7 is the exponent's low bit, so byte 0x80 | c
// gives exactly 1 + c / 2^7 (nibble formats, see header).
__device__ __forceinline__ float byte_hi(uint32_t x, int b) {
    return __uint_as_float(__byte_perm(x, 0x3F000000u, 0x7044u | ((uint32_t)b << 8)));
}
// float(2^23 + byte b of x), built bitwise (0x4B0000bb).
__device__ __forceinline__ float byte_lo(uint32_t x, int b) {
    return __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7540u + (uint32_t)b));
}

// Elements 4pc..4pc+3 of a unit: q4/5/6 f = 1 + u/2^b; q8 the code; bf16 the value.
template <int BITS>
__device__ __forceinline__ void decode_piece(const Unit& d, int pc, float w[4]) {
    if constexpr (BITS == 16) {
        const uint32_t a = word_of(d.q, 2 * pc), b = word_of(d.q, 2 * pc + 1);
        w[0] = __uint_as_float(a << 16);
        w[1] = __uint_as_float(a & 0xFFFF0000u);
        w[2] = __uint_as_float(b << 16);
        w[3] = __uint_as_float(b & 0xFFFF0000u);
    } else if constexpr (BITS == 8) {
        const uint32_t u = word_of(d.q, pc) ^ 0x80808080u;  // int8 q -> unsigned q + 128 per byte
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = byte_lo(u, i) - (8388608.f + 128.f);
    } else {
        // Word j holds elements 8j..8j+7: element 8j+2i in the low nibble of byte i, 8j+2i+1 in the high one.
        // te / to get, in byte i, 0x80 | u << (7 - BITS) for element 8j+2i / 8j+2i+1: f = 1 + u / 2^BITS.
        const int j = pc >> 1, b = 2 * (pc & 1);
        const uint32_t v = word_of(d.q, j);
        uint32_t te, to;
        const uint32_t e7 = 0x80808080u;  // bit 7 of each byte: the exponent's low bit
        if constexpr (BITS == 4) {
            te = and_or<0x78787878u>(v << 3, e7);
            to = and_or<0x78787878u>(v >> 1, e7);
        } else if constexpr (BITS == 5) {
            // element 8j+e has bit e of byte j of qh: spread even / odd bits to bit 6 of bytes 0..3
            const uint32_t hb = d.h0 >> (8 * j);
            te = and_or<0x3C3C3C3Cu>(v << 2, and_or<0x40404040u>((hb & 0x55u) * 0x1041040u, e7));
            to = and_or<0x3C3C3C3Cu>(v >> 2, and_or<0x40404040u>(((hb >> 1) & 0x55u) * 0x1041040u, e7));
        } else {
            // element 8j+e has bits 2e..2e+1 of 16-bit field j of qh; nibble i of the field -> byte i of y
            const uint32_t h = j < 2 ? d.h0 : d.h1;
            const uint32_t a = __byte_perm(h, 0u, (j & 1) ? 0x4342u : 0x4140u);
            const uint32_t y = (a | (a << 4)) & 0x0F0F0F0Fu;
            te = and_or<0x1E1E1E1Eu>(v << 1, and_or<0x60606060u>(y << 5, e7));
            to = and_or<0x1E1E1E1Eu>(v >> 3, and_or<0x60606060u>(y << 3, e7));
        }
        w[0] = byte_hi(te, b);
        w[1] = byte_hi(to, b);
        w[2] = byte_hi(te, b + 1);
        w[3] = byte_hi(to, b + 1);
    }
}

// Plane bases and the warp's rows as 32-bit unit offsets (row · units per row; the wrapper checks they fit).
template <int BITS>
struct Rows {
    const int4* q;            // qs (or bf16 data) as 16-byte units
    const uint8_t* h;         // qh: one u32 (q5) / u64 (q6) per 32 elements, indexed like q
    const unsigned short* s;  // fp16 scales
    unsigned oq[kRows];       // first unit of each row
    int sshift;               // log2(group / EU): unit index -> scale index (groups never straddle rows)

    __device__ __forceinline__ void load(Unit (&d)[kRows], int u) const {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const unsigned iq = oq[r] + (unsigned)u;
            d[r].q = __ldg(q + iq);
            d[r].h0 = d[r].h1 = 0;
            if constexpr (BITS == 5) d[r].h0 = __ldg(reinterpret_cast<const uint32_t*>(h) + iq);
            if constexpr (BITS == 6) {
                const uint2 t = __ldg(reinterpret_cast<const uint2*>(h) + iq);
                d[r].h0 = t.x;
                d[r].h1 = t.y;
            }
            d[r].sc = 0;
            if constexpr (BITS != 16) d[r].sc = __ldg(s + (iq >> sshift));
        }
    }
};

// acc[r][m] += Σ_{e in unit} W[r][e] · x̂[m][e]; xb points at the unit's x̂ for m = 0 (row m at +36m). With USE_P
// (small M) the decoded values are multiplied by x̂ as they are and scaled per unit (nibble formats: corrected
// with the chunk's Σ x̂ at xb[36m + 32]); otherwise each weight is made exact and scaled first (no per-unit
// partial sums: 32 accumulators already fill the registers at large M).
template <int BITS, int M, bool USE_P>
__device__ __forceinline__ void compute_unit(const Unit (&d)[kRows], const float* xb, float (&acc)[kRows][M]) {
    using F = Fmt<BITS>;
    static_assert(F::KB >= 1.f && F::CB >= 1.f, "nibble decode constants");
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = BITS == 16 ? 1.f : __half2float(__ushort_as_half(d[r].sc));
    float p[kRows][M];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) p[r][m] = 0.f;
#pragma unroll
    for (int pc = 0; pc < F::NP; ++pc) {
        float w[kRows][4];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            decode_piece<BITS>(d[r], pc, w[r]);
            if constexpr (!USE_P && F::NIB) {
                // s (u - off) = f s 2^b - s (2^b + off), exact in one fma: s (2^b + off) = 3 s 2^(b-1) fits fp32
                const float a = s[r] * F::KB, c = -s[r] * F::CB;
#pragma unroll
                for (int e = 0; e < 4; ++e) w[r][e] = fmaf(w[r][e], a, c);
            } else if constexpr (!USE_P && BITS == 8) {
#pragma unroll
                for (int e = 0; e < 4; ++e) w[r][e] *= s[r];
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4 xv = *reinterpret_cast<const float4*>(xb + m * 36 + 4 * pc);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                float& t = USE_P ? p[r][m] : acc[r][m];
                t = fmaf(w[r][0], xv.x, t);
                t = fmaf(w[r][1], xv.y, t);
                t = fmaf(w[r][2], xv.z, t);
                t = fmaf(w[r][3], xv.w, t);
            }
        }
    }
    if constexpr (USE_P) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float cx = F::NIB ? -F::CB * xb[m * 36 + 32] : 0.f;  // -(2^b + off) Σ x̂ of the chunk
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const float v = F::NIB ? fmaf(p[r][m], F::KB, cx) : p[r][m];
                acc[r][m] = fmaf(s[r], v, acc[r][m]);
            }
        }
    }
}

// Sum NV values v[0..NV) over the warp; afterwards lane l holds the total of value l >> (5 - log2 NV).
// Halving exchanges (NV - 1 shuffles) instead of one butterfly per value (5 NV shuffles); O is the lane offset.
template <int NV, int O>
struct ReduceScatter {
    static __device__ __forceinline__ void run(float (&v)[32], int lane) {
        constexpr int H = NV / 2;
        const bool up = (lane & O) != 0;
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float send = up ? v[i] : v[i + H];
            const float keep = up ? v[i + H] : v[i];
            v[i] = keep + __shfl_xor_sync(kFull, send, O);
        }
        ReduceScatter<H, O / 2>::run(v, lane);
    }
};
template <int O>
struct ReduceScatter<1, O> {
    static __device__ __forceinline__ void run(float (&v)[32], int lane) {
        v[0] += __shfl_xor_sync(kFull, v[0], O);
        ReduceScatter<1, O / 2>::run(v, lane);
    }
};
template <>
struct ReduceScatter<1, 0> {
    static __device__ __forceinline__ void run(float (&)[32], int) {}
};

// Stage rows [M0, M0 + MB) of x̂ slab [k0, k0 + kn) into xs; ss[m] += Σ x² of the elements this thread staged;
// with SX, each chunk's Σ x̂ goes to its pad float 32. Loop bounds are warp-uniform (shuffles inside).
template <int M, int M0, int MB, bool SX>
__device__ __forceinline__ void stage_rows(float* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (&ss)[M]) {
    constexpr int CS = chunk_stride(M);
    const int tid = threadIdx.x, lane = tid & 31;
    if (vec) {  // 8 lanes cover one 32-element chunk
#pragma unroll 2
        for (int e0 = 0; e0 < kn; e0 += 4 * kWarps * 32) {
            const int e = e0 + 4 * tid;
            const bool on = e < kn;  // kn % 32 == 0: a chunk's 8 lanes agree
            float4 v[MB];            // every row's load in flight together
#pragma unroll
            for (int m = 0; m < MB; ++m)
                v[m] = on ? __ldg(reinterpret_cast<const float4*>(x + (long long)(M0 + m) * ldx + k0 + e))
                          : make_float4(0.f, 0.f, 0.f, 0.f);
            float4 g = make_float4(1.f, 1.f, 1.f, 1.f);
            if (norm_w && on) {
                g = __ldg(reinterpret_cast<const float4*>(norm_w + k0 + e));
                g.x += 1.f, g.y += 1.f, g.z += 1.f, g.w += 1.f;
            }
            float* dst = xs + (e >> 5) * CS + (e & 31);
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m].x * v[m].x + v[m].y * v[m].y + v[m].z * v[m].z + v[m].w * v[m].w;
                const float4 h = make_float4(v[m].x * g.x, v[m].y * g.y, v[m].z * g.z, v[m].w * g.w);
                if (on) *reinterpret_cast<float4*>(dst + 36 * (M0 + m)) = h;
                if constexpr (SX) {
                    float t = (h.x + h.y) + (h.z + h.w);
                    t += __shfl_xor_sync(kFull, t, 1);
                    t += __shfl_xor_sync(kFull, t, 2);
                    t += __shfl_xor_sync(kFull, t, 4);
                    if (on && (lane & 7) == 0) dst[36 * (M0 + m) + 32] = t;
                }
            }
        }
    } else {  // a warp covers one chunk
#pragma unroll 4
        for (int e0 = 0; e0 < kn; e0 += kWarps * 32) {
            const int e = e0 + tid;
            const bool on = e < kn;  // kn % 32 == 0: a warp agrees
            float v[MB];
#pragma unroll
            for (int m = 0; m < MB; ++m) v[m] = on ? __ldg(x + (long long)(M0 + m) * ldx + k0 + e) : 0.f;
            const float g = norm_w && on ? 1.f + __ldg(norm_w + k0 + e) : 1.f;
            float* dst = xs + (e >> 5) * CS + (e & 31);
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m] * v[m];
                const float h = v[m] * g;
                if (on) dst[36 * (M0 + m)] = h;
                if constexpr (SX) {
                    const float t = warp_sum(h);
                    if (on && lane == 0) dst[36 * (M0 + m) + 32] = t;
                }
            }
        }
    }
}

// Stage x̂ slab [k0, k0 + kn) of every row into xs (at most 4 rows per pass: registers are short at large M,
// where 32 accumulators are live), and add each row's Σ x² to ssred[warp][m] (norm only; one writer per slot).
template <int M, bool SX>
__device__ __forceinline__ void stage_slab(float* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (*ssred)[8]) {
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.f;
    stage_rows<M, 0, (M < 4 ? M : 4), SX>(xs, x, ldx, norm_w, k0, kn, vec, ss);
    if constexpr (M > 4) stage_rows<M, 4, M - 4, SX>(xs, x, ldx, norm_w, k0, kn, vec, ss);
    if (norm_w) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float t = warp_sum(ss[m]);
            if (lane == 0) ssred[warp][m] = (k0 == 0 ? 0.f : ssred[warp][m]) + t;
        }
    }
}

}  // namespace

#define NINFER_GEMV_ARGS                                                                                      \
    const uint8_t *__restrict__ qs, const uint8_t *__restrict__ qh, const uint8_t *__restrict__ sc,           \
        const float *__restrict__ x, float *y, const float *__restrict__ norm_w,                              \
        const float *__restrict__ row_scale, int N, int K, int kp, int gshift, int ldx, int ldy, int mode,    \
        float eps, int kw_log2, int ks, int xvec
#define NINFER_GEMV_PASS \
    qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift, ldx, ldy, mode, eps, kw_log2, ks, xvec
