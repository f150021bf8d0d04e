// moe_route.cuh: softmax top-k routing of one row by one warp (route_row: moe_route and the routed gate_up entry
// points of moe.cu) or by a whole block (route_row_block: moe_fused.cu), so that all choose the same experts and
// give the same weights and shared-expert scale to the bit.
//
// A row is logits fp32 [E + 1]: columns 0..E-1 router logits, column E the shared-expert gate logit.
// Matches ninfer_rt.reference.ops.moe: p = softmax(logits[:E]); (w, e) = topk(p, k); w / Σw; sigmoid(logits[E]).
#pragma once
#include "common.cuh"

#define MOE_MAX_K 16
#define MOE_MAX_E 512

// Softmax is monotone, so the top-k of p is the top-k of the logits (selected exactly, no rounding ties), and
// the renormalised weights p_j / Σ p are the softmax over the k chosen logits (the denominator cancels).
// Order: larger logit first, equal logits by lower index; ±0 and subnormals compare equal (the build flushes
// them: --use_fast_math), so they tie and go by index; NaN is never picked, -inf is (last, weight 0); when no
// candidate is left a round yields (id 0x7fffffff, logit -inf).
// Lane holds logits lane + 32s (s < SLOTS) in registers as order-preserving uint32 keys (0 = not a candidate); a
// round takes each lane's best by a slot tree (lower slot wins ties), the warp max key by one redux, the
// lowest index holding it by a second, and the owner lane marks that slot taken.
#define ROUTE_SLOTS (MOE_MAX_E / 32)

__device__ __forceinline__ uint32_t route_key(float v) {
    uint32_t u = __float_as_uint(v);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0u;      // NaN
    if (a < 0x00800000u) u = 0u;        // ±0, subnormals: one key
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // -inf -> 0x007FFFFF > 0
}

__device__ __forceinline__ float route_val(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

struct RouteRow {
    int id;        // lane j < top_k: the j-th chosen expert
    float w;       // lane j < top_k: its renormalised weight
    float shared;  // every lane: sigmoid(l[E])
};

// The last steps of a routing, on the calling warp: lane j < top_k holds its choice's exp(logit - top) in r.w,
// divided here by their sum; every lane gets sigmoid(g), g the shared-expert gate logit.
__device__ __forceinline__ void route_finish(RouteRow& r, int top_k, float g) {
    const int lane = threadIdx.x & 31;
    const float total = warp_sum(lane < top_k ? r.w : 0.f);
    if (lane < top_k) r.w = __fdiv_rn(r.w, total);
    const float e = exp_accurate(-fabsf(g));  // sigmoid without overflow in exp: the exponent is always <= 0
    r.shared = g >= 0.f ? __fdiv_rn(1.f, 1.f + e) : __fdiv_rn(e, 1.f + e);
}

// Route one row l[0..E] with the whole calling warp, E <= 32·SLOTS (route_row picks SLOTS).
template <int SLOTS>
__device__ __forceinline__ RouteRow route_row_slots(const float* __restrict__ l, int E, int top_k) {
    const int lane = threadIdx.x & 31;
    const float g = __ldg(l + E);
    // Every load issued before any is used: unconditional loads (past E, of l[E]), so that the compiler cannot
    // put each one in a branch with its use (that made 8 L2 round trips in series: ~3.5 µs per decode MoE).
    float v[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) v[s] = __ldg(l + min(lane + 32 * s, E));
    uint32_t key[SLOTS];
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) key[s] = lane + 32 * s < E ? route_key(v[s]) : 0u;
    uint32_t taken = 0;  // bit s: slot s already picked
    float top = 0.f;
    RouteRow r = {0, 0.f, 0.f};
    for (int j = 0; j < top_k; ++j) {
        uint32_t k2[SLOTS];
        int s2[SLOTS];
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            k2[s] = ((taken >> s) & 1u) ? 0u : key[s];
            s2[s] = s;
        }
#pragma unroll
        for (int st = 1; st < SLOTS; st <<= 1) {
#pragma unroll
            for (int s = 0; s < SLOTS; s += 2 * st) {
                if (k2[s + st] > k2[s]) { k2[s] = k2[s + st]; s2[s] = s2[s + st]; }
            }
        }
        const uint32_t K = __reduce_max_sync(0xffffffffu, k2[0]);
        const uint32_t cand = (K != 0u && k2[0] == K) ? (uint32_t)(lane + 32 * s2[0]) : 0x7fffffffu;
        const int bi = (int)__reduce_min_sync(0xffffffffu, cand);
        const float bv = K != 0u ? route_val(K) : -INFINITY;
        if (K != 0u && lane == (bi & 31)) taken |= 1u << (bi >> 5);
        if (j == 0) top = bv;
        if (lane == j) { r.id = bi; r.w = exp_accurate(bv - top); }
    }
    route_finish(r, top_k, g);
    return r;
}

// Route one row l[0..E] with the whole calling warp (E <= MOE_MAX_E, top_k <= 32, both warp-uniform). Rows of at
// most 256 experts (the family's) take 8 slots a lane: each round's slot tree is half as long, same choices.
__device__ __forceinline__ RouteRow route_row(const float* __restrict__ l, int E, int top_k) {
    return E <= 256 ? route_row_slots<8>(l, E, top_k) : route_row_slots<ROUTE_SLOTS>(l, E, top_k);
}

// Routing of one row by a whole block of NT threads (E <= NT: one logit a thread; top_k <= MOE_MAX_K), the same
// choices, weights and shared scale as route_row to the bit, in two rank passes instead of top_k serial rounds:
//   1. a thread's rank in its warp = keys above it + equal keys at lower lanes (match_any); the warp's first
//      top_k go to its KP candidate slots (KP = 4, 8 or 16 >= top_k), in rank order;
//   2. a candidate's rank among all 8·KP = its keys above + equal keys at lower slots (slot order is index order
//      among equal keys), counted by NT / (8·KP) threads; ranks below top_k are the choices, in order.
// Every thread must call it (two block barriers); the result is valid in warp 0.
template <int NT>
struct RouteBlockSmem {
    __align__(16) uint32_t key[NT];
    __align__(16) uint32_t ckey[NT / 32 * MOE_MAX_K];  // candidate keys (0: empty slot)
    int cidx[NT / 32 * MOE_MAX_K];                     // their expert ids
    uint32_t sel_id[MOE_MAX_K];                        // the choices in order
    uint32_t sel_key[MOE_MAX_K];
};

// route_keys_block: the two passes on logit v of thread tid < E; after it (its last block barrier) sm.sel_id and
// sm.sel_key hold the choices in order. route_weights_block: warp 0's RouteRow from them, the logits scaled by
// `scale` > 0 (the selection does not depend on it), g the shared-expert gate logit (unscaled).
template <int NT>
__device__ __forceinline__ void route_keys_block(float v, int E, int top_k, RouteBlockSmem<NT>& sm) {
    static_assert(NT == 256, "pass 2's split (P = 32 / KP threads a candidate, KP²/4 slots each) is for 8 warps");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t key = tid < E ? route_key(v) : 0u;
    const int lk = top_k <= 4 ? 2 : (top_k <= 8 ? 3 : 4), kp = 1 << lk;  // kp = 4, 8 or 16
    sm.key[tid] = key;
    if (lane < kp) sm.ckey[warp * kp + lane] = 0u;
    if (tid < top_k) {
        sm.sel_id[tid] = 0x7fffffffu;  // route_row's id when no candidate is left
        sm.sel_key[tid] = 0u;
    }
    __syncwarp();
    int above = 0;
    const uint4* k4 = reinterpret_cast<const uint4*>(sm.key + 32 * warp);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint4 q = k4[i];
        above += (q.x > key) + (q.y > key) + (q.z > key) + (q.w > key);
    }
    const int rank1 = above + __popc(__match_any_sync(0xffffffffu, key) & ((1u << lane) - 1u));
    if (key != 0u && rank1 < top_k) {
        sm.ckey[warp * kp + rank1] = key;
        sm.cidx[warp * kp + rank1] = tid;
    }
    __syncthreads();
    // 8·kp candidates, P = 32 / kp threads a candidate, span = kp² / 4 slots each. Shifts, not divisions: an
    // integer division is a call, and ptxas waits on every load in flight before a call (the pre-wait weights too).
    const int lp = 5 - lk, ls = 2 * lk - 2, P = 1 << lp, span = 1 << ls;
    const int c = tid >> lp, d0 = (tid & (P - 1)) << ls;
    const uint32_t kc = sm.ckey[c];
    int rank2 = 0;
#pragma unroll 4
    for (int d = d0; d < d0 + span; d += 4) {
        const uint4 q = *reinterpret_cast<const uint4*>(sm.ckey + d);
        rank2 += (q.x > kc) + (q.y > kc) + (q.z > kc) + (q.w > kc);
        rank2 += (q.x == kc && d < c) + (q.y == kc && d + 1 < c) + (q.z == kc && d + 2 < c) + (q.w == kc && d + 3 < c);
    }
    for (int o = 1; o < P; o <<= 1) rank2 += __shfl_xor_sync(0xffffffffu, rank2, o);
    if (d0 == 0 && kc != 0u && rank2 < top_k) {
        sm.sel_id[rank2] = (uint32_t)sm.cidx[c];
        sm.sel_key[rank2] = kc;
    }
    __syncthreads();
}

template <int NT>
__device__ __forceinline__ RouteRow route_weights_block(const RouteBlockSmem<NT>& sm, int top_k, float scale,
                                                        float g) {
    const int lane = threadIdx.x & 31;
    RouteRow r = {0, 0.f, 0.f};
    const uint32_t K = lane < top_k ? sm.sel_key[lane] : 0u;  // route_row's last steps on the same values
    const float bv = K != 0u ? route_val(K) : -INFINITY;
    const float top = __shfl_sync(0xffffffffu, bv, 0);
    if (lane < top_k) {
        r.id = (int)sm.sel_id[lane];
        r.w = exp_accurate(scale * (bv - top));
    }
    route_finish(r, top_k, scale * g);
    return r;
}

template <int NT>
__device__ __forceinline__ RouteRow route_row_block(const float* __restrict__ l, int E, int top_k,
                                                    RouteBlockSmem<NT>& sm) {
    const int tid = threadIdx.x, warp = tid >> 5;
    const float v = __ldg(l + min(tid, E));
    const float g = warp == 0 ? __ldg(l + E) : 0.f;
    route_keys_block<NT>(v, E, top_k, sm);
    RouteRow r = {0, 0.f, 0.f};
    if (warp == 0) r = route_weights_block<NT>(sm, top_k, 1.f, g);
    return r;
}

// Row m's outputs: ids int32 [., top_k], weights fp32 [., top_k], shared_scale fp32 [.] (from the routing warp).
__device__ __forceinline__ void route_store(const RouteRow& r, int m, int top_k, int* __restrict__ ids,
                                            float* __restrict__ weights, float* __restrict__ shared_scale) {
    const int lane = threadIdx.x & 31;
    if (lane < top_k) {
        ids[(long long)m * top_k + lane] = r.id;
        weights[(long long)m * top_k + lane] = r.w;
    }
    if (lane == 0) shared_scale[m] = r.shared;
}
