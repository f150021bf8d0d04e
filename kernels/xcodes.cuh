// xcodes.cuh: activations as int16 codes per 32-element chunk, and their exact integer dot products with the
// quantized weight formats (dp2a), for the decode GEMVs (gemv.cuh) and the MoE decode kernels (moe.cu).
//
// Codes. d = 2^(E - 140) for the biased fp32 exponent E of the chunk's largest |x| (so |x| / d < 2^14) and
// q = rint(x / d): exact scaling, one fma with 1.5·2^23 whose low 16 bits are q. Every element errs by at most
// d / 2 <= 2^-14 of the chunk's largest |x|. E < 14: q and d 0; an inf or NaN in the chunk: d NaN.
// Reference: ninfer_rt.reference.ops.act_codes16.
// A chunk record for M rows (qchunk_bytes): row m's 32 codes at +64m (q8: natural order; nibble formats: each
// 8-block as its even then its odd elements, the order of the weights' low and high nibbles), then row m's
// (float d, int Σq) at +64M + 8m.
#pragma once
#include "quant.cuh"

namespace {

// Bytes per 32-element chunk of int16 x̂ (quantized weights) for all M rows: row m's 32 codes at +64m, then
// row m's (float d, int Σq) at +64M+8m; padded to an odd number of 16-byte units, so lanes reading
// consecutive chunks hit distinct banks.
__host__ __device__ constexpr int qchunk_bytes(int M) {
    return (72 * M + 15) / 16 % 2 ? (72 * M + 15) / 16 * 16 : (72 * M + 15) / 16 * 16 + 16;
}

// The chunk's scale from its largest |x| (header): inv = 1 / d, both powers of two.
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
template <int BITS, int M, int R>
__device__ __forceinline__ void compute_unit_q(const Unit (&d)[R], const uint8_t* rec, int half, float (&acc)[R][M]) {
    constexpr int NW = BITS == 8 ? 4 : 8;  // int8x4 words per row and unit
    uint32_t w[R][NW];
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
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
        int t[R];
#pragma unroll
        for (int r = 0; r < R; ++r) t[r] = 0;
#pragma unroll
        for (int j = 0; j < NW / 2; ++j) {
            const int4 xv = xq[j];  // 8 codes: q8 elements 8j..8j+7; nibble 8j, +2, +4, +6, +1, +3, +5, +7
#pragma unroll
            for (int r = 0; r < R; ++r) {
                t[r] = __dp2a_lo(xv.x, (int)w[r][2 * j], t[r]);
                t[r] = __dp2a_hi(xv.y, (int)w[r][2 * j], t[r]);
                t[r] = __dp2a_lo(xv.z, (int)w[r][2 * j + 1], t[r]);
                t[r] = __dp2a_hi(xv.w, (int)w[r][2 * j + 1], t[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if constexpr (BITS != 8) t[r] -= (1 << (BITS - 1)) * __float_as_int(meta.y);
            acc[r][m] = fmaf((float)t[r], s[r] * meta.x, acc[r][m]);
        }
    }
}

// Store the int16 codes of 4 consecutive elements (chunk offset c4 = 4i) of one row, held by the 8 lanes of a
// chunk (lane & 7 == i): codes in the order compute_unit_q reads (XQ 1 natural, XQ 2 the nibble formats' even
// then odd elements of each 8-block), and lane 0 of the chunk the (d, Σq) pair. rec: the chunk's record.
// rows: the record's M, at run time (store_codes4 below fixes it).
template <int XQ>
__device__ __forceinline__ void store_codes4_rows(uint8_t* rec, int rows, int m, int c4, float4 h, bool on) {
    float am = fmax_nan(fmax_nan(fabsf(h.x), fabsf(h.y)), fmax_nan(fabsf(h.z), fabsf(h.w)));
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 2));
    am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, 4));
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
    sq += __shfl_xor_sync(0xffffffffu, sq, 1);
    sq += __shfl_xor_sync(0xffffffffu, sq, 2);
    sq += __shfl_xor_sync(0xffffffffu, sq, 4);
    if (on) {
        uint32_t* codes = reinterpret_cast<uint32_t*>(rec + 64 * m);
        codes[pa >> 1] = wa;
        codes[pb >> 1] = wb;
        if ((c4 & 31) == 0) *reinterpret_cast<float2*>(rec + 64 * rows + 8 * m) = make_float2(qs.d, __int_as_float(sq));
    }
}
template <int M, int XQ>
__device__ __forceinline__ void store_codes4(uint8_t* rec, int m, int c4, float4 h, bool on) {
    store_codes4_rows<XQ>(rec, M, m, c4, h, on);
}

// The same for one element per lane, a whole warp holding the chunk (lane = chunk offset); rows: the record's M,
// at run time (store_code1 below fixes it).
template <int XQ>
__device__ __forceinline__ void store_code1_rows(uint8_t* rec, int rows, int m, int lane, float h, bool on) {
    float am = fabsf(h);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) am = fmax_nan(am, __shfl_xor_sync(0xffffffffu, am, o));
    const QScale qs = chunk_scale(am);
    const uint32_t f = q16_bits(h, qs.inv);
    int sq = (int)f - 0x4B400000;  // the code as an int
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    const int p = XQ == 1 ? lane : (lane & ~7) + ((lane & 7) >> 1) + 4 * (lane & 1);
    if (on) {
        reinterpret_cast<uint16_t*>(rec + 64 * m)[p] = (uint16_t)f;
        if (lane == 0) *reinterpret_cast<float2*>(rec + 64 * rows + 8 * m) = make_float2(qs.d, __int_as_float(sq));
    }
}
template <int M, int XQ>
__device__ __forceinline__ void store_code1(uint8_t* rec, int m, int lane, float h, bool on) {
    store_code1_rows<XQ>(rec, M, m, lane, h, on);
}

// Records in the order a consumer chooses at run time (xq: its XQ, 1 or 2), for producers that feed weights of
// either kind: row m of an M-row record (rows = M at run time; the DeltaNet step, the attention combine), or a
// one-row record (the SwiGLU GEMV's y records)
__device__ __forceinline__ void store_codes4_rows_xq(int xq, uint8_t* rec, int rows, int m, int c4, float4 h,
                                                     bool on) {
    if (xq == 1) store_codes4_rows<1>(rec, rows, m, c4, h, on);
    else store_codes4_rows<2>(rec, rows, m, c4, h, on);
}
__device__ __forceinline__ void store_code1_rows_xq(int xq, uint8_t* rec, int rows, int m, int lane, float h) {
    if (xq == 1) store_code1_rows<1>(rec, rows, m, lane, h, true);
    else store_code1_rows<2>(rec, rows, m, lane, h, true);
}
__device__ __forceinline__ void store_code1_xq(int xq, uint8_t* rec, int lane, float h, bool on) {
    if (xq == 1) store_code1<1, 1>(rec, 0, lane, h, on);
    else store_code1<1, 2>(rec, 0, lane, h, on);
}

}  // namespace
