// attention_prepare.cu: the step of gated full attention before the split-KV kernels (attention.cu,
// attention_decode.cu): q/k RMSNorm and partial RoPE, and the new k/v rows into the KV cache
// (ninfer_rt/reference/model.py GatedAttention.__call__ from `qg, k, v` to the rotated q and cached k, v).
//
// attn_prepare_d{D}: for token t of sequence b (row m = b*T + t of M = B*T), position p = pos[b] + t:
//     q_h = rope(rms_norm_zc(q_h, q_norm)), k_h = rope(rms_norm_zc(k_h, k_norm)), v_h as is
//     (ops.rms_norm_zc, ops.rope_cos_sin + ops.apply_rope for text positions: NeoX rotate-half on the first rot dims,
//     angle_j = float(p) * inv_freq[j] in fp32, cos/sin accurate (double-precision range reduction + series, not the
//     fast intrinsics) times rope_scale). q -> q_out; k, v -> cache slot[b] at position p: bf16 round-to-nearest-even,
//     or int8 codes rint(x / s) clamped to +-127 with s = max|x| / 127 per (position, kv head); a zero vector stores
//     s = 0 and codes 0 (it dequantises to zeros).
//
// Layouts (row-major): qkvg fp32 [M, ld]: [q (nH*D) | k (nKV*D) | v (nKV*D) | gate (nH*D)]; q_out fp32 [M, nH, D];
//   cache k, v [slots, max_ctx, nKV, D] bf16 bits or int8 codes; k_scale, v_scale fp32 [slots, max_ctx, nKV].
#include "attention_prep.cuh"  // rope_table, norm_rope_row, cache_row_store

namespace {

// ------------------------------------------------------------------------------------------------ prepare

// grid (M, ceil((nH + 2 nKV) / 4)), block 128: warp w of block y handles head unit u = 4y + w of row m
// (u < nH: q head u; u < nH + nKV: k head u - nH; else v head u - nH - nKV).
template <int D>
__device__ __forceinline__ void prepare_impl(const float* __restrict__ qkvg, int ld, const float* __restrict__ q_norm,
                                             const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                                             float rope_scale, int rot, const int* __restrict__ pos,
                                             const int* __restrict__ slot, int T, int nH, int nKV, float eps,
                                             void* kc, void* vc, float* ks, float* vs, int slots, int max_ctx,
                                             int int8, float* __restrict__ q_out) {
    constexpr int PER = D / 32;
    __shared__ float cos_s[D / 2], sin_s[D / 2];
    __shared__ float x_s[4][D];
    const int m = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = m / T, t = m - b * T;
    // Before the wait: the positions (uploaded before the graph ran), the rotation and the norm's gains do not
    // depend on the predecessor, which only writes qkvg; the double-precision cos/sin chain is the longest part.
    const int p = pos[b] + t, sl = slot[b];
    const int half = rot / 2;
    rope_table(cos_s, sin_s, p, inv_freq, rope_scale, half, threadIdx.x, blockDim.x);
    const int u = blockIdx.y * 4 + warp;
    const bool is_v = u >= nH + nKV;
    float gain[PER];
    if (u < nH + nKV) norm_gain_row<D>(gain, u < nH ? q_norm : k_norm, lane);
    ninfer_pdl_begin();
    __syncthreads();
    if (u >= nH + 2 * nKV) return;

    float x[PER];
    const float* src = qkvg + (size_t)m * ld + (size_t)u * D;  // q, k, v columns are contiguous: unit u at u*D
#pragma unroll
    for (int i = 0; i < PER; ++i) x[i] = src[lane + 32 * i];

    if (!is_v) {
        norm_rope_row<D>(x, gain, x_s[warp], cos_s, sin_s, half, rot, eps, lane);
        if (u < nH) {
            float* dst = q_out + ((size_t)m * nH + u) * D;
#pragma unroll
            for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = x[i];
            return;
        }
    }
    // a key or value head: into the cache (nothing is written for an out-of-range slot or position)
    if (sl < 0 || sl >= slots || p < 0 || p >= max_ctx) return;
    const int h = is_v ? u - nH - nKV : u - nH;
    const size_t row = ((size_t)sl * max_ctx + p) * nKV + h;
    cache_row_store<D>(x, is_v ? vc : kc, is_v ? vs : ks, row, int8 != 0, lane);
}

}  // namespace

// ------------------------------------------------------------------------------------------------ entry points

#define NINFER_PREPARE(D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) attn_prepare_d##D(                                         \
        const float* qkvg, int ld, const float* q_norm, const float* k_norm, const float* inv_freq,              \
        float rope_scale, int rot, const int* pos, const int* slot, int T, int nH, int nKV, float eps, void* kc,  \
        void* vc, float* ks, float* vs, int slots, int max_ctx, int int8, float* q_out) {                \
        prepare_impl<D>(qkvg, ld, q_norm, k_norm, inv_freq, rope_scale, rot, pos, slot, T, nH, nKV, eps, kc, vc, \
                        ks, vs, slots, max_ctx, int8, q_out);                                                     \
    }

NINFER_PREPARE(32)
NINFER_PREPARE(64)
NINFER_PREPARE(128)
NINFER_PREPARE(256)
