// norm.cu: zero-centred RMSNorm over rows, fp32 (matches ninfer_rt/reference/ops.py rms_norm_zc).
//
//   y[m, :] = (x[m, :] · rsqrt(mean(x[m, :]²) + eps)) · (1 + w)
//
// Layouts: x [M, D] fp32 with row stride ldx; y [M, D] fp32 with row stride ldy; w [D] fp32, stored centred
// at 0 (the gain is 1 + w). One block per row. y may be x (in place, ldx == ldy): each thread reads its
// elements before the block reduction and writes those same elements after it.
// 16-byte loads and stores when x, y, w and both strides allow them, else scalar ones.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(1024) rms_norm(const float* x, float* y, const float* w, int D,
                                                            long long ldx, long long ldy, float eps)
{ ninfer_pdl_begin();
    __shared__ float red[32];
    const long long m = blockIdx.x;
    const float* xr = x + m * ldx;
    float* yr = y + m * ldy;
    const bool vec = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y) |
                       reinterpret_cast<uintptr_t>(w)) & 15) == 0 &&
                     ((static_cast<long long>(D) | ldx | ldy) & 3) == 0;

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
        float4* y4 = reinterpret_cast<float4*>(yr);
        for (int i = threadIdx.x; i < (D >> 2); i += blockDim.x) {
            const float4 v = x4[i], g = w4[i];
            float4 o;
            o.x = __fmul_rn(__fmul_rn(v.x, r), 1.f + g.x);
            o.y = __fmul_rn(__fmul_rn(v.y, r), 1.f + g.y);
            o.z = __fmul_rn(__fmul_rn(v.z, r), 1.f + g.z);
            o.w = __fmul_rn(__fmul_rn(v.w, r), 1.f + g.w);
            y4[i] = o;
        }
    } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) yr[i] = __fmul_rn(__fmul_rn(xr[i], r), 1.f + w[i]);
    }
}
