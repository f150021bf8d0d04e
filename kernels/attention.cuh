// attention.cuh: device helpers shared by the attention kernels (attention_prepare.cu; attention.cu: the mma decode
// and its combine; attention_prefill.cu: the mma prefill; attention_decode.cu: the CUDA-core decode for few query
// rows and its combine): the mma fragment geometry and the K/V tile swizzle among them. No op lives here.
#pragma once
#include "common.cuh"

namespace {

constexpr float kMasked = -1e30f;          // score of a masked key (finite: no inf arithmetic under fast math)
constexpr unsigned kFull = 0xffffffffu;

// Byte i of u (= 4 int8 codes ^ 0x80808080) as an exact float: the bits 0x4B0000uu are 2^23 + code + 128.
__device__ __forceinline__ float i8_at(uint32_t u, int i) {
    return __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u | i)) - 8388736.f;
}

// Keys per split for a sequence whose last token sees n keys: the launch's cs, or with a runtime split (rt != 0)
// n dealt evenly over the n_splits splits in whole 32-key steps, never fewer than cs, so whatever the context
// within its graph's bucket, every split is busy and equally long. The decode and its combine both call this.
__device__ __forceinline__ int split_keys(int cs, int n_splits, int n, int rt) {
    if (!rt) return cs;
    const int even = (n + n_splits - 1) / n_splits;
    return max(cs, (even + 31) & ~31);
}

template <int BYTES>
__device__ __forceinline__ void lds(uint32_t* w, const unsigned char* p) {
    if constexpr (BYTES == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (BYTES == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x, w[1] = v.y;
    } else {
        static_assert(BYTES == 4, "runs are 4, 8 or 16 bytes");
        w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
}

// ------------------------------------------------------------------------------------------------ mma helpers

// D += A(16x16, row) * B(16x8, col), bf16 in, fp32 accumulate
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

// Two floats exactly representable in bf16 (small integers) -> packed bf16x2, lo in the low half.
__device__ __forceinline__ uint32_t pack_exact(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632u);
}

// Fragment geometry (lane = 4g + t). mma m16n8k16: A reg0 = (row g, k 2t..2t+1), reg1 = (row g+8, same k),
// reg2 = (row g, k 2t+8..2t+9), reg3 = (row g+8, k 2t+8..); B reg0 = (k 2t..2t+1, col g), reg1 = (k 2t+8.., col g);
// C c0,c1 = (row g, col 2t, 2t+1), c2,c3 = (row g+8, same cols).
// QK^T: k indices are permuted so each lane reads one contiguous run: in K group c (16*KS dims), k-step s, the
//   lane's k slots {2t, 2t+1, 2t+8, 2t+9} are dims 16*KS*c + 4*KS*t + 4s + {0,1,2,3}, for q and k alike.
//   n-tile j of a 16-key step holds keys sigma(j, n) = 4*(n/2) + 2j + n%2, so lane t's scores are keys 4t..4t+3.
// PV: k slot {2t, 2t+1, 2t+8, 2t+9} = keys 4t + {0,1,2,3}, which makes P's A fragment the scores' C fragments;
//   in V group a (8E dims) n-tile u, column n is dim 8E*a + E*n + u, so lane g reads one run of E dims per key row.
template <int D, bool I8>
struct Geo {
    static constexpr int ES = I8 ? 1 : 2;                                 // bytes per cached element
    static constexpr int RB = D * ES;                                     // bytes per cached row (key, kv head)
    static constexpr int KS = I8 ? (D / 16 < 4 ? D / 16 : 4) : 2;         // k-steps per K run
    static constexpr int KRUN = 4 * KS * ES;                              // bytes of a lane's K run
    static constexpr int NKG = D / (16 * KS);                             // K groups
    static constexpr int E = I8 ? (D / 8 < 16 ? D / 8 : 16) : (D / 8 < 8 ? D / 8 : 8);  // V dims per run
    static constexpr int VRUN = E * ES;
    static constexpr int NVG = D / (8 * E);                               // V groups
    static constexpr int QSTRIDE = 2 * D + (KS == 4 ? 16 : 64);           // padded bf16 q row: conflict-free runs
    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim");
};

// Offset of byte `byte` of row `row` in a 16-row K/V tile. Rows of >= 128 bytes are XOR-swizzled in 16-byte chunks
// so that both the K reads (rows r, r^1 together) and the V reads (rows 4t+i for t = 0..3) are bank-conflict free.
template <int RB>
__device__ __forceinline__ int tile_off(int row, int byte) {
    if constexpr (RB >= 128) {
        const int sw = ((row & 1) << 2) ^ (((row >> 2) & 3) << 1);
        return row * RB + ((((byte >> 4) ^ sw) << 4) | (byte & 15));
    } else {
        return row * RB + byte;
    }
}

}  // namespace
