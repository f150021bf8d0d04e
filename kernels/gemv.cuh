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
    static constexpr int XQ = BITS == 16 ? 0 : (BITS == 8 ? 1 : 2);  // x̂: fp32 / int16 natural / nibble order
};

__host__ __device__ constexpr int log2i(int n) { return n <= 1 ? 0 : 1 + log2i(n / 2); }
__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }
// Floats per 32-element chunk of x̂ for all M rows: row m at +36m; the stride is 4 (mod 8) float4s, so lanes
// reading consecutive units hit distinct banks.
__host__ __device__ constexpr int chunk_stride(int M) { return 36 * M + (M % 2 == 0 ? 4 : 0); }
// Bytes per 32-element chunk of int16 x̂ (quantized weights) for all M rows: row m's 32 codes at +64m, then
// row m's (float d, int Σq) at +64M+8m; padded to an odd number of 16-byte units, so lanes reading
// consecutive chunks hit distinct banks.
__host__ __device__ constexpr int qchunk_bytes(int M) {
    return (72 * M + 15) / 16 % 2 ? (72 * M + 15) / 16 * 16 : (72 * M + 15) / 16 * 16 + 16;
}

// x̂ as int16 codes, per 32-element chunk (quantized weights): d = 2^(E - 140) for the biased exponent E of the
// chunk's largest |x̂|, so |x̂| / d < 2^14 and q = rint(x̂ / d) keeps >= 13 significant bits of the largest
// value (elements err by <= d / 2 <= 2^-14 of it). Scaling by a power of two is exact, and rint is one fma
// with 1.5·2^23, whose low 16 bits are q itself. E < 14 (|x̂| < 2^-113): codes and d 0; inf or NaN: d NaN.
struct QScale {
    float inv, d;
};
__device__ __forceinline__ QScale chunk_scale(float amax) {
    const int E = (int)(__float_as_uint(amax) >> 23);  // amax >= 0 or NaN
    if (E >= 255) return {0.f, __int_as_float(0x7FC00000)};
    if (E < 14) return {0.f, 0.f};
    return {__uint_as_float((uint32_t)(267 - E) << 23), __uint_as_float((uint32_t)(E - 13) << 23)};
}
__device__ __forceinline__ uint32_t q16_bits(float h, float inv) {
    return __float_as_uint(fmaf(h, inv, 12582912.f));  // low 16 bits: rint(h · inv) as int16
}
// max that keeps NaN (fmaxf drops it), so a NaN input makes its chunk's d NaN, as the fp32 path would
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// One unit of one row as loaded: 16 code bytes, high bits (q5: 32 bits, q6: 64 bits), fp16 scale bits.
struct Unit {
    int4 q;
    uint32_t h0, h1;
    unsigned short sc;
};

__device__ __forceinline__ uint32_t word_of(const int4& q, int j) {
    return (uint32_t)(j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w);
}

// Elements 4pc..4pc+3 of a bf16 unit as floats.
__device__ __forceinline__ void bf16_piece(const Unit& d, int pc, float w[4]) {
    const uint32_t a = word_of(d.q, 2 * pc), b = word_of(d.q, 2 * pc + 1);
    w[0] = __uint_as_float(a << 16);
    w[1] = __uint_as_float(a & 0xFFFF0000u);
    w[2] = __uint_as_float(b << 16);
    w[3] = __uint_as_float(b & 0xFFFF0000u);
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

// acc[r][m] += Σ_{e in unit} W[r][e] · x̂[m][e] for bf16 weights and fp32 x̂; xb points at the unit's x̂ for
// m = 0 (row m at +36m).
template <int M>
__device__ __forceinline__ void compute_unit_bf16(const Unit (&d)[kRows], const float* xb, float (&acc)[kRows][M]) {
#pragma unroll
    for (int pc = 0; pc < 2; ++pc) {
        float w[kRows][4];
#pragma unroll
        for (int r = 0; r < kRows; ++r) bf16_piece(d[r], pc, w[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4 xv = *reinterpret_cast<const float4*>(xb + m * 36 + 4 * pc);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                float& t = acc[r][m];
                t = fmaf(w[r][0], xv.x, t);
                t = fmaf(w[r][1], xv.y, t);
                t = fmaf(w[r][2], xv.z, t);
                t = fmaf(w[r][3], xv.w, t);
            }
        }
    }
}

// Word j of a nibble-format unit (elements 8j..8j+7) as two int8x4 words of u = q + 2^(b-1): lo holds elements
// 8j, 8j+2, 8j+4, 8j+6 in bytes 0..3, hi elements 8j+1, 8j+3, 8j+5, 8j+7 (the int16 x̂ is staged in that order).
template <int BITS>
__device__ __forceinline__ void nibble_words(const Unit& d, int j, uint32_t& lo, uint32_t& hi) {
    const uint32_t v = word_of(d.q, j);
    lo = v & 0x0F0F0F0Fu;
    hi = (v >> 4) & 0x0F0F0F0Fu;
    if constexpr (BITS == 5) {
        // bit e of byte j of qh is bit 4 of element 8j+e: bits 0,2,4,6 -> bit 4 of bytes 0..3 (shifts 4, 10, 16,
        // 22 in one multiply; the cross terms land on other bits or carry into bits 11, 17, 23 only)
        const uint32_t hb = d.h0 >> (8 * j);
        lo |= ((hb & 0x55u) * 0x410410u) & 0x10101010u;
        hi |= (((hb >> 1) & 0x55u) * 0x410410u) & 0x10101010u;
    } else if constexpr (BITS == 6) {
        // 16-bit field j of qh: bits 2e..2e+1 are bits 4..5 of element 8j+e; nibble i of the field -> byte i of y
        const uint32_t h = j < 2 ? d.h0 : d.h1;
        const uint32_t a = __byte_perm(h, 0u, (j & 1) ? 0x4342u : 0x4140u);
        const uint32_t y = (a | (a << 4)) & 0x0F0F0F0Fu;
        lo |= (y << 4) & 0x30303030u;
        hi |= (y << 2) & 0x30303030u;
    }
}

// acc[r][m] += Σ_{e in unit} W[r][e] · x̂[m][e] with x̂ as int16 codes (quantized weights): exact integer dot
// products (dp2a: two int16 x̂ codes times two int8 weight codes per instruction), then one scale per unit:
// s_w · d_m · (Σ u q - 2^(b-1) Σ q) for the nibble formats, s_w · d_m · Σ code · q for q8. rec: the unit's
// chunk record (qchunk_bytes); half: which 16 elements of the chunk a q8 unit holds.
template <int BITS, int M>
__device__ __forceinline__ void compute_unit_q(const Unit (&d)[kRows], const uint8_t* rec, int half,
                                               float (&acc)[kRows][M]) {
    constexpr int NW = BITS == 8 ? 4 : 8;  // int8x4 words per row and unit
    uint32_t w[kRows][NW];
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        s[r] = __half2float(__ushort_as_half(d[r].sc));
        if constexpr (BITS == 8) {
#pragma unroll
            for (int j = 0; j < 4; ++j) w[r][j] = word_of(d[r].q, j);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) nibble_words<BITS>(d[r], j, w[r][2 * j], w[r][2 * j + 1]);
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const int4* xq = reinterpret_cast<const int4*>(rec + 64 * m + 32 * half);
        const float2 meta = *reinterpret_cast<const float2*>(rec + 64 * M + 8 * m);  // (d, Σq as int bits)
        int t[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) t[r] = 0;
#pragma unroll
        for (int j = 0; j < NW / 2; ++j) {
            const int4 xv = xq[j];  // 8 codes: q8 elements 8j..8j+7; nibble 8j, +2, +4, +6, +1, +3, +5, +7
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                t[r] = __dp2a_lo(xv.x, (int)w[r][2 * j], t[r]);
                t[r] = __dp2a_hi(xv.y, (int)w[r][2 * j], t[r]);
                t[r] = __dp2a_lo(xv.z, (int)w[r][2 * j + 1], t[r]);
                t[r] = __dp2a_hi(xv.w, (int)w[r][2 * j + 1], t[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            if constexpr (BITS != 8) t[r] -= (1 << (BITS - 1)) * __float_as_int(meta.y);
            acc[r][m] = fmaf((float)t[r], s[r] * meta.x, acc[r][m]);
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

// Store the int16 codes of 4 consecutive elements (chunk offset c4 = 4i) of one row, held by the 8 lanes of a
// chunk (lane & 7 == i): codes in the order compute_unit_q reads (XQ 1 natural, XQ 2 the nibble formats' even
// then odd elements of each 8-block), and lane 0 of the chunk the (d, Σq) pair. rec: the chunk's record.
template <int M, int XQ>
__device__ __forceinline__ void store_codes4(uint8_t* rec, int m, int c4, float4 h, bool on) {
    float am = fmax_nan(fmax_nan(fabsf(h.x), fabsf(h.y)), fmax_nan(fabsf(h.z), fabsf(h.w)));
    am = fmax_nan(am, __shfl_xor_sync(kFull, am, 1));
    am = fmax_nan(am, __shfl_xor_sync(kFull, am, 2));
    am = fmax_nan(am, __shfl_xor_sync(kFull, am, 4));
    const QScale qs = chunk_scale(am);
    const uint32_t f0 = q16_bits(h.x, qs.inv), f1 = q16_bits(h.y, qs.inv), f2 = q16_bits(h.z, qs.inv),
                   f3 = q16_bits(h.w, qs.inv);
    uint32_t wa, wb;  // two int16 pairs
    int pa, pb;       // their int16 positions in the row's 32 codes
    if constexpr (XQ == 1) {
        wa = __byte_perm(f0, f1, 0x5410), wb = __byte_perm(f2, f3, 0x5410), pa = c4, pb = c4 + 2;
    } else {  // elements 8b + 4o + 0..3 go to positions 8b + 2o + {0, 4, 1, 5}
        wa = __byte_perm(f0, f2, 0x5410), wb = __byte_perm(f1, f3, 0x5410);
        pa = (c4 & ~7) + ((c4 >> 1) & 2), pb = pa + 4;
    }
    int sq = __dp2a_lo((int)wa, 0x0101, __dp2a_lo((int)wb, 0x0101, 0));  // Σ of the 4 codes
    sq += __shfl_xor_sync(kFull, sq, 1);
    sq += __shfl_xor_sync(kFull, sq, 2);
    sq += __shfl_xor_sync(kFull, sq, 4);
    if (on) {
        uint32_t* codes = reinterpret_cast<uint32_t*>(rec + 64 * m);
        codes[pa >> 1] = wa;
        codes[pb >> 1] = wb;
        if ((c4 & 31) == 0) *reinterpret_cast<float2*>(rec + 64 * M + 8 * m) = make_float2(qs.d, __int_as_float(sq));
    }
}

// The same for one element per lane, a whole warp holding the chunk (lane = chunk offset).
template <int M, int XQ>
__device__ __forceinline__ void store_code1(uint8_t* rec, int m, int lane, float h, bool on) {
    float am = fabsf(h);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) am = fmax_nan(am, __shfl_xor_sync(kFull, am, o));
    const QScale qs = chunk_scale(am);
    const uint32_t f = q16_bits(h, qs.inv);
    int sq = (int)f - 0x4B400000;  // the code as an int
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(kFull, sq, o);
    const int p = XQ == 1 ? lane : (lane & ~7) + ((lane & 7) >> 1) + 4 * (lane & 1);
    if (on) {
        reinterpret_cast<uint16_t*>(rec + 64 * m)[p] = (uint16_t)f;
        if (lane == 0) *reinterpret_cast<float2*>(rec + 64 * M + 8 * m) = make_float2(qs.d, __int_as_float(sq));
    }
}

// Stage rows [M0, M0 + MB) of x̂ slab [k0, k0 + kn) into xs; ss[m] += Σ x² of the elements this thread staged.
// XQ 0 (bf16 weights): fp32 chunks of chunk_stride(M) floats; XQ 1 / 2 (quantized weights): int16 chunk
// records of qchunk_bytes(M) (store_codes4). Loop bounds are warp-uniform (shuffles inside).
template <int M, int M0, int MB, int XQ>
__device__ __forceinline__ void stage_rows(void* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (&ss)[M]) {
    constexpr int CS = chunk_stride(M), CB = qchunk_bytes(M);
    float* xf = reinterpret_cast<float*>(xs);
    uint8_t* xb = reinterpret_cast<uint8_t*>(xs);
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
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m].x * v[m].x + v[m].y * v[m].y + v[m].z * v[m].z + v[m].w * v[m].w;
                const float4 h = make_float4(v[m].x * g.x, v[m].y * g.y, v[m].z * g.z, v[m].w * g.w);
                if constexpr (XQ) {
                    store_codes4<M, XQ>(xb + (e >> 5) * CB, M0 + m, e & 31, h, on);
                } else {
                    if (on) *reinterpret_cast<float4*>(xf + (e >> 5) * CS + (e & 31) + 36 * (M0 + m)) = h;
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
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m] * v[m];
                const float h = v[m] * g;
                if constexpr (XQ) {
                    store_code1<M, XQ>(xb + (e >> 5) * CB, M0 + m, lane, h, on);
                } else {
                    if (on) xf[(e >> 5) * CS + (e & 31) + 36 * (M0 + m)] = h;
                }
            }
        }
    }
}

// Stage x̂ slab [k0, k0 + kn) of every row into xs (at most 4 rows per pass: registers are short at large M,
// where 32 accumulators are live), and add each row's Σ x² to ssred[warp][m] (norm only; one writer per slot).
template <int M, int XQ>
__device__ __forceinline__ void stage_slab(void* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (*ssred)[8]) {
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.f;
    stage_rows<M, 0, (M < 4 ? M : 4), XQ>(xs, x, ldx, norm_w, k0, kn, vec, ss);
    if constexpr (M > 4) stage_rows<M, 4, M - 4, XQ>(xs, x, ldx, norm_w, k0, kn, vec, ss);
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
