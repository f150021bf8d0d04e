// moe.cu: the routed part of the sparse MoE block at decode (M = B*T rows of fp32 activations).
//
//   moe_route        logits fp32 [M, ld] (cols 0..E-1 router, col E shared-expert gate) ->
//                    ids int32 [M, k], weights fp32 [M, k] (softmax top-k, renormalised), shared_scale fp32 [M]
//   moe_gate_up_<f>  x fp32 [M, H], ids [M, k], gate/up bank [E, 2I, H] (rows interleaved in tiles of 16:
//                    rows 32t..32t+15 gate 16t.., rows 32t+16..32t+31 up 16t..) ->
//                    act fp32 [M, k, I], act[m, j, i] = silu(g_i · x_m) · (u_i · x_m) of expert ids[m, j]
//   moe_gate_up_routed_<f>  x fp32 [M, H] (the residual stream), norm_w fp32 [H], eps, logits [M, ld] ->
//                    act as moe_gate_up on h = rms_norm_zc(x, norm_w, eps) (as norm.cu, same roundings) and the
//                    experts moe_route picks (same code: moe_route.cuh), plus moe_route's ids, weights and
//                    shared_scale (written by block (m·k, 0) for row m). One launch instead of rms_norm, route
//                    and gate_up; every block routes and normalises its own row.
//   moe_gate_up_routed_acc_*  the same, routed on a router fold's rows acc int64 [M, ld] (raw logits G·x_m in 2^-32
//                    fixed point, router_fold.py) before the kernel's wait instead of on logits (v87)
//   moe_down_<f>     act [M, k, I], ids, weights, down bank [E, H, I] -> y fp32 [M, H] +=
//                    Σ_j weights[m, j] · (W_{ids[m, j]} act[m, j]), the k experts summed in order j = 0..k-1;
//                    then, when extra is given, y[m, n] += extra_scale[m] · extra[m, n] (one fma: the shared
//                    expert's output times its gate, computed beside the routed experts); the fast paths also
//                    zero rows 0..M-1 of acc [., acc_ld] when given (the fold the gate/up routed on)
// <f> is any q{4,5,6,8}g{32,64,128} (quant.cuh) or bf16; expert e's rows are bank rows e·N .. e·N + N - 1.
// Fast paths moe_gate_up[_routed]_t{1,2}_<q>, moe_down_t{1,2}_<q> for decode shapes (see "fast paths"): x̂ and
// act as int16 codes per 32 elements (xcodes.cuh, reference ops.act_codes16) in exact dp2a dot products.
// Matches ninfer_rt.reference.ops.moe without the shared expert (the engine computes it with the plain GEMVs and
// moe_down adds it).
// An expert id outside [0, E) makes its outputs NaN instead of reading out of bounds.
#include "common.cuh"
#include "moe_route.cuh"  // route_row, route_store, MOE_MAX_K, MOE_MAX_E
#include "moe_decode.cuh"  // block shape, the block RMSNorm, raw chunks and their dots (fast paths); xcodes.cuh

#define MOE_RB 4          // weight rows a lane group works on at once (independent loads in flight)
#define ROUTE_WARPS 4     // moe_route: one warp per row

#define XPAD 33           // activations in smem as 32-element chunks padded to 33 floats: lanes reading
                          // different chunks hit different banks

// ------------------------------------------------------------------------------------------------ routing

extern "C" __global__ void __launch_bounds__(32 * ROUTE_WARPS)
moe_route(const float* __restrict__ logits, int ld, int M, int E, int top_k, int* __restrict__ ids,
          float* __restrict__ weights, float* __restrict__ shared_scale) { ninfer_pdl_begin();
    const int m = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (m >= M) return;  // whole warp; no block-wide sync below
    route_store(route_row(logits + (long long)m * ld, E, top_k), m, top_k, ids, weights, shared_scale);
}

// The routed gate_up entry points' extra inputs: x is the un-normalised residual stream, and each block
// routes its row itself. Block (m·k, 0) stores row m's routing for moe_down and the shared expert.
struct MoeRouted {
    const float* norm_w;  // [H], gain 1 + w
    float eps;
    const float* logits;  // [M, ld]
    int ld;
    int* ids;
    float* weights;
    float* shared_scale;
    const long long* acc;  // v87, the _acc entries: [M, ld] raw logits of the router fold, read instead of logits
};

// Warp 0 of block (pair = m·k + j, tile): route row m and put expert j's id in *s_e (read after a barrier).
__device__ __forceinline__ void route_block(const MoeRouted& rt, int E, int top_k, int m, int j, int tile,
                                            int* s_e) {
    const RouteRow r = route_row(rt.logits + (long long)m * rt.ld, E, top_k);
    if ((threadIdx.x & 31) == j) *s_e = r.id;
    if (j == 0 && tile == 0) route_store(r, m, top_k, rt.ids, rt.weights, rt.shared_scale);
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
// Dynamic smem: x_m as H/32 padded chunks (H/32·33 floats). ROUTED: the expert comes from route_block (warp 0)
// while every thread stages its raw x elements; after the barrier each rescales its own elements to h.
template <int BITS, int GROUP, bool ROUTED>
__device__ __forceinline__ void gate_up_impl(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,
                                             int H, int I, const float* __restrict__ x, const int* __restrict__ ids,
                                             int top_k, float* __restrict__ act, const MoeRouted& rt) {
    extern __shared__ float s_x[];
    __shared__ float s_out[32];
    __shared__ float s_red[MOE_WARPS];
    __shared__ int s_e[1];
    const int pair = blockIdx.x, tile = blockIdx.y;
    const int m = pair / top_k;
    const float* xm = x + (long long)m * H;
    float* out = act + (long long)pair * I + tile * 16;
    int e;
    if constexpr (ROUTED) {
        if (threadIdx.x < 32) route_block(rt, E, top_k, m, pair - m * top_k, tile, s_e);
        float ss = 0.f;
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            const float v = xm[i];
            s_x[XPAD * (i >> 5) + (i & 31)] = v;
            ss += v * v;
        }
        ss_partial(ss, s_red);
        __syncthreads();
        e = s_e[0];
    } else {
        e = ids[pair];
    }
    if (e < 0 || e >= E) {  // uniform over the block
        if (threadIdx.x < 16) out[threadIdx.x] = __int_as_float(0x7fc00000);
        return;
    }
    if constexpr (ROUTED) {
        const float r = rms_scale(s_red, H, rt.eps);
        for (int i = threadIdx.x; i < H; i += blockDim.x) {
            float& v = s_x[XPAD * (i >> 5) + (i & 31)];
            v = norm_mul(v, r, __ldg(rt.norm_w + i));
        }
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) s_x[XPAD * (i >> 5) + (i & 31)] = xm[i];
        if (threadIdx.x == 0) s_e[0] = e;
    }
    __syncthreads();
    block_dots<BITS, GROUP, 32, 2>(qs, qh, sc, kp, s_e, 1, 2LL * I, 32LL * tile, s_x, 0, H / 32, s_out);
    __syncthreads();
    if (threadIdx.x < 16) out[threadIdx.x] = siluf_(s_out[threadIdx.x]) * s_out[16 + threadIdx.x];
}

// ------------------------------------------------------------------------------------------------ down

// y + routed sum, then + extra_scale[m] · extra[i] when there is an extra term (the shared expert)
__device__ __forceinline__ float add_extra(float v, const float* __restrict__ extra,
                                           const float* __restrict__ extra_scale, int m, long long i) {
    return extra ? fmaf(extra_scale[m], extra[i], v) : v;
}

// Block (m, row tile): y[m, n0 .. n0 + 8) += Σ_j w_j · W_{e_j}[n] · act[m, j]. Every (expert, row) dot goes to
// smem; one thread per row then sums the experts in order j = 0..k-1 (deterministic, no atomics).
// Dynamic smem: act[m] as k vectors of I/32 padded chunks (k·I/32·33 floats).
template <int BITS, int GROUP>
__device__ __forceinline__ void down_impl(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,
                                          int H, int I, const float* __restrict__ act, const int* __restrict__ ids,
                                          const float* __restrict__ weights, int top_k, float* __restrict__ y,
                                          const float* __restrict__ extra, const float* __restrict__ extra_scale) {
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
        const float total = expert_sum(s_e, s_w, s_part + threadIdx.x, MOE_DOWN_ROWS, top_k);
        const long long i = (long long)m * H + n0 + threadIdx.x;
        y[i] = add_extra(y[i] + total, extra, extra_scale, m, i);
    }
}

// ------------------------------------------------------------------------------------------------ fast paths
// Decode shapes of q{4,5,6,8} banks (moe.py picks them: gate_up H = 1024·T, down I = 512·T, T = 1, 2, x / act
// 16-byte aligned). Same blocks and grids as gate_up_impl / down_impl (sums in a fixed order), but every thread
// issues all of its weight loads into registers at once, right after its expert id arrives, and the
// activations are staged while they are in flight: one DRAM round trip for the ids, one for the weights. The
// activations meet the weights as int16 codes (xcodes.cuh: within 2^-14 of each chunk's largest value), one
// dp2a per two weights instead of a conversion and an fma per weight.

// Block (pair, tile) as gate_up_impl, 256 threads: warp w takes bank rows 32·tile + 4w .. +4, lane the chunks
// lane + 32t (t < T), all 4·T chunk loads in flight together. x_m (h for ROUTED) is staged as int16 chunk
// records (xcodes.cuh; 8 consecutive threads hold one chunk) and meets the weight codes in dp2a. Dynamic smem:
// H/32 records of qchunk_bytes(1). ROUTED: warp 0 routes while the x loads are in flight; every thread adds
// its Σ x² before the barrier that publishes the id, issues its weight loads right after it, then normalises
// its own x (the gain norm_w loaded before the kernel's wait: ninfer_pdl_begin is called here) and stores the
// codes.
// ACC (v87, E <= 256): row m's raw logits G·x_m are rt.acc's row m (the router fold, moe_fused.cu's ACC for one
// token), added by the DeltaNet step or the attention combine two launches back, so complete before this launch
// began. Their top-k does not depend on rsqrt(mean x_m² + eps) > 0: the block routes and issues its tile before
// the wait; block (m·k, 0) forms the weights and the shared gate on the scaled logits after it.
template <bool ACC>
struct AccRouteSmem {
    RouteBlockSmem<MOE_THREADS> r;
};
template <>
struct AccRouteSmem<false> {};

template <int BITS, int GROUP, int T, bool ROUTED, bool ACC = false>
__device__ __forceinline__ void gate_up_fast(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,
                                             int H, int I, const float* __restrict__ x, const int* __restrict__ ids,
                                             int top_k, float* __restrict__ act, const MoeRouted& rt) {
    extern __shared__ float4 s_x4[];
    uint8_t* s_q = reinterpret_cast<uint8_t*>(s_x4);
    constexpr int CB = qchunk_bytes(1), XQ = BITS == 8 ? 1 : 2;
    __shared__ float s_out[32];
    __shared__ float s_red[MOE_WARPS];
    __shared__ int s_e[1];
    const int pair = blockIdx.x, tile = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5;
    const int m = pair / top_k;
    const float4* xm = reinterpret_cast<const float4*>(x + (long long)m * H);  // H / 4 = 256·T float4
    float4 g[T];  // ROUTED: the norm's gain, a weight: loaded before the wait (after it, it came in behind the tile)
    if constexpr (ROUTED) {
#pragma unroll
        for (int t = 0; t < T; ++t) g[t] = __ldg(reinterpret_cast<const float4*>(rt.norm_w) + tid + MOE_THREADS * t);
    }
    static_assert(!ACC || ROUTED, "ACC routes");
    __shared__ AccRouteSmem<ACC> s_acc;
    QChunk<BITS> q[T][4];
    int e = -1;
    float g_raw = 0.f;  // ACC: warp 0's raw shared-expert gate logit
    if constexpr (ACC) {
        const long long* am = rt.acc + (long long)m * rt.ld;
        const float v = tid < E ? __ll2float_rn(__ldcg(am + tid)) * 0x1p-32f : 0.f;
        if (warp == 0) g_raw = __ll2float_rn(__ldcg(am + E)) * 0x1p-32f;
        route_keys_block<MOE_THREADS>(v, E, top_k, s_acc.r);  // ends in a block barrier: sel_id is readable
        e = (int)s_acc.r.sel_id[pair - m * top_k];
        // the gain in registers before the tile is issued (one scoreboard for both, as in moe_fused.cu: its first
        // use after the wait would wait for the whole tile); an all-ones word is a NaN, so h is NaN either way
        const bool gain_in = __float_as_uint(g[0].x) != 0xffffffffu && __float_as_uint(g[T - 1].x) != 0xffffffffu;
        if (e >= 0 && e < E && gain_in) tile_load<BITS, GROUP, T>(q, qs, qh, sc, kp, e, I, tile);
    }
    ninfer_pdl_begin();
    float4 xr[T];
#pragma unroll
    for (int t = 0; t < T; ++t) xr[t] = __ldg(xm + tid + MOE_THREADS * t);
    if constexpr (ROUTED) {
        if (!ACC && warp == 0) route_block(rt, E, top_k, m, pair - m * top_k, tile, s_e);
        float ss = 0.f;
#pragma unroll
        for (int t = 0; t < T; ++t) ss += xr[t].x * xr[t].x + xr[t].y * xr[t].y + xr[t].z * xr[t].z + xr[t].w * xr[t].w;
        ss_partial(ss, s_red);
        __syncthreads();
        if constexpr (!ACC) e = s_e[0];
    } else {
        e = __ldg(ids + pair);
    }
    float* out = act + (long long)pair * I + tile * 16;
    if (e < 0 || e >= E) {  // uniform over the block, before any further sync
        if (tid < 16) out[tid] = __int_as_float(0x7fc00000);
        return;
    }
    if constexpr (!ACC) tile_load<BITS, GROUP, T>(q, qs, qh, sc, kp, e, I, tile);
    if constexpr (ROUTED) {
        const float r = rms_scale(s_red, H, rt.eps);
        if constexpr (ACC) {  // row m's weights and shared gate on the logits r·(G·x_m), as route on them
            if (warp == 0 && pair - m * top_k == 0 && tile == 0)
                route_store(route_weights_block<MOE_THREADS>(s_acc.r, top_k, r, g_raw), m, top_k, rt.ids, rt.weights,
                             rt.shared_scale);
        }
#pragma unroll
        for (int t = 0; t < T; ++t) xr[t] = norm_mul4(xr[t], r, g[t]);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
        const int i4 = tid + MOE_THREADS * t;  // float4 i4 of x_m: chunk i4 / 8, elements 4 (i4 % 8) ..
        store_codes4<1, XQ>(s_q + (i4 >> 3) * CB, 0, 4 * (i4 & 7), xr[t], true);
    }
    __syncthreads();
    tile_dots<BITS, T>(q, s_q, s_out);
    __syncthreads();
    if (tid < 16) out[tid] = siluf_(s_out[tid]) * s_out[16 + tid];
}

// Block (m, row tile) as down_impl, 256 threads: warp w takes experts j = w, w + 8, ..; in a warp, half h = lane/16
// takes rows n0 + 4h .. +4 and lane the chunks lane % 16 + 16t (t < T). The warp's first id and its 4·T weight
// chunks are issued first; then the block stages act[m] (top_k·I floats) as int16 chunk records (xcodes.cuh)
// while they are in flight. Dynamic smem: top_k·I/32 records of qchunk_bytes(1); the y element is read at the
// start.
template <int BITS, int GROUP, int T>
__device__ __forceinline__ void down_fast(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,
                                          int H, int I, const float* __restrict__ act, const int* __restrict__ ids,
                                          const float* __restrict__ weights, int top_k, float* __restrict__ y,
                                          const float* __restrict__ extra, const float* __restrict__ extra_scale,
                                          long long* __restrict__ acc, int acc_ld) {
    extern __shared__ float4 s_x4[];
    uint8_t* s_q = reinterpret_cast<uint8_t*>(s_x4);
    constexpr int CB = qchunk_bytes(1), XQ = BITS == 8 ? 1 : 2;
    __shared__ int s_e[MOE_MAX_K];
    __shared__ float s_w[MOE_MAX_K];
    __shared__ float s_part[MOE_MAX_K * MOE_DOWN_ROWS];
    const int m = blockIdx.x;
    const int n0 = blockIdx.y * MOE_DOWN_ROWS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int half = lane >> 4, cl = lane & 15;
    const long long yi = (long long)m * H + n0 + tid;
    const float y0 = tid < MOE_DOWN_ROWS ? y[yi] : 0.f;
    // v87: row m of the router fold's acc, which every gate/up block has read (this launch is past its wait), zeroed
    // for the next step's fold (moe_fused.cu's block 0 does the same for one token)
    if (acc != nullptr && blockIdx.y == 0)
        for (int i = tid; i < acc_ld; i += MOE_THREADS) acc[(long long)m * acc_ld + i] = 0;
    if (tid < top_k) {
        const int e = __ldg(ids + (long long)m * top_k + tid);
        s_e[tid] = (e >= 0 && e < E) ? e : -1;
        s_w[tid] = __ldg(weights + (long long)m * top_k + tid);
    }
    QChunk<BITS> q[T][4];
    int e = -1;
    auto issue = [&](int j) {  // expert j's id, then its weight chunks
        e = __ldg(ids + (long long)m * top_k + j);
        if (e < 0 || e >= E) return;
        const long long row0 = (long long)e * H + n0 + 4 * half;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int t = 0; t < T; ++t) qchunk_load<BITS, GROUP>(q[t][r], qs, qh, sc, row0 + r, kp, cl + 16 * t);
        }
    };
    if (warp < top_k) issue(warp);
    // top_k·128·T float4s: a multiple of 32. The recipes' top-k at compile-time counts, so act is requested with
    // the weights (stage_codes_fixed): -29% at M = 8, +5% at M = 1, where moe_fused runs instead (perf-history.md v58)
    const float* act_m = act + (long long)m * top_k * I;
    if (top_k == MOE_STAGE_K && I == 512 * T) stage_codes_fixed<XQ, XQ, false, MOE_STAGE_K * 128 * T, 0>(s_q, act_m);
    else stage_codes<XQ, false>(s_q, reinterpret_cast<const float4*>(act_m), top_k * I / 4);
    __syncthreads();
    const int nc = I / 32;
    for (int j = warp; j < top_k; j += MOE_WARPS) {  // uniform over the warp
        if (j != warp) issue(j);
        if (e < 0 || e >= E) continue;  // the sum below turns NaN
        float acc[4][1] = {{0.f}, {0.f}, {0.f}, {0.f}};
#pragma unroll
        for (int t = 0; t < T; ++t) chunk_dots<BITS>(q[t], s_q + (j * nc + cl + 16 * t) * CB, acc);
        half_rows_store(acc, s_part + j * MOE_DOWN_ROWS);
    }
    __syncthreads();
    if (tid < MOE_DOWN_ROWS) {
        const float total = expert_sum(s_e, s_w, s_part + tid, MOE_DOWN_ROWS, top_k);
        y[yi] = add_extra(y0 + total, extra, extra_scale, m, yi);
    }
}

// ------------------------------------------------------------------------------------------------ entry points

#define MOE_ROUTED_PARAMS                                                                                     \
    const float *norm_w, float eps, const float *logits, int ld, int top_k, int *ids, float *weights,        \
        float *shared_scale, float *act
#define MOE_ROUTED_ARGS MoeRouted{norm_w, eps, logits, ld, ids, weights, shared_scale}

#define MOE_ENTRY(name, BITS, GROUP)                                                                          \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 1) moe_gate_up_##name(                          \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H, int I, const float* x, \
        const int* ids, int top_k, float* act) { ninfer_pdl_begin();                                          \
        gate_up_impl<BITS, GROUP, false>(qs, qh, sc, kp, E, H, I, x, ids, top_k, act, MoeRouted{});           \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 1) moe_gate_up_routed_##name(                   \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H, int I, const float* x, \
        MOE_ROUTED_PARAMS) { ninfer_pdl_begin();                                                              \
        gate_up_impl<BITS, GROUP, true>(qs, qh, sc, kp, E, H, I, x, nullptr, top_k, act, MOE_ROUTED_ARGS);    \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 1) moe_down_##name(                             \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H, int I, const float* act, \
        const int* ids, const float* weights, int top_k, float* y, const float* extra,                        \
        const float* extra_scale) {                                                                           \
        ninfer_pdl_begin();                                                                                   \
        down_impl<BITS, GROUP>(qs, qh, sc, kp, E, H, I, act, ids, weights, top_k, y, extra, extra_scale);     \
    }

NINFER_QFORMATS(MOE_ENTRY)
MOE_ENTRY(bf16, 16, 32)

// Fast paths: moe_gate_up[_routed]_t{1,2}_<f> (H = 1024·T), moe_down_t{1,2}_<f> (I = 512·T), q formats only.
// Two blocks per SM (<= 128 registers) except q8 at T = 2, whose 8 chunks of 32 bytes per thread would spill there.
#define MOE_FAST_MINB(BITS, T) (((BITS) == 8 && (T) == 2) ? 1 : 2)
#define MOE_FAST_ENTRY_T(name, BITS, GROUP, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MOE_FAST_MINB(BITS, T))                          \
    moe_gate_up_t##T##_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H,    \
                              int I, const float* x, const int* ids, int top_k, float* act) {              \
        gate_up_fast<BITS, GROUP, T, false>(qs, qh, sc, kp, E, H, I, x, ids, top_k, act, MoeRouted{});         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MOE_FAST_MINB(BITS, T))                          \
    moe_gate_up_routed_t##T##_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,   \
                                     int H, int I, const float* x, MOE_ROUTED_PARAMS) {                       \
        gate_up_fast<BITS, GROUP, T, true>(qs, qh, sc, kp, E, H, I, x, nullptr, top_k, act, MOE_ROUTED_ARGS);  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MOE_FAST_MINB(BITS, T))                          \
    moe_down_t##T##_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H,       \
                           int I, const float* act, const int* ids, const float* weights, int top_k,          \
                           float* y, const float* extra, const float* extra_scale, long long* acc,            \
                           int acc_ld) {                                                                      \
        ninfer_pdl_begin();                                                                                   \
        down_fast<BITS, GROUP, T>(qs, qh, sc, kp, E, H, I, act, ids, weights, top_k, y, extra, extra_scale, acc, \
                                  acc_ld);                                                                    \
    }
#define MOE_FAST_ENTRY(name, BITS, GROUP) MOE_FAST_ENTRY_T(name, BITS, GROUP, 1) MOE_FAST_ENTRY_T(name, BITS, GROUP, 2)

NINFER_QFORMATS(MOE_FAST_ENTRY)

// moe_gate_up_routed_b3_t2_<f>: the same routed gate/up at three blocks an SM (76 registers, no spill), for several
// rows a step: B = 2's 16 x 32 blocks take 1.3 waves of 3 x 132 slots, not two of 2 x 132 (-0.8% a B = 2 step and
// -2.3% at B = 4 on an H100; four blocks an SM spill and gain less, perf.md v83). The recipes' routed gate/up formats.
#define MOE_B3_ENTRY(name, BITS, GROUP)                                                                       \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 3)                                              \
    moe_gate_up_routed_b3_t2_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E,    \
                                    int H, int I, const float* x, MOE_ROUTED_PARAMS) {                        \
        gate_up_fast<BITS, GROUP, 2, true>(qs, qh, sc, kp, E, H, I, x, nullptr, top_k, act, MOE_ROUTED_ARGS);  \
    }
MOE_B3_ENTRY(q4g64, 4, 64)
MOE_B3_ENTRY(q5g64, 5, 64)

// moe_gate_up_routed_acc_t{1,2}_<f>, moe_gate_up_routed_acc_b3_t2_<f> (v87): the same kernels routed on the router
// fold's rows acc int64 [M, ld] (ACC above; logits unused), at two and three blocks an SM. The recipes' formats.
#define MOE_ACC_ENTRY_T(name, BITS, GROUP, T, MINB, PRE)                                                      \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MINB)                                           \
    moe_gate_up_routed_acc_##PRE##t##T##_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, \
                                                int E, int H, int I, const float* x, MOE_ROUTED_PARAMS,       \
                                                const long long* acc) {                                       \
        const MoeRouted rt{norm_w, eps, logits, ld, ids, weights, shared_scale, acc};                        \
        gate_up_fast<BITS, GROUP, T, true, true>(qs, qh, sc, kp, E, H, I, x, nullptr, top_k, act, rt);        \
    }
#define MOE_ACC_ENTRY(name, BITS, GROUP)                                                                      \
    MOE_ACC_ENTRY_T(name, BITS, GROUP, 1, MOE_FAST_MINB(BITS, 1), )                                           \
    MOE_ACC_ENTRY_T(name, BITS, GROUP, 2, MOE_FAST_MINB(BITS, 2), )                                           \
    MOE_ACC_ENTRY_T(name, BITS, GROUP, 2, 3, b3_)
MOE_ACC_ENTRY(q4g64, 4, 64)
MOE_ACC_ENTRY(q5g64, 5, 64)

// moe_down_b3_t1_<f>: moe_down_t1 at three blocks an SM (<= 85 registers), for several rows a step: B = 2's 2 x 256
// blocks in 1.3 waves of 3 x 132 slots, not two of 2 x 132, as the gate/up's b3 (perf.md v84). The recipes' down
// formats.
#define MOE_DOWN_B3_ENTRY(name, BITS, GROUP)                                                                  \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 3)                                              \
    moe_down_b3_t1_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int E, int H, int I, \
                          const float* act, const int* ids, const float* weights, int top_k, float* y,        \
                          const float* extra, const float* extra_scale, long long* acc, int acc_ld) {         \
        ninfer_pdl_begin();                                                                                   \
        down_fast<BITS, GROUP, 1>(qs, qh, sc, kp, E, H, I, act, ids, weights, top_k, y, extra, extra_scale, acc, \
                                  acc_ld);                                                                    \
    }
MOE_DOWN_B3_ENTRY(q5g64, 5, 64)
MOE_DOWN_B3_ENTRY(q6g64, 6, 64)
