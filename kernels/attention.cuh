// attention.cuh: device helpers shared by the attention kernels (attention_prepare.cu; attention.cu: the mma decode
// and its combine; attention_decode.cu: the CUDA-core decode for few query rows and its combine). No op lives here.
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

}  // namespace
