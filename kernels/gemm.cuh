// gemm.cuh: device pieces shared by the tensor-core GEMMs (gemm.cu: dense and grouped MoE, 128-row tiles;
// moe_gemm.cu: grouped MoE with small token tiles): cp.async / mma.sync wrappers, the packed-weight decoder, the
// expert lookup of a grouped launch. Everything is internal (anonymous namespace): each .cu gets its own copy.
#pragma once
#include "common.cuh"
#include "quant.cuh"

namespace {

enum Mode { MODE_STORE = 0, MODE_ADD = 1, MODE_SWIGLU = 2, MODE_ATOMIC_ADD = 3 };  // epilogues (gemm.py MODES)

// ------------------------------------------------------------------------------------------------ PTX helpers

// d = a * b + c on bf16x2 (sm_80+); exact whenever the true result is representable
__device__ __forceinline__ uint32_t bf2_fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// D (16×8 fp32) += A (16×16 bf16, row-major) · B (16×8 bf16, col-major)
__device__ __forceinline__ void mma_bf16(float d[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------------------------------------ decoding

// Pairing: bf16x2 register j of a thread's 8 consecutive k holds elements (2j, 2j+1), the low one in the low half,
// for every format, so a B fragment is the 16 bytes of a staged bf16 x row as they are (x_frag) and decode_row
// builds A in the same order. (The mma's own k order inside a fragment does not matter: it sums over k.)

// bf16 constants (x2): 0x4300 = 128.0; OR-ing an integer u < 128 into its mantissa gives exactly 128 + u.
constexpr uint32_t BF2_MAGIC = 0x43004300u, BF2_ONE = 0x3F803F80u;

// The 4 bf16x2 pairs j of 8 elements of one row, as exact codes: w holds the 8 codes' low nibbles (byte j: pair j,
// the first element in the low nibble), h their high bits (q5: bit 2j + e of element e of pair j; q6: bits
// 4j + 2e.. of it; q4: unused).
template <int BITS>
__device__ __forceinline__ void nibble_pairs(uint32_t w, uint32_t h, uint32_t a[4]) {
    static_assert(BITS >= 4 && BITS <= 6, "nibble formats only");
    // byte j of w and of w >> 4 brought to bits 0..3 and 16..19 by one byte permute
    const uint32_t w4 = w >> 4;
    uint32_t hh[2] = {0u, 0u};  // high bits spread so that (hh >> s·j') & mask lands pair j's at bits 4.. and 20..
    if constexpr (BITS == 5) {
        hh[0] = (h << 4) | (h << 19);  // bit 2j -> 4 + 2j, bit 2j+1 -> 20 + 2j
    } else if constexpr (BITS == 6) {
        const uint32_t h1 = h >> 8;  // pairs 2, 3: h << 18 would push pair 3's bits past bit 31
        hh[0] = (h << 4) | (h << 18);  // bits 4j, 4j+1 -> 4 + 4j.., bits 4j+2.. -> 20 + 4j..
        hh[1] = (h1 << 4) | (h1 << 18);
    }
    constexpr uint32_t NEG = BITS == 4 ? 0xC308C308u : (BITS == 5 ? 0xC310C310u : 0xC320C320u);  // -(128+off)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint32_t u = (__byte_perm(w, w4, (uint32_t)j | ((4u + j) << 8)) & 0x000F000Fu) | BF2_MAGIC;
        if constexpr (BITS == 5) u |= (hh[0] >> (2 * j)) & 0x00100010u;
        if constexpr (BITS == 6) u |= (hh[j >> 1] >> (4 * (j & 1))) & 0x00300030u;
        a[j] = bf2_fma(u, BF2_ONE, NEG);
    }
}

// The 4 bf16x2 pairs of one row's 8 consecutive k (8t..8t+7 of the 32-wide chunk at `row` of the stage),
// as exact codes (nibble formats) or the stored bf16 values, paired as above. q8: decode_row_q8_scaled.
template <int BITS>
__device__ __forceinline__ void decode_row(const uint8_t* wq, const uint8_t* wh, int row, int t, uint32_t a[4]) {
    static_assert(BITS != 8, "q8 weights are decoded already scaled: decode_row_q8_scaled");
    if constexpr (BITS == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(wq + row * 64 + 16 * t);  // (e0,e1) (e2,e3) ...
        a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
    } else {
        // element 8t+e sits in bits 4e..4e+3 of w: byte j holds elements 2j (low nibble) and 2j+1 (high nibble)
        const uint32_t w = *reinterpret_cast<const uint32_t*>(wq + row * 16 + 4 * t);
        uint32_t h = 0u;
        if constexpr (BITS == 5) h = (*reinterpret_cast<const uint32_t*>(wh + row * 4) >> (8 * t)) & 0xFFu;
        if constexpr (BITS == 6)
            h = (*reinterpret_cast<const uint32_t*>(wh + row * 8 + 4 * (t >> 1)) >> (16 * (t & 1))) & 0xFFFFu;
        nibble_pairs<BITS>(w, h, a);
    }
}

// ------------------------------------------------------------------------------------------------ scaled weights

// bf16x2 of (lo, hi), each rounded to nearest even, lo in the low half
__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// The scaled weights the GEMMs' MMAs take for q8: w = q · s rounded once to bf16. The byte u = q + 128 into the
// fp32 2^23 + u, less 2^23 + 128, is q exactly; q · s is exact in fp32 (8 × 11 bits), then one rounding.
// u[h] holds the biased codes q + 128 of pairs 2h, 2h + 1 (first element in the low byte); a[j] gets pair j.
__device__ __forceinline__ void q8_scaled_pairs(const uint32_t u[2], float s, uint32_t a[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {  // elements 4h + 2b, 4h + 2b + 1: byte n of u into 0x4B0000nn
            const float lo = __uint_as_float(__byte_perm(u[h], 0x4B000000u, 0x7540u | (2u * b))) - 8388736.f;
            const float hi = __uint_as_float(__byte_perm(u[h], 0x4B000000u, 0x7541u | (2u * b))) - 8388736.f;
            a[2 * h + b] = pack_bf2(lo * s, hi * s);
        }
    }
}

// q8 for gemm.cu's mma.sync tiles: one row's 8 consecutive k (8t..8t+7 of the chunk), paired as decode_row.
__device__ __forceinline__ void decode_row_q8_scaled(const uint8_t* wq, int row, int t, float s, uint32_t a[4]) {
    const uint2 v = *reinterpret_cast<const uint2*>(wq + row * 32 + 8 * t);  // bytes e0..e3, e4..e7
    const uint32_t u[2] = {v.x ^ 0x80808080u, v.y ^ 0x80808080u};  // stored int8 q -> q + 128
    q8_scaled_pairs(u, s, a);
}

// The 4 bf16x2 B registers of one token's 8 consecutive k: the 16 bytes at xr of a staged bf16 x row, as they
// are ((e0,e1) (e2,e3) (e4,e5) (e6,e7), the Pairing above).
__device__ __forceinline__ void x_frag(const uint8_t* xr, uint32_t b[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(xr);
    b[0] = v.x, b[1] = v.y, b[2] = v.z, b[3] = v.w;
}

// The store / add / atomic-add epilogues' output y[n] of one row (mode: MODE_STORE, MODE_ADD, MODE_ATOMIC_ADD).
__device__ __forceinline__ void store_out(int mode, float* yr, int n, float v) {
    if (mode == MODE_STORE) yr[n] = v;
    else if (mode == MODE_ADD) yr[n] += v;
    else atomicAdd(yr + n, v);
}

// The SwiGLU epilogue's output: bf16, the input format of the down projection that reads it.
__device__ __forceinline__ void store_act(float* y, size_t i, float gate, float up) {
    reinterpret_cast<uint16_t*>(y)[i] = f32_to_bf16(siluf_(gate) * up);
}

// Expert e of a grouped launch owns the block rows tile_start[e] .. tile_start[e+1]-1 (upper-bound search).
__device__ __forceinline__ int expert_of_tile(const int* __restrict__ tile_start, int E, int ty) {
    int lo = 0, hi = E;  // tile_start[lo] <= ty < tile_start[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(tile_start + mid) <= ty) lo = mid;
        else hi = mid;
    }
    return lo;
}

// Block row ty of a grouped launch (tiles of bm slots): its expert e, that expert's slots order[first ..
// first + count) and the tile's first slot m0 among them; false past tile_start[E] (a surplus block).
struct GroupTile {
    int e, first, count, m0;
};
__device__ __forceinline__ bool group_tile(const int* __restrict__ offsets, const int* __restrict__ tile_start,
                                           int E, int ty, int bm, GroupTile& gt) {
    if (ty >= __ldg(tile_start + E)) return false;
    gt.e = expert_of_tile(tile_start, E, ty);
    gt.first = __ldg(offsets + gt.e);
    gt.m0 = (ty - __ldg(tile_start + gt.e)) * bm;
    gt.count = __ldg(offsets + gt.e + 1) - gt.first;
    return true;
}

// A tile's x rows, in shared memory: row r's id rows[m0 + r] (m0 + r when rows is null) or -1 past count, and the
// offset of its x row id / xdiv (ldx elements each) or -1. Threads 0..bm-1 write one row each.
__device__ __forceinline__ void tile_rows(int* rid, long long* xoff, const int* __restrict__ rows, int count, int m0,
                                          int xdiv, int ldx, int bm) {
    const int tid = threadIdx.x;
    if (tid < bm) {
        const int m = m0 + tid, id = m < count ? (rows ? rows[m] : m) : -1;
        rid[tid] = id;
        xoff[tid] = id >= 0 ? (long long)(id / xdiv) * ldx : -1;
    }
}

}  // namespace
