// norm.cu: row-wise ops on the residual stream, fp32 in.
//
//   rms_norm       y[m, :] = (x[m, :] · rsqrt(mean(x[m, :]²) + eps)) · (1 + w)     ref: ops.rms_norm_zc, fp32
//   rms_norm_bf16  the same, y rounded to bf16 (the prefill GEMMs' input)          ref: the same, .to(bfloat16)
//   cast_bf16      y[m, :] = bf16(x[m, :])                                          ref: x.to(torch.bfloat16)
//
// Layouts: x [M, D] fp32 with row stride ldx; y [M, D] fp32 or bf16 (round to nearest even) with row stride ldy;
// w [D] fp32, stored centred at 0 (the gain is 1 + w). One block per row. rms_norm's y may be x (in place,
// ldx == ldy): each thread reads its elements before the block reduction and writes those same elements after it.
// 16-byte loads (and 16- or 8-byte stores) when x, y, w and both strides allow them, else scalar ones.
#include "common.cuh"

namespace {

__device__ __forceinline__ void store4(float* y, float4 o) { *reinterpret_cast<float4*>(y) = o; }
__device__ __forceinline__ void store4(uint16_t* y, float4 o) {
    *reinterpret_cast<uint2*>(y) = make_uint2(f32_to_bf16(o.x) | (uint32_t)f32_to_bf16(o.y) << 16,
                                              f32_to_bf16(o.z) | (uint32_t)f32_to_bf16(o.w) << 16);
}
__device__ __forceinline__ void store1(float* y, float v) { *y = v; }
__device__ __forceinline__ void store1(uint16_t* y, float v) { *y = f32_to_bf16(v); }

template <typename Y>
__device__ __forceinline__ bool vec_ok(const float* x, const Y* y, const float* w, int D, long long ldx,
                                       long long ldy) {
    return ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0 &&
           (reinterpret_cast<uintptr_t>(y) & (4 * sizeof(Y) - 1)) == 0 &&
           ((static_cast<long long>(D) | ldx | ldy) & 3) == 0;
}

template <typename Y>
__device__ __forceinline__ void rms_norm_row(const float* x, Y* y, const float* w, int D, long long ldx,
                                             long long ldy, float eps) {
    __shared__ float red[32];
    const long long m = blockIdx.x;
    const float* xr = x + m * ldx;
    Y* yr = y + m * ldy;
    const bool vec = vec_ok(x, y, w, D, ldx, ldy);

    float ss = 0.f;
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        for (int i = threadIdx.x; i < (D >> 2); i += blockDim.x) {
            const float4 v = x4[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
    }
    ss = block_sum(ss, red);
    // Correctly rounded divide and rsqrt: --use_fast_math would otherwise give 2-ulp approximations.
    const float r = __frsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(D)), eps));

    // Same rounding order as the reference: (x · r) · (1 + w).
    if (vec) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        for (int i = threadIdx.x; i < (D >> 2); i += blockDim.x) {
            const float4 v = x4[i], g = w4[i];
            store4(yr + 4 * i, make_float4(__fmul_rn(__fmul_rn(v.x, r), 1.f + g.x),
                                           __fmul_rn(__fmul_rn(v.y, r), 1.f + g.y),
                                           __fmul_rn(__fmul_rn(v.z, r), 1.f + g.z),
                                           __fmul_rn(__fmul_rn(v.w, r), 1.f + g.w)));
        }
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) store1(yr + i, __fmul_rn(__fmul_rn(xr[i], r), 1.f + w[i]));
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024) rms_norm(const float* x, float* y, const float* w, int D,
                                                            long long ldx, long long ldy, float eps) {
    ninfer_pdl_begin();
    rms_norm_row(x, y, w, D, ldx, ldy, eps);
}

extern "C" __global__ void __launch_bounds__(1024) rms_norm_bf16(const float* x, uint16_t* y, const float* w, int D,
                                                                 long long ldx, long long ldy, float eps) {
    ninfer_pdl_begin();
    rms_norm_row(x, y, w, D, ldx, ldy, eps);
}

extern "C" __global__ void __launch_bounds__(1024) cast_bf16(const float* x, uint16_t* y, int D, long long ldx,
                                                             long long ldy) {
    ninfer_pdl_begin();
    const long long m = blockIdx.x;
    const float* xr = x + m * ldx;
    uint16_t* yr = y + m * ldy;
    if (vec_ok(x, y, x, D, ldx, ldy)) {
        for (int i = threadIdx.x; i < (D >> 2); i += blockDim.x)
            store4(yr + 4 * i, reinterpret_cast<const float4*>(xr)[i]);
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) store1(yr + i, xr[i]);
    }
}
