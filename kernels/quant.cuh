// quant.cuh: decode 32 consecutive elements of one stored weight row, for every weight format.
//
// Layouts (docs/format.md "Weight formats", ninfer_rt/formats.py): a q{b}g{G} tensor has R rows of Kp = K padded
// to 128, in planes
//   qs  b=4,5,6: uint8 [R, Kp/2], element 2i in the low nibble of byte i, 2i+1 in the high nibble (u & 15)
//       b=8:     int8  [R, Kp], the code itself
//   qh  b=5: uint8 [R, Kp/8], bit j of byte i = bit 4 of u for element 8i+j   -> one LE uint32 per 32 elements
//       b=6: uint8 [R, Kp/4], bits 2j..2j+1 of byte i = bits 4..5 of u, 4i+j -> one LE uint64 per 32 elements
//   sc  fp16 [R, Kp/G]
// with u = q + 2^(b-1), value = float(sc[r, k/G]) * q. G >= 32, so a 32-element chunk has one scale.
// Raw bf16 rows are [R, K] uint16 (K unpadded, a multiple of 32 for the kernels that read them here).
// Reference: ninfer_rt.formats.IntFormat.decode / RawFormat.decode (bit-exact: codes are small integers).
#pragma once
#include "common.cuh"

// Pointers to the start of one row in each plane.
struct QRow {
    const uint8_t* qs;
    const uint8_t* qh;
    const __half* sc;
};

template <int BITS>
__device__ __forceinline__ QRow q_row(const uint8_t* qs, const uint8_t* qh, const __half* sc, long long row, int kp,
                                      int group) {
    QRow r;
    r.qs = qs + row * (long long)(BITS == 8 ? kp : kp / 2);
    r.qh = BITS == 5 ? qh + row * (long long)(kp / 8) : (BITS == 6 ? qh + row * (long long)(kp / 4) : nullptr);
    r.sc = sc + row * (long long)(kp / group);
    return r;
}

// Codes (as floats, unscaled) of elements [32c, 32c + 32) of the row.
template <int BITS>
__device__ __forceinline__ void q_chunk32(const QRow& r, int c, float w[32]) {
    if constexpr (BITS == 8) {
        const int4* p = reinterpret_cast<const int4*>(r.qs + 32 * (long long)c);
        int4 a = __ldg(p), b = __ldg(p + 1);
        const int v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) w[4 * i + j] = (float)(int8_t)((v[i] >> (8 * j)) & 0xFF);
        }
    } else {
        int4 a = __ldg(reinterpret_cast<const int4*>(r.qs + 16 * (long long)c));
        const uint32_t v[4] = {(uint32_t)a.x, (uint32_t)a.y, (uint32_t)a.z, (uint32_t)a.w};
        uint64_t hi = 0;
        if constexpr (BITS == 5) hi = __ldg(reinterpret_cast<const uint32_t*>(r.qh) + c);
        if constexpr (BITS == 6) hi = __ldg(reinterpret_cast<const unsigned long long*>(r.qh) + c);
        constexpr int OFF = 1 << (BITS - 1);
#pragma unroll
        for (int e = 0; e < 32; ++e) {
            int u = (v[e >> 3] >> (4 * (e & 7))) & 0xF;
            if constexpr (BITS == 5) u |= (int)((hi >> e) & 1u) << 4;
            if constexpr (BITS == 6) u |= (int)((hi >> (2 * e)) & 3u) << 4;
            w[e] = (float)(u - OFF);
        }
    }
}

// Scale of the group holding chunk c (chunk = 32 elements).
template <int GROUP>
__device__ __forceinline__ float q_scale(const QRow& r, int c) {
    return __half2float(r.sc[(32 * c) / GROUP]);
}

// bf16 row: elements [32c, 32c + 32) as floats.
__device__ __forceinline__ void bf16_chunk32(const uint16_t* row, int c, float w[32]) {
    const int4* p = reinterpret_cast<const int4*>(row + 32 * (long long)c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int4 a = __ldg(p + i);
        const uint32_t v[4] = {(uint32_t)a.x, (uint32_t)a.y, (uint32_t)a.z, (uint32_t)a.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            w[8 * i + 2 * j] = __uint_as_float(v[j] << 16);
            w[8 * i + 2 * j + 1] = __uint_as_float(v[j] & 0xFFFF0000u);
        }
    }
}

// Format dispatch table used by the extern "C" wrappers: X(name, BITS, GROUP) for every quantized format.
#define NINFER_QFORMATS(X) \
    X(q4g32, 4, 32) X(q4g64, 4, 64) X(q4g128, 4, 128) \
    X(q5g32, 5, 32) X(q5g64, 5, 64) X(q5g128, 5, 128) \
    X(q6g32, 6, 32) X(q6g64, 6, 64) X(q6g128, 6, 128) \
    X(q8g32, 8, 32) X(q8g64, 8, 64) X(q8g128, 8, 128)
