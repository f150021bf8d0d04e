// moe.cu: the routed part of the sparse MoE block at decode (M = B*T rows of fp32 activations).
//
//   moe_route        logits fp32 [M, ld] (cols 0..E-1 router, col E shared-expert gate) ->
//                    ids int32 [M, k], weights fp32 [M, k] (softmax top-k, renormalised), shared_scale fp32 [M]
//   moe_gate_up_<f>  x fp32 [M, H], ids [M, k], gate/up bank [E, 2I, H] (rows interleaved in tiles of 16:
//                    rows 32t..32t+15 gate 16t.., rows 32t+16..32t+31 up 16t..) ->
//                    act fp32 [M, k, I], act[m, j, i] = silu(g_i · x_m) · (u_i · x_m) of expert ids[m, j]
//   moe_down_<f>     act [M, k, I], ids, weights, down bank [E, H, I] -> y fp32 [M, H] +=
//                    Σ_j weights[m, j] · (W_{ids[m, j]} act[m, j]), the k experts summed in order j = 0..k-1
// <f> is any q{4,5,6,8}g{32,64,128} (quant.cuh) or bf16; expert e's rows are bank rows e·N .. e·N + N - 1.
// Matches ninfer_rt.reference.ops.moe without the shared expert (the engine adds it with the plain GEMV).
// An expert id outside [0, E) makes its outputs NaN instead of reading out of bounds.
#include "common.cuh"
#include "quant.cuh"

#define MOE_THREADS 256   // gate_up and down blocks
#define MOE_RB 4          // weight rows a lane group works on at once (independent loads in flight)
#define MOE_DOWN_ROWS 8   // output rows of y per down block: H/8 blocks per token
#define MOE_MAX_K 16
#define MOE_MAX_E 512
#define ROUTE_WARPS 4     // one warp per row

#define XPAD 33           // activations in smem as 32-element chunks padded to 33 floats: lanes reading
                          // different chunks hit different banks

// ------------------------------------------------------------------------------------------------ routing

// exp(x) to ~2 ulp under --use_fast_math: x·log2(e) is formed with its rounding error (split constant + fma),
// so the error does not grow with |x| as __expf's does.
__device__ __forceinline__ float exp_accurate(float x) {
    const float L2E_HI = 1.44269502162933349609375f;  // fp32 nearest to log2(e)
    const float L2E_LO = 1.925962991126617e-08f;      // log2(e) - L2E_HI
    const float y = x * L2E_HI;
    float r = fmaf(x, L2E_HI, -y);
    r = fmaf(x, L2E_LO, r);
    const float t = exp2f(y);
    return fmaf(t, r * 0.693147180559945f, t);        // 2^(y + r) ≈ 2^y · (1 + r·ln 2), |r| < 2^-17
}

// Softmax is monotone, so the top-k of p is the top-k of the logits (selected exactly, no rounding ties), and
// the renormalised weights p_j / Σ p are the softmax over the k chosen logits (the denominator cancels).
// Order: larger logit first, equal logits by lower index.
extern "C" __global__ void __launch_bounds__(32 * ROUTE_WARPS)
moe_route(const float* __restrict__ logits, int ld, int M, int E, int top_k, int* __restrict__ ids,
          float* __restrict__ weights, float* __restrict__ shared_scale) {
    __shared__ float s_l[ROUTE_WARPS][MOE_MAX_E];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m = blockIdx.x * ROUTE_WARPS + warp;
    if (m >= M) return;  // whole warp; no block-wide sync below
    const float* l = logits + (long long)m * ld;
    float* s = s_l[warp];
    for (int i = lane; i < E; i += 32) s[i] = l[i];
    __syncwarp();

    float pv = INFINITY;  // previous pick (value, index): round j takes the best element after it in the order
    int pi = -1;
    float top = 0.f, w = 0.f;
    int id = 0;
    for (int j = 0; j < top_k; ++j) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = lane; i < E; i += 32) {
            const float v = s[i];
            const bool after = v < pv || (v == pv && i > pi);
            if (after && (v > bv || (v == bv && i < bi))) { bv = v; bi = i; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {  // (value desc, index asc) is a total order: all lanes agree
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (j == 0) top = bv;
        if (lane == j) { id = bi; w = exp_accurate(bv - top); }
        pv = bv;
        pi = bi;
    }
    const float total = warp_sum(lane < top_k ? w : 0.f);
    if (lane < top_k) {
        ids[(long long)m * top_k + lane] = id;
        weights[(long long)m * top_k + lane] = __fdiv_rn(w, total);
    }
    if (lane == 0) {  // sigmoid without overflow in exp: the exponent is always <= 0
        const float g = l[E];
        const float e = exp_accurate(-fabsf(g));
        shared_scale[m] = g >= 0.f ? __fdiv_rn(1.f, 1.f + e) : __fdiv_rn(e, 1.f + e);
    }
}

// ------------------------------------------------------------------------------------------------ dot products

// Scaled dot of elements [32c, 32c + 32) of one weight row with 32 activations. BITS 16 = raw bf16 ([R, K]
// row-major, kp = K); else q{BITS}g{GROUP} rows of kp = round_up(K, 128).
template <int BITS, int GROUP>
__device__ __forceinline__ float chunk_dot(const uint8_t* qs, const uint8_t* qh, const __half* sc, long long row,
                                           int kp, int c, const float (&xv)[32]) {
    float w[32];
    float scale = 1.f;
    if constexpr (BITS == 16) {
        bf16_chunk32(reinterpret_cast<const uint16_t*>(qs) + row * kp, c, w);
    } else {
        const QRow r = q_row<BITS>(qs, qh, sc, row, kp, GROUP);
        q_chunk32<BITS>(r, c, w);
        scale = q_scale<GROUP>(r, c);
    }
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < 32; ++e) acc = fmaf(w[e], xv[e], acc);
    return acc * scale;
}

// Ask L2 for every byte chunk_dot(row, c) will read. A prefetch takes no register, so all of a unit's DRAM
// requests are in flight at once, whatever order ptxas later gives the loads (it staggers them).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

template <int BITS, int GROUP>
__device__ __forceinline__ void chunk_prefetch(const uint8_t* qs, const uint8_t* qh, const __half* sc, long long row,
                                               int kp, int c) {
    if constexpr (BITS == 16) {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(qs) + row * kp + 32LL * c;  // 64 bytes: 2 sectors
        prefetch_l2(p);
        prefetch_l2(p + 16);
    } else {
        const QRow r = q_row<BITS>(qs, qh, sc, row, kp, GROUP);
        prefetch_l2(r.qs + (BITS == 8 ? 32LL : 16LL) * c);
        if constexpr (BITS == 5) prefetch_l2(r.qh + 4LL * c);
        if constexpr (BITS == 6) prefetch_l2(r.qh + 8LL * c);
        prefetch_l2(r.sc + (32 * c) / GROUP);
    }
}

// dst[v·NROWS + r] = W[s_e[v]·rows_per_expert + r0 + r] · xs_v for v < nvec, r < NROWS, over nc chunks of 32.
// xs_v = xs + v·xstride, chunk c at xs_v[XPAD·c ..]. The block is split into groups of L lanes (L = nc rounded
// up to a power of two, at most 32); a group takes MOE_RB rows of one vector, its lanes stride the chunks, and
// a shuffle tree sums them. Units with s_e[v] < 0 are skipped (dst not written). Needs blockDim % 32 == 0.
// UNROLL: chunk iterations per lane whose loads are issued together (gate_up: 2 at H = 2048; down: 1 chunk
// per lane at I = 512, and 2 would spill on some targets).
template <int BITS, int GROUP, int NROWS, int UNROLL>
__device__ __forceinline__ void block_dots(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp,
                                           const int* s_e, int nvec, long long rows_per_expert, long long r0,
                                           const float* xs, int xstride, int nc, float* dst) {
    constexpr int NQ = NROWS / MOE_RB;  // row quads per vector
    static_assert(NROWS % MOE_RB == 0, "NROWS must be a multiple of MOE_RB");
    int L = 1;
    while (L < nc && L < 32) L <<= 1;
    const int sl = threadIdx.x & (L - 1);
    const int g = threadIdx.x / L, G = blockDim.x / L;
    const int U = nvec * NQ;
    // the trip count is the same for every lane: the shuffles below need whole warps
    for (int u0 = 0; u0 < U; u0 += G) {
        const int u = u0 + g;
        const int v = u / NQ, q = u - v * NQ;
        const int e = u < U ? s_e[v] : -1;
        float acc[MOE_RB];
#pragma unroll
        for (int r = 0; r < MOE_RB; ++r) acc[r] = 0.f;
        if (e >= 0) {
            const long long row = (long long)e * rows_per_expert + r0 + q * MOE_RB;
            const float* xv = xs + (long long)v * xstride;
            for (int c = sl; c < nc; c += L) {
#pragma unroll
                for (int r = 0; r < MOE_RB; ++r) chunk_prefetch<BITS, GROUP>(qs, qh, sc, row + r, kp, c);
            }
#pragma unroll UNROLL
            for (int c = sl; c < nc; c += L) {
                float xr[32];
#pragma unroll
                for (int i = 0; i < 32; ++i) xr[i] = xv[XPAD * c + i];
#pragma unroll
                for (int r = 0; r < MOE_RB; ++r) acc[r] += chunk_dot<BITS, GROUP>(qs, qh, sc, row + r, kp, c, xr);
            }
        }
#pragma unroll
        for (int r = 0; r < MOE_RB; ++r) {
            for (int o = L >> 1; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        }
        if (sl == 0 && e >= 0) {
#pragma unroll
            for (int r = 0; r < MOE_RB; ++r) dst[v * NROWS + q * MOE_RB + r] = acc[r];
        }
    }
}

// ------------------------------------------------------------------------------------------------ gate/up

// Block (pair = m·k + j, tile): the 32 bank rows 32·tile.. of expert ids[pair] -> act[pair, 16·tile .. +16].
// Dynamic smem: x_m as H/32 padded chunks (H/32·33 floats).
template <int BITS, int GROUP>
__device__ __forceinline__ void gate_up_impl(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,
                                             int H, int I, const float* __restrict__ x, const int* __restrict__ ids,
                                             int top_k, float* __restrict__ act) {
    extern __shared__ float s_x[];
    __shared__ float s_out[32];
    __shared__ int s_e[1];
    const int pair = blockIdx.x, tile = blockIdx.y;
    const int m = pair / top_k;
    const int e = ids[pair];
    float* out = act + (long long)pair * I + tile * 16;
    if (e < 0 || e >= E) {  // uniform over the block
        if (threadIdx.x < 16) out[threadIdx.x] = __int_as_float(0x7fc00000);
        return;
    }
    const float* xm = x + (long long)m * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) s_x[XPAD * (i >> 5) + (i & 31)] = xm[i];
    if (threadIdx.x == 0) s_e[0] = e;
    __syncthreads();
    block_dots<BITS, GROUP, 32, 2>(qs, qh, sc, kp, s_e, 1, 2LL * I, 32LL * tile, s_x, 0, H / 32, s_out);
    __syncthreads();
    if (threadIdx.x < 16) out[threadIdx.x] = siluf_(s_out[threadIdx.x]) * s_out[16 + threadIdx.x];
}

// ------------------------------------------------------------------------------------------------ down

// Block (m, row tile): y[m, n0 .. n0 + 8) += Σ_j w_j · W_{e_j}[n] · act[m, j]. Every (expert, row) dot goes to
// smem; one thread per row then sums the experts in order j = 0..k-1 (deterministic, no atomics).
// Dynamic smem: act[m] as k vectors of I/32 padded chunks (k·I/32·33 floats).
template <int BITS, int GROUP>
__device__ __forceinline__ void down_impl(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,
                                          int H, int I, const float* __restrict__ act, const int* __restrict__ ids,
                                          const float* __restrict__ weights, int top_k, float* __restrict__ y) {
    extern __shared__ float s_act[];
    __shared__ int s_e[MOE_MAX_K];
    __shared__ float s_w[MOE_MAX_K];
    __shared__ float s_part[MOE_MAX_K * MOE_DOWN_ROWS];
    const int m = blockIdx.x;
    const int n0 = blockIdx.y * MOE_DOWN_ROWS;
    const int nc = I / 32, xstride = nc * XPAD;
    if (threadIdx.x < top_k) {
        const int e = ids[(long long)m * top_k + threadIdx.x];
        s_e[threadIdx.x] = (e >= 0 && e < E) ? e : -1;
        s_w[threadIdx.x] = weights[(long long)m * top_k + threadIdx.x];
    }
    const float* am = act + (long long)m * top_k * I;
    for (int i = threadIdx.x; i < top_k * I; i += blockDim.x) {
        const int j = i / I, k = i - j * I;
        s_act[j * xstride + XPAD * (k >> 5) + (k & 31)] = am[i];
    }
    __syncthreads();
    block_dots<BITS, GROUP, MOE_DOWN_ROWS, 1>(qs, qh, sc, kp, s_e, top_k, H, n0, s_act, xstride, nc, s_part);
    __syncthreads();
    if (threadIdx.x < MOE_DOWN_ROWS) {
        float total = 0.f;
        for (int j = 0; j < top_k; ++j)
            total = s_e[j] < 0 ? __int_as_float(0x7fc00000) : fmaf(s_w[j], s_part[j * MOE_DOWN_ROWS + threadIdx.x], total);
        y[(long long)m * H + n0 + threadIdx.x] += total;
    }
}

// ------------------------------------------------------------------------------------------------ entry points

#define MOE_ENTRY(name, BITS, GROUP)                                                                          \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 1) moe_gate_up_##name(                          \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H, int I, const float* x, \
        const int* ids, int top_k, float* act) {                                                              \
        gate_up_impl<BITS, GROUP>(qs, qh, sc, kp, E, H, I, x, ids, top_k, act);                               \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 1) moe_down_##name(                             \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H, int I, const float* act, \
        const int* ids, const float* weights, int top_k, float* y) {                                          \
        down_impl<BITS, GROUP>(qs, qh, sc, kp, E, H, I, act, ids, weights, top_k, y);                         \
    }

NINFER_QFORMATS(MOE_ENTRY)
MOE_ENTRY(bf16, 16, 32)
