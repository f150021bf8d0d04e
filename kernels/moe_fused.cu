// moe_fused.cu: the sparse MoE block of one decode token in one launch after the router GEMV,
// moe_fused_t{T}_{gu}_{dn}_{sh}: routing, the routed experts' gate/up and down, the shared expert's gate|up and
// down and the residual add, with a grid-wide barrier in place of a kernel boundary and a side stream.
//
//   x fp32 [H] (the residual stream, updated in place), norm_w fp32 [H] (gain 1 + w), logits fp32 [E + 1] (the
//   router GEMV's: columns 0..E-1 the router, column E the shared-expert gate) ->
//   ids int32 [k], weights fp32 [k], shared_scale fp32 [1] (route_row, as moe_route), act fp32 [k, I],
//   act_s fp32 [Is], and
//   x[n] = fma(shared_scale, down_s(act_s)[n], x[n] + Σ_j weights[j] · down_{ids[j]}(act_j)[n]), j = 0..k-1 in order.
// h = rms_norm_zc(x, norm_w) as moe_gate_up_routed_t* computes it; act_j = silu(g·ĥ)·(u·ĥ) with ĥ the int16 codes
// of h (xcodes.cuh, in each weight format's order), act_s the same with the shared gate|up; the down products
// meet the codes of act and act_s. Banks: routed gate/up [E, 2I, H] and down [E, H, I] as moe.cu; the shared
// gate|up [2Is, H] (rows interleaved in tiles of 16, as one expert of a bank) and down [H, Is].
// Reference: ninfer_rt.reference.ops.moe (shared expert included). H = 1024·T (T = 1, 2), I = Is = 512.
//
// Work split, nb = max(k·I/16, Is/2, H/16) blocks of 256 threads, every one resident at once (moe.py checks the
// occupancy: a block waiting at the barrier for one that cannot start would wait forever). Every block routes
// the token (all its warps by route_row_block where E <= 256, else warp 0 by route_row; block 0 stores the
// routing) and normalises x itself (the gain loaded before the kernel's wait).
//   phase 1  block b < k·I/16: the routed gate/up tile b % (I/16) of expert j = b / (I/16), as gate_up_fast;
//            block b < Is/2: act_s[2b], act_s[2b + 1] from their 2 gate and 2 up rows, thread t < 128·T one
//            32-element chunk (row t / (32T), chunk t % (32T)), loaded before the kernel's wait;
//   barrier  every act and act_s is written; phase 2's weights are loaded before it;
//   phase 2  block b < H/16: x rows 16b..16b+15 as down_fast does 8 (warp w: experts w, w + 8, ..), plus the
//            shared down's 16 rows (thread t: row t / 16, chunk t % 16). The other blocks leave at the barrier, so
//            the next kernel's blocks become resident (and load their first weights) during phase 2.
// An expert id outside [0, E) (fewer than k candidates) makes its act NaN and the token's x NaN.
#include "common.cuh"
#include "moe_decode.cuh"  // block shape, the block RMSNorm, raw chunks and their dots; xcodes.cuh
#include "moe_route.cuh"   // route_row, route_store, MOE_MAX_K

#define MOE_FUSED_I 512   // I and Is: 16 chunks of a down row, one per lane of a half warp
#define MOE_FUSED_DR 16   // x rows per phase-2 block: half the blocks leave at the barrier (room for the next kernel)

// A grid-wide barrier on bar, a u32 in global memory that each launch finds with its top bit either way and
// leaves flipped: block 0 adds 2^31 - (nb - 1), the others 1, so the nb additions sum to 2^31 (the low bits come
// back to their value). The top bit cannot flip before this block arrives, so thread 0 reads it early
// (grid_sense, after the kernel's wait), arrives with an addition whose result it does not wait for, and polls
// until the bit differs. The fence before the addition makes the block's stores (published to thread 0 by the
// block barrier) visible to every block whose acquire load sees the flip.
__device__ __forceinline__ unsigned grid_sense(const unsigned* bar) {
    return threadIdx.x == 0 ? __ldcg(bar) & 0x80000000u : 0u;
}

__device__ __forceinline__ void grid_barrier(unsigned* bar, unsigned sense) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u);
        unsigned now;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar) : "memory");
        } while ((now & 0x80000000u) == sense);
    }
    __syncthreads();
}

// The dot of one loaded chunk of one row with the chunk record rec (q8: both 16-element halves).
template <int BITS>
__device__ __forceinline__ float chunk_dot1(const QChunk<BITS>& q, const uint8_t* rec) {
    float acc[1][1] = {{0.f}};
#pragma unroll
    for (int half = 0; half < (BITS == 8 ? 2 : 1); ++half) {
        const Unit d[1] = {chunk_unit<BITS>(q, half)};
        compute_unit_q<BITS, 1, 1>(d, rec, half, acc);
    }
    return acc[0][0];
}

// Planes of one weight tensor (or bank) as the kernel reads them.
struct QPlanes {
    const uint8_t* qs;
    const uint8_t* qh;
    const __half* sc;
    int kp;
};

// x̂ order of a format's records: q8 natural, the nibble formats even-then-odd (xcodes.cuh)
template <int BITS>
__host__ __device__ constexpr int xq_of() { return BITS == 8 ? 1 : 2; }

// ACC (v71; E <= 256): no router GEMV before this launch. acc int64 [E + 1] holds the raw logits
// G·x (G = W_router·diag(1 + w_post), x this kernel's input) as fixed-point sums (2^-32) that the DeltaNet step two
// launches back added (deltanet_step.cu's fold); top-k of G·x is top-k of the router's logits (rsqrt(mean x² + eps)
// > 0), so the routing and the tile's issue run before the wait, and the weights and the shared gate, which scale
// the logits by that rsqrt, after it. Block 0 zeroes acc after the grid barrier (every block has read it).
template <int GB, int GG, int DB, int DG, int SB, int SG, int T, bool ACC = false>
__device__ __forceinline__ void moe_fused_body(QPlanes gu, QPlanes dn, QPlanes sgu, QPlanes sdn, int E, int top_k,
                                               const float* __restrict__ norm_w, float eps,
                                               const float* __restrict__ logits, int* __restrict__ ids,
                                               float* __restrict__ weights, float* __restrict__ shared_scale,
                                               float* act, float* act_s, float* x, unsigned* bar,
                                               long long* acc = nullptr) {
    constexpr int H = 1024 * T, I = MOE_FUSED_I, NC = I / 32, CB = qchunk_bytes(1);
    constexpr int XG = xq_of<GB>(), XD = xq_of<DB>(), XS = xq_of<SB>();
    // dynamic smem, phase 1: ĥ for the routed gate/up, ĥ for the shared gate|up; phase 2 over the same bytes
    // (every phase-1 read is before the grid barrier): act (k·NC records), act_s (NC records)
    extern __shared__ float4 s_x4[];
    uint8_t* s_hg = reinterpret_cast<uint8_t*>(s_x4);
    uint8_t* s_hs = s_hg + (H / 32) * CB;
    uint8_t* s_act = s_hg;
    uint8_t* s_acs = s_act + top_k * NC * CB;
    __shared__ float s_out[32];
    __shared__ float s_red[MOE_WARPS];
    __shared__ float s_sgp[MOE_WARPS];
    __shared__ int s_e[MOE_MAX_K];
    __shared__ float s_w[MOE_MAX_K];
    __shared__ float s_sh[1];
    __shared__ RouteBlockSmem<MOE_THREADS> s_route;
    constexpr int DR = MOE_FUSED_DR, DS = DR / 8;  // phase 2: x rows per block, sets of 8 rows per warp
    __shared__ float s_part[MOE_MAX_K * DR];
    __shared__ float s_shp[DR];
    const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool has_gu = b < top_k * (I / 16), has_sh = b < I / 2, has_dn = b < H / DR;

    // The shared gate|up chunk depends on nothing an earlier kernel writes: in flight before the wait.
    // Row r of the group: output 2b + (r & 1), gate (r < 2) or its up row 16 further (the interleave).
    const int sr = tid / (32 * T), sck = tid % (32 * T);
    const bool sh_lane = has_sh && tid < 128 * T;
    QChunk<SB> qsg;
    if (sh_lane) {
        const int i = 2 * b + (sr & 1);
        qchunk_load<SB, SG>(qsg, sgu.qs, sgu.qh, sgu.sc, 32LL * (i >> 4) + (i & 15) + 16 * (sr >> 1), sgu.kp, sck);
    }
    // so is the norm's gain: loaded after the wait it came in behind the gate/up tile, and held up its dots
    float4 gain[T];
#pragma unroll
    for (int t = 0; t < T; ++t) gain[t] = __ldg(reinterpret_cast<const float4*>(norm_w) + tid + MOE_THREADS * t);
    QChunk<GB> q[T][4];
    float g_raw = 0.f;  // ACC: warp 0's raw shared-expert gate logit
    if constexpr (ACC) {  // the routing and the tile's issue before the wait (acc is two launches back)
        const float v = tid < E ? __ll2float_rn(__ldcg(acc + tid)) * 0x1p-32f : 0.f;
        if (warp == 0) g_raw = __ll2float_rn(__ldcg(acc + E)) * 0x1p-32f;
        route_keys_block<MOE_THREADS>(v, E, top_k, s_route);
        if (warp == 0 && lane < top_k) {
            const int id = (int)s_route.sel_id[lane];
            s_e[lane] = id >= 0 && id < E ? id : -1;
        }
        __syncthreads();
        // the gain in registers before the tile's loads are issued: ptxas gives both one scoreboard, so its first use
        // after the wait would wait for the whole tile, and x's staging with it (an all-ones word is a NaN: h is NaN
        // either way)
        const bool gain_in = __float_as_uint(gain[0].x) != 0xffffffffu && __float_as_uint(gain[T - 1].x) != 0xffffffffu;
        const int e0 = has_gu ? s_e[b / (I / 16)] : -1;
        if (e0 >= 0 && gain_in) tile_load<GB, GG, T>(q, gu.qs, gu.qh, gu.sc, gu.kp, e0, I, b % (I / 16));
    }
    // the next layer's GEMV (or lm_head's) reads only weights and gains before its wait: it may start launching
    // now; this grid is wholly resident before it can (perf-history.md v53)
    ninfer_pdl_begin_early();
    const unsigned sense = grid_sense(bar);

    // x (x is rewritten in phase 2 by other blocks: L2 loads, not the read-only path), the routing (every warp;
    // warp 0 alone where E > 256), Σ x²
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4 xr[T];
#pragma unroll
    for (int t = 0; t < T; ++t) xr[t] = __ldcg(x4 + tid + MOE_THREADS * t);
    if constexpr (!ACC) {
        RouteRow r;
        if (E <= MOE_THREADS) r = route_row_block<MOE_THREADS>(logits, E, top_k, s_route);
        else if (warp == 0) r = route_row(logits, E, top_k);
        if (warp == 0) {
            if (lane < top_k) {
                s_e[lane] = r.id >= 0 && r.id < E ? r.id : -1;
                s_w[lane] = r.w;
            }
            if (lane == 0) s_sh[0] = r.shared;
            if (b == 0) route_store(r, 0, top_k, ids, weights, shared_scale);
        }
        __syncthreads();
    }
    NINFER_TL_MARK(0);  // routed

    // routed gate/up: the tile's weights, issued as soon as the expert is known, then h staged while they fly.
    // Σ x² after the issue: ptxas gives x's loads the scoreboard of the loads before the wait, so x's first use
    // waits for those DRAM loads too; before the issue that wait held the tile up ~0.6 µs (perf-history.md v57).
    const int pair = b / (I / 16), tile = b % (I / 16);
    const int e = has_gu ? s_e[pair] : -1;
    if constexpr (!ACC) {
        if (e >= 0) tile_load<GB, GG, T>(q, gu.qs, gu.qh, gu.sc, gu.kp, e, I, tile);
    }
    NINFER_TL_MARK(1);  // the tile's loads issued
    {
        float ss = 0.f;
#pragma unroll
        for (int t = 0; t < T; ++t) ss += xr[t].x * xr[t].x + xr[t].y * xr[t].y + xr[t].z * xr[t].z + xr[t].w * xr[t].w;
        ss_partial(ss, s_red);
    }
    __syncthreads();
    {
        const float rs = rms_scale(s_red, H, eps);
        if constexpr (ACC) {  // the weights and the shared gate on the logits rs·(G·x); phase 2 reads them
            if (warp == 0) {
                const RouteRow r = route_weights_block<MOE_THREADS>(s_route, top_k, rs, g_raw);
                if (lane < top_k) s_w[lane] = r.w;
                if (lane == 0) s_sh[0] = r.shared;
                if (b == 0) route_store(r, 0, top_k, ids, weights, shared_scale);
            }
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const float4 h = norm_mul4(xr[t], rs, gain[t]);
            const int i4 = tid + MOE_THREADS * t;  // float4 i4: chunk i4 / 8, elements 4 (i4 % 8) ..
            store_codes4<1, XG>(s_hg + (i4 >> 3) * CB, 0, 4 * (i4 & 7), h, true);
            store_codes4<1, XS>(s_hs + (i4 >> 3) * CB, 0, 4 * (i4 & 7), h, true);
        }
    }
    __syncthreads();
    NINFER_TL_MARK(2);  // h staged
    if (e >= 0) tile_dots<GB, T>(q, s_hg, s_out);
    if (has_sh) {  // warps 0..4T-1 hold the rows' chunks (T warps a row), the others add 0
        const float v = warp_sum(sh_lane ? chunk_dot1<SB>(qsg, s_hs + sck * CB) : 0.f);
        if (lane == 0) s_sgp[warp] = v;
    }
    __syncthreads();
    NINFER_TL_MARK(3);  // the gate/up tile's weights arrived and are summed
    if (has_gu && tid < 16)
        act[(long long)pair * I + tile * 16 + tid] =
            e >= 0 ? siluf_(s_out[tid]) * s_out[16 + tid] : __int_as_float(0x7fc00000);
    if (has_sh && tid < 2) {
        float g = 0.f, u = 0.f;  // rows tid (gate) and tid + 2 (up), each summed over its T warps in order
#pragma unroll
        for (int w = 0; w < T; ++w) {
            g += s_sgp[T * tid + w];
            u += s_sgp[T * (tid + 2) + w];
        }
        act_s[2 * b + tid] = siluf_(g) * u;
    }

    // phase 2's weights and old x, before the barrier
    const int n0 = b * DR, half = lane >> 4, cl = lane & 15;
    const float x0 = has_dn && tid < DR ? __ldcg(x + n0 + tid) : 0.f;
    QChunk<DB> qd[DS][4];
    auto issue = [&](int j) {  // expert j's rows n0 + 8s + 4·half .. +4 of this half warp, chunk cl
        const int ej = s_e[j];
        if (ej < 0) return;
#pragma unroll
        for (int s = 0; s < DS; ++s) {
            const long long row0 = (long long)ej * H + n0 + 8 * s + 4 * half;
#pragma unroll
            for (int r = 0; r < 4; ++r) qchunk_load<DB, DG>(qd[s][r], dn.qs, dn.qh, dn.sc, row0 + r, dn.kp, cl);
        }
    };
    if (has_dn && warp < top_k) issue(warp);
    QChunk<SB> qsd;  // shared down: thread t < 16·DR row t / 16, chunk t % 16
    if (has_dn && tid < 16 * DR) qchunk_load<SB, SG>(qsd, sdn.qs, sdn.qh, sdn.sc, n0 + (tid >> 4), sdn.kp, tid & 15);

    grid_barrier(bar, sense);  // every act and act_s is written
    NINFER_TL_MARK(4);
    if constexpr (ACC) {  // every block routed before it arrived: the sums start from zero for the next token
        if (b == 0)
            for (int i = tid; i <= E; i += MOE_THREADS) acc[i] = 0;
    }
    if (!has_dn) return;       // whole block, after its last barrier with the grid

    // act (k·I) and act_s (I) as int16 chunk records (k·128 and 128 float4s: whole warps), written by other blocks
    if (top_k == MOE_STAGE_K) {
        stage_codes_fixed<XD, XS, true, MOE_STAGE_K * I / 4, I / 4>(s_act, act, s_acs, act_s);
    } else {
        stage_codes<XD, true>(s_act, reinterpret_cast<const float4*>(act), top_k * I / 4);
        stage_codes<XS, true>(s_acs, reinterpret_cast<const float4*>(act_s), I / 4);
    }
    __syncthreads();
    NINFER_TL_MARK(5);  // act staged
    for (int j = warp; j < top_k; j += MOE_WARPS) {  // uniform over the warp
        if (j != warp) issue(j);
        if (s_e[j] < 0) continue;  // the sum below turns NaN
#pragma unroll
        for (int s = 0; s < DS; ++s) {
            float acc[4][1] = {{0.f}, {0.f}, {0.f}, {0.f}};
            chunk_dots<DB>(qd[s], s_act + (j * NC + cl) * CB, acc);
            half_rows_store(acc, s_part + j * DR + 8 * s);
        }
    }
    if (tid < 16 * DR) {  // shared down: row tid / 16, summed over the half warp
        float v = chunk_dot1<SB>(qsd, s_acs + (tid & 15) * CB);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if ((tid & 15) == 0) s_shp[tid >> 4] = v;
    }
    __syncthreads();
    if (tid < DR) {
        const float total = expert_sum(s_e, s_w, s_part + tid, DR, top_k);
        x[n0 + tid] = fmaf(s_sh[0], s_shp[tid], x0 + total);
    }
}

// Entry points: moe_fused_t{T}_{gu}_{dn}_{sh} for the format triples of NINFER_MOE_FUSED_FORMATS (the recipes'
// decode MoE; other banks take moe.cu's three launches). Two blocks per SM (<= 128 registers).
#define NINFER_MOE_FUSED_FORMATS(X, T)                                                     \
    X(T, q4g64, 4, 64, q5g64, 5, 64, q8g32, 8, 32) X(T, q4g64, 4, 64, q6g64, 6, 64, q8g32, 8, 32) \
    X(T, q4g64, 4, 64, q4g64, 4, 64, q8g32, 8, 32) X(T, q8g32, 8, 32, q8g32, 8, 32, q8g32, 8, 32)

#define MOE_FUSED_ENTRY(T, gn, GB, GG, dname, DB, DG, sn, SB, SG)                                           \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2) moe_fused_t##T##_##gn##_##dname##_##sn(      \
        const uint8_t* gqs, const uint8_t* gqh, const __half* gsc, int gkp, const uint8_t* dqs,            \
        const uint8_t* dqh, const __half* dsc, int dkp, const uint8_t* sgqs, const uint8_t* sgqh,          \
        const __half* sgsc, int sgkp, const uint8_t* sdqs, const uint8_t* sdqh, const __half* sdsc,        \
        int sdkp, int E, int top_k, const float* norm_w, float eps, const float* logits, int* ids,         \
        float* weights, float* shared_scale, float* act, float* act_s, float* x, unsigned* bar) {          \
        moe_fused_body<GB, GG, DB, DG, SB, SG, T>(                                                          \
            QPlanes{gqs, gqh, gsc, gkp}, QPlanes{dqs, dqh, dsc, dkp}, QPlanes{sgqs, sgqh, sgsc, sgkp},       \
            QPlanes{sdqs, sdqh, sdsc, sdkp}, E, top_k, norm_w, eps, logits, ids, weights, shared_scale, act,  \
            act_s, x, bar);                                                                                 \
    }

NINFER_MOE_FUSED_FORMATS(MOE_FUSED_ENTRY, 1)
NINFER_MOE_FUSED_FORMATS(MOE_FUSED_ENTRY, 2)

// v71: moe_fused_acc_t{T}_{gu}_{dn}_{sh}, the same block routed on acc (ACC above); logits is unused.
#define MOE_FUSED_ACC_ENTRY(T, gn, GB, GG, dname, DB, DG, sn, SB, SG)                                       \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2) moe_fused_acc_t##T##_##gn##_##dname##_##sn(  \
        const uint8_t* gqs, const uint8_t* gqh, const __half* gsc, int gkp, const uint8_t* dqs,            \
        const uint8_t* dqh, const __half* dsc, int dkp, const uint8_t* sgqs, const uint8_t* sgqh,          \
        const __half* sgsc, int sgkp, const uint8_t* sdqs, const uint8_t* sdqh, const __half* sdsc,        \
        int sdkp, int E, int top_k, const float* norm_w, float eps, const float* logits, int* ids,         \
        float* weights, float* shared_scale, float* act, float* act_s, float* x, unsigned* bar,            \
        long long* acc) {                                                                                   \
        moe_fused_body<GB, GG, DB, DG, SB, SG, T, true>(                                                    \
            QPlanes{gqs, gqh, gsc, gkp}, QPlanes{dqs, dqh, dsc, dkp}, QPlanes{sgqs, sgqh, sgsc, sgkp},       \
            QPlanes{sdqs, sdqh, sdsc, sdkp}, E, top_k, norm_w, eps, logits, ids, weights, shared_scale, act,  \
            act_s, x, bar, acc);                                                                            \
    }
NINFER_MOE_FUSED_FORMATS(MOE_FUSED_ACC_ENTRY, 1)
NINFER_MOE_FUSED_FORMATS(MOE_FUSED_ACC_ENTRY, 2)
