// deltanet.cuh: what the DeltaNet files share (deltanet.cu: conv, recurrent, gated norm; deltanet_step.cu: the
// fused decode step; deltanet_chunked.cu: the chunked delta rule for prefill): one token of the delta rule on a
// column of S held in registers. No op lives here.
#pragma once

#define DN_L2_EPS 1e-6f  // ops.L2NORM_EPS: q and k are scaled by rsqrt(Σx² + eps)
#define DN_KMAX 8        // largest conv width supported (the family uses 4)

// ------------------------------------------------------------------------------------------------ delta rule

// One token of the delta rule for one column j of S, split over the P lanes p of the column (rows i = P·r + p;
// p is the lane's high bits, lane = jj + (32/P)·p): u = (e^g S)ᵀ k̂, Δ = β (v − u), S ← e^g S + k̂ Δᵀ; returns
// o_j = Σ_i S_ij q̂_i (whole column, all P lanes). Up to four accumulators shorten the dependency chains; the
// shuffles stay within the column's lanes. k̂/q̂ reads hit P consecutive words (no bank conflict).
template <int DK, int P>
__device__ __forceinline__ float delta_step(float (&s)[DK / P], const float* kt, const float* qt, float beta,
                                            float decay, float v, int p) {
    constexpr int R = DK / P, A = R < 4 ? R : 4;
    static_assert(R % A == 0 && (A == 2 || A == 4), "rows per lane: 2 or a multiple of 4");
    float u[A], o[A];
#pragma unroll
    for (int a = 0; a < A; ++a) u[a] = o[a] = 0.f;
#pragma unroll
    for (int r = 0; r < R; r += A)
#pragma unroll
        for (int a = 0; a < A; ++a) u[a] = fmaf(s[r + a], kt[P * (r + a) + p], u[a]);
    float us = A == 4 ? (u[0] + u[1]) + (u[2 % A] + u[3 % A]) : u[0] + u[1];
#pragma unroll
    for (int m = 32 / P; m < 32; m <<= 1) us += __shfl_xor_sync(0xffffffffu, us, m);
    const float delta = beta * (v - decay * us);
#pragma unroll
    for (int r = 0; r < R; r += A)
#pragma unroll
        for (int a = 0; a < A; ++a) {
            s[r + a] = fmaf(s[r + a], decay, kt[P * (r + a) + p] * delta);
            o[a] = fmaf(s[r + a], qt[P * (r + a) + p], o[a]);
        }
    float os = A == 4 ? (o[0] + o[1]) + (o[2 % A] + o[3 % A]) : o[0] + o[1];
#pragma unroll
    for (int m = 32 / P; m < 32; m <<= 1) os += __shfl_xor_sync(0xffffffffu, os, m);
    return os;
}
