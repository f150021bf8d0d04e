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

// delta_step for "row lanes": lane = column j, the P warps of the block split its DK rows (rows i = P·r + p, p the
// warp), so that a warp's access to a row of S is one 128-byte line. The column sums cross the warps through d2
// (shared, two [P][3][32] buffers, token t's by its parity), one block barrier a token:
// u = Sᵀk̂ and w = Sᵀq̂ of the old S and q̂·k̂ are summed together, then o_j = e^g w_j + (q̂·k̂) Δ_j
// (= Σ_i S'_ij q̂_i). ba: β, e^g; v: v_j (shared, read after the barrier). Every thread of the block must call it.
template <int DK, int P>
__device__ __forceinline__ float delta_step_rows(float (&s)[DK / P], const float* kt, const float* qt,
                                                 const float* ba, const float* v, int p, int lane,
                                                 float (*d2)[P][3][32], int t) {
    constexpr int R = DK / P;
    static_assert(R % 2 == 0, "rows per thread: a multiple of 2");
    float u = 0.f, w = 0.f, qk = 0.f, u2 = 0.f, w2 = 0.f, qk2 = 0.f;
#pragma unroll
    for (int r = 0; r < R; r += 2) {
        const float k0 = kt[P * r + p], q0 = qt[P * r + p];
        const float k1 = kt[P * (r + 1) + p], q1 = qt[P * (r + 1) + p];
        u = fmaf(s[r], k0, u);
        w = fmaf(s[r], q0, w);
        qk = fmaf(q0, k0, qk);
        u2 = fmaf(s[r + 1], k1, u2);
        w2 = fmaf(s[r + 1], q1, w2);
        qk2 = fmaf(q1, k1, qk2);
    }
    float(*d)[3][32] = d2[t & 1];  // this token's buffer: the previous token's may still be read
    d[p][0][lane] = u + u2;
    d[p][1][lane] = w + w2;
    d[p][2][lane] = qk + qk2;
    __syncthreads();
    float U = 0.f, W = 0.f, QK = 0.f;
#pragma unroll
    for (int q = 0; q < P; ++q) {  // in warp order: every column's sums the same way
        U += d[q][0][lane];
        W += d[q][1][lane];
        QK += d[q][2][lane];
    }
    const float beta = ba[0], decay = ba[1];
    const float delta = beta * (*v - decay * U);
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = fmaf(s[r], decay, kt[P * r + p] * delta);
    return fmaf(decay, W, QK * delta);
}
