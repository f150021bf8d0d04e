// deltanet_chunked.cu: the gated delta rule over chunks of DN_CHUNK tokens (the prefill form), the
// deltanet_recurrent_dk* step of deltanet.cu for long T: same inputs, outputs and state update, in two launches.
//
//   deltanet_chunk_prep_dk{DK}        per (chunk, head), all in parallel: the parts that do not depend on S
//   deltanet_chunk_state_dk{DK}[_s1]  per (head, 32 columns of S), chunk after chunk: V', o and S
//   (DK = 16, 32, 64, 128; _s1: one record stage, for GPUs whose shared memory does not hold two)
//   together: ops.gated_delta_rule_chunked (= ops.gated_delta_rule_recurrent up to fp32 rounding)
//
// Layouts as deltanet.cu: c fp32 [B·T, conv_dim] (the conv output: q | k | v), ba fp32 [B·T, 2·nv] ([b | a]),
// ssm_state fp32 [slots, nv, dk, dv] (S[h][i][j]), slot int32 [B], o fp32 [B·T, nv·dv].
//
// Per value head h and chunk of C tokens (rows r, s < C; rows past T are zeros, which leave S unchanged):
//   γ_r = Σ_{u≤r} g_u;  A_rs = β_r (k̂_r·k̂_s) e^{γ_r−γ_s} (s < r);  QK_rs = (q̂_r·k̂_s) e^{γ_r−γ_s} (s ≤ r)
//   W = (I + A)^-1 (β e^γ ⊙ k̂);  U = (I + A)^-1 (β ⊙ v);  V' = U − W S
//   o = (e^γ ⊙ q̂) S + QK V';  S ← e^{γ_L} S + (e^{γ_L−γ} ⊙ k̂)ᵀ V'          (γ_L = γ_{C−1})
// Why two kernels: everything but the three products with S is independent across chunks. The prep kernel
// computes it for all chunks at once (grid chunks × heads, full occupancy) and writes one record per
// (sequence, chunk, head); the state kernel's chain over chunks is left with V', o and the S update only.
//
// Record (floats, C·(3·DK + C) + 4, 16-byte aligned; index (b·chunks + chunk)·nv + h), laid out as the state
// kernel reads it (k-major, so a thread's 4 rows at one k are one float4):
//   WQ [DK][2C]: WQ[i][r] = W[r][i], WQ[i][C + r] = (e^γ ⊙ q̂)[r][i] | KD [C][DK] e^{γ_L−γ} ⊙ k̂ |
//   QKT [C][C]: QKT[s][r] = QK[r][s] (zeros where s > r) | e^{γ_L}, 0, 0, 0
// U overwrites v in c (rows < T): block (chunk, h) is the only reader and writer of those elements.
// deltanet.py chunked_scratch_bytes sizes the records; prep_smem_bytes / state_smem_bytes mirror the layouts here.
#include "common.cuh"
#include "deltanet.cuh"

#define DN_CHUNK 32  // tokens per chunk: one warp's lanes in the γ scan; A and QK are [32][36]
#define DN_COLS 32   // columns of S per state block: one per lane

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int C = DN_CHUNK, CP = C + 4;  // A / QK rows of C + 4: float4-aligned

template <int DK>
struct Rec {  // one record's fields, offsets in floats
    static constexpr int WQ = 0, KD = 2 * C * DK, QKT = 3 * C * DK, EL = QKT + C * C, FLOATS = EL + 4;
};

// ------------------------------------------------------------------------------------------------ prep

// grid (chunks, nv, B), kThreads. Shared memory (floats): q, k, w [C][DK + 4]; v [C][dv + 4]; A, QK [C][C + 4];
// γ, β, e^γ, e^{γ_L−γ} [C]; e^{γ_L} (+3 pad).
template <int DK>
__device__ __forceinline__ void prep_impl(float* __restrict__ c, const float* __restrict__ ba,
                                          const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                          float* __restrict__ rec, int T, int nk, int nv, int dv) {
    using R = Rec<DK>;
    constexpr int P = DK + 4;  // q/k/w row stride: float4 rows that start in different bank quads
    const int VS = dv + 4;     // v row stride: 16-byte rows for cp.async; a substitution column per thread
    extern __shared__ __align__(16) float sm[];
    float *sq = sm, *sk = sq + C * P, *sw = sk + C * P, *sv = sw + C * P, *sA = sv + C * VS, *sQK = sA + C * CP;
    float *gam = sQK + C * CP, *beta = gam + C, *eg = beta + C, *fL = eg + C, *eL = fL + C;
    require_dynamic_smem((uint32_t)(eL + 4 - sm) * 4);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ci = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t0 = ci * C, n = min(C, T - t0);
    const int hk = h / (nv / nk), conv_dim = 2 * nk * DK + nv * dv;
    const size_t row0 = (size_t)b * T + t0;
    float* vg = c + row0 * conv_dim + 2 * nk * DK + (size_t)h * dv;  // v (then U) of row 0 of the chunk

    // q, k and v of the chunk's rows by cp.async, all in flight at once (rows past T: zeros)
    for (int idx = tid; idx < C * DK / 4; idx += kThreads) {
        const int r = idx / (DK / 4), i = 4 * (idx % (DK / 4));
        const float* src = c + (row0 + (r < n ? r : 0)) * conv_dim + hk * DK + i;
        cp_async16(smem_addr(sq + r * P + i), src, r < n);
        cp_async16(smem_addr(sk + r * P + i), src + nk * DK, r < n);
    }
    for (int idx = tid; idx < C * dv / 4; idx += kThreads) {
        const int r = idx / (dv / 4), j = 4 * (idx % (dv / 4));
        cp_async16(smem_addr(sv + r * VS + j), vg + (size_t)(r < n ? r : 0) * conv_dim + j, r < n);
    }
    cp_async_commit();
    if (warp == 0) {  // gates: β, γ (inclusive scan of g over the chunk's lanes) and the decays
        const bool on = lane < n;
        const float rb = on ? ba[(row0 + lane) * 2 * nv + h] : 0.f, ra = on ? ba[(row0 + lane) * 2 * nv + nv + h] : 0.f;
        float g = on ? -__expf(A_log[h]) * softplusf_(ra + dt_bias[h]) : 0.f;
#pragma unroll
        for (int o2 = 1; o2 < 32; o2 <<= 1) {
            const float t = __shfl_up_sync(0xffffffffu, g, o2);
            if (lane >= o2) g += t;
        }
        const float gl = __shfl_sync(0xffffffffu, g, C - 1);
        gam[lane] = g;
        beta[lane] = on ? sigmoidf_(rb) : 0.f;
        eg[lane] = __expf(g);
        fL[lane] = __expf(gl - g);
        if (lane == 0) eL[0] = __expf(gl);
    }
    cp_async_wait<0>();
    __syncthreads();

    // q̂ = q·rsqrt(Σq² + eps)·dk^-0.5, k̂ = k·rsqrt(Σk² + eps): one warp per vector, in place
    const float q_scale = rsqrtf((float)DK);
    for (int vi = warp; vi < 2 * C; vi += kWarps) {
        const bool is_k = vi & 1;
        float* x = (is_k ? sk : sq) + (vi >> 1) * P;
        float ss = 0.f;
        for (int i = lane; i < DK; i += 32) ss = fmaf(x[i], x[i], ss);
        ss = warp_sum(ss);
        const float scale = rsqrtf(ss + DN_L2_EPS) * (is_k ? 1.f : q_scale);
        for (int i = lane; i < DK; i += 32) x[i] *= scale;
    }
    __syncthreads();

    // A and QK (thread: row r, columns s = sb + 8m), and the right-hand sides β e^γ k̂ (into w) and β v
    {
        const int r = tid >> 3, sb = tid & 7;
        float kk[4] = {0.f, 0.f, 0.f, 0.f}, qk[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int i = 0; i < DK; i += 4) {
            const float4 qr = *reinterpret_cast<const float4*>(sq + r * P + i);
            const float4 kr = *reinterpret_cast<const float4*>(sk + r * P + i);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float4 ks = *reinterpret_cast<const float4*>(sk + (sb + 8 * m) * P + i);
                kk[m] += kr.x * ks.x + kr.y * ks.y + kr.z * ks.z + kr.w * ks.w;
                qk[m] += qr.x * ks.x + qr.y * ks.y + qr.z * ks.z + qr.w * ks.w;
            }
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int s = sb + 8 * m;
            const float d = s <= r ? __expf(gam[r] - gam[s]) : 0.f;  // masked before exp: γ_r − γ_s > 0 for s > r
            sA[r * CP + s] = s < r ? beta[r] * kk[m] * d : 0.f;
            sQK[r * CP + s] = qk[m] * d;
        }
    }
    for (int idx = tid; idx < C * DK; idx += kThreads) {
        const int r = idx / DK, i = idx % DK;
        sw[r * P + i] = beta[r] * eg[r] * sk[r * P + i];
    }
    for (int idx = tid; idx < C * dv; idx += kThreads) sv[(idx / dv) * VS + idx % dv] *= beta[idx / dv];
    __syncthreads();

    // (I + A) X = rhs by forward substitution, one column per thread held in registers: W's DK, U's dv.
    // A's row is read 4 at a time (a broadcast float4) into 4 partial sums: 4x fewer loads, shorter chains.
    for (int col = tid; col < DK + dv; col += kThreads) {
        float* base = col < DK ? sw + col : sv + (col - DK);
        const int stride = col < DK ? P : VS;
        float x[C];
#pragma unroll
        for (int r = 0; r < C; ++r) x[r] = base[r * stride];
#pragma unroll
        for (int r = 1; r < C; ++r) {
            float acc[4] = {x[r], 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < (r & ~3); s += 4) {
                const float4 a = *reinterpret_cast<const float4*>(sA + r * CP + s);
                acc[0] = fmaf(-a.x, x[s], acc[0]);
                acc[1] = fmaf(-a.y, x[s + 1], acc[1]);
                acc[2] = fmaf(-a.z, x[s + 2], acc[2]);
                acc[3] = fmaf(-a.w, x[s + 3], acc[3]);
            }
#pragma unroll
            for (int s = r & ~3; s < r; ++s) acc[s & 3] = fmaf(-sA[r * CP + s], x[s], acc[s & 3]);
            x[r] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
#pragma unroll
        for (int r = 0; r < C; ++r) base[r * stride] = x[r];
    }
    __syncthreads();

    // the record (float4 stores; WQ and QKT gathered down columns), and U over v for the chunk's real rows
    float* out = rec + (((size_t)b * gridDim.x + ci) * nv + h) * R::FLOATS;
    for (int idx = tid; idx < DK * 2 * C / 4; idx += kThreads) {
        const int i = idx / (C / 2), r = 4 * (idx % (C / 2));  // WQ[i][r .. r+3]: W rows below C, then QG rows
        const float* src = r < C ? sw + r * P + i : sq + (r - C) * P + i;
        const float* e = r < C ? nullptr : eg + (r - C);
        float4 v = make_float4(src[0], src[P], src[2 * P], src[3 * P]);
        if (e) v.x *= e[0], v.y *= e[1], v.z *= e[2], v.w *= e[3];
        *reinterpret_cast<float4*>(out + R::WQ + i * 2 * C + r) = v;
    }
    for (int idx = tid; idx < C * DK / 4; idx += kThreads) {
        const int r = idx / (DK / 4), i = 4 * (idx % (DK / 4));
        float4 k = *reinterpret_cast<const float4*>(sk + r * P + i);
        const float f = fL[r];
        k.x *= f, k.y *= f, k.z *= f, k.w *= f;
        *reinterpret_cast<float4*>(out + R::KD + r * DK + i) = k;
    }
    for (int idx = tid; idx < C * C / 4; idx += kThreads) {
        const int s2 = idx / (C / 4), r = 4 * (idx % (C / 4));  // QKT[s2][r .. r+3]
        *reinterpret_cast<float4*>(out + R::QKT + s2 * C + r) =
            make_float4(sQK[r * CP + s2], sQK[(r + 1) * CP + s2], sQK[(r + 2) * CP + s2], sQK[(r + 3) * CP + s2]);
    }
    if (tid < 4) out[R::EL + tid] = tid == 0 ? eL[0] : 0.f;
    for (int idx = tid; idx < n * dv; idx += kThreads)
        vg[(size_t)(idx / dv) * conv_dim + idx % dv] = sv[(idx / dv) * VS + idx % dv];
}

// ------------------------------------------------------------------------------------------------ state

// N consecutive floats from shared memory (N = 1, 2, 4 or a multiple of 4; 16-byte aligned for N >= 4)
template <int N>
__device__ __forceinline__ void lds(float (&d)[N], const float* p) {
    if constexpr (N == 1) {
        d[0] = p[0];
    } else if constexpr (N == 2) {
        const float2 v = *reinterpret_cast<const float2*>(p);
        d[0] = v.x, d[1] = v.y;
    } else {
#pragma unroll
        for (int u = 0; u < N; u += 4) {
            const float4 v = *reinterpret_cast<const float4*>(p + u);
            d[u] = v.x, d[u + 1] = v.y, d[u + 2] = v.z, d[u + 3] = v.w;
        }
    }
}

// grid (dv / DN_COLS, nv, B), kThreads: a block owns DN_COLS columns of one head's S (columns are independent in
// the delta rule) and walks the chunks in order. Each chunk's record and U columns are copied by cp.async into
// one of STAGES buffers, the next chunk's while this one computes (STAGES = 2), else prefetched into L2.
// Thread (g = 2·warp + lane / 16, column pair p = lane % 16) computes register tiles of 2 columns: 4 of the 64
// stacked rows of [W; QG] S, then (QG threads) 4 rows of QK V', then DK / 16 rows of S: per k one float4 and one
// float2 load for 8 FMAs (perf.md v18: one column per thread needed 3 loads per 8, bound by shared memory).
// Shared memory (floats): S [DK][DN_COLS]; STAGES × (record, U [C][DN_COLS]).
template <int DK, int STAGES>
__device__ __forceinline__ void state_impl(const float* __restrict__ c, const float* __restrict__ rec,
                                           float* __restrict__ ssm_state, const int* __restrict__ slot,
                                           float* __restrict__ o, int T, int nk, int nv, int dv) {
    using R = Rec<DK>;
    constexpr int STAGE = R::FLOATS + C * DN_COLS, RI = DK / 16;  // RI: rows of S per thread
    static_assert(kThreads == 256 && C == 32 && DN_COLS == 32, "the register tiles assume 16 × 16 threads");
    extern __shared__ __align__(16) float sm[];
    float* sS = sm;
    require_dynamic_smem((DK * DN_COLS + STAGES * STAGE) * 4);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = 2 * warp + (lane >> 4), cp = 2 * (lane & 15);  // row group, first column of the pair
    const int h = blockIdx.y, b = blockIdx.z, col0 = blockIdx.x * DN_COLS;
    const int conv_dim = 2 * nk * DK + nv * dv, nchunks = (T + C - 1) / C;
    const size_t row0 = (size_t)b * T;
    const float* recs = rec + ((size_t)b * nchunks * nv + h) * R::FLOATS;  // chunk ci: + ci·nv·FLOATS
    const float* ug = c + row0 * conv_dim + 2 * nk * DK + (size_t)h * dv + col0;
    float* Sg = ssm_state + ((size_t)slot[b] * nv + h) * DK * dv + col0;
    for (int idx = tid; idx < DK * DN_COLS; idx += kThreads) sS[idx] = Sg[(size_t)(idx >> 5) * dv + (idx & 31)];

    auto issue = [&](int ci, float* st) {  // chunk ci's record and U columns into st (U rows past T: zeros)
        const float* src = recs + (size_t)ci * nv * R::FLOATS;
        for (int idx = tid; idx < R::FLOATS / 4; idx += kThreads)
            cp_async16(smem_addr(st + 4 * idx), src + 4 * idx, true);
        for (int idx = tid; idx < C * DN_COLS / 4; idx += kThreads) {
            const int r = idx / (DN_COLS / 4), q = 4 * (idx % (DN_COLS / 4));
            const bool ok = ci * C + r < T;
            cp_async16(smem_addr(st + R::FLOATS + r * DN_COLS + q), ok ? ug + (size_t)(ci * C + r) * conv_dim + q : ug,
                       ok);
        }
        cp_async_commit();
    };
    auto prefetch = [&](int ci) {  // one stage: the next record into L2 while this chunk computes
        const char* src = reinterpret_cast<const char*>(recs + (size_t)ci * nv * R::FLOATS);
        for (int off = 128 * tid; off < R::FLOATS * 4; off += 128 * kThreads) prefetch_l2(src + off);
    };

    if (STAGES == 2) issue(0, sm + DK * DN_COLS);
    for (int ci = 0; ci < nchunks; ++ci) {
        float* st = sm + DK * DN_COLS + (STAGES == 2 ? (ci & 1) * STAGE : 0);
        if (STAGES == 1) {
            __syncthreads();  // everyone is done with chunk ci−1's stage
            issue(ci, st);
        }
        cp_async_wait<0>();
        __syncthreads();  // chunk ci has landed for everyone; everyone is done with chunk ci−1 (its stage, S)
        if (STAGES == 2 && ci + 1 < nchunks) issue(ci + 1, sm + DK * DN_COLS + ((ci + 1) & 1) * STAGE);
        if (STAGES == 1 && ci + 1 < nchunks) prefetch(ci + 1);
        float* su = st + R::FLOATS;

        // [W; QG] S: rows 4g .. 4g+3 of the 64 stacked rows (g < 8: W, V' = U − W S in place on U; else QG S, kept)
        float acc[4][2];
#pragma unroll
        for (int u = 0; u < 4; ++u) acc[u][0] = acc[u][1] = 0.f;
#pragma unroll 8
        for (int i = 0; i < DK; ++i) {
            float a[4], sv[2];
            lds<4>(a, st + R::WQ + i * 2 * C + 4 * g);
            lds<2>(sv, sS + i * DN_COLS + cp);
#pragma unroll
            for (int u = 0; u < 4; ++u)
                acc[u][0] = fmaf(a[u], sv[0], acc[u][0]), acc[u][1] = fmaf(a[u], sv[1], acc[u][1]);
        }
        if (g < 8) {
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                float2* v = reinterpret_cast<float2*>(su + (4 * g + u) * DN_COLS + cp);
                *v = make_float2(v->x - acc[u][0], v->y - acc[u][1]);
            }
        }
        __syncthreads();  // V' complete; every read of S for this chunk is done

        // o = QG S + QK V' for rows 4(g − 8) .. +3 (the QG threads), written for the chunk's real rows
        if (g >= 8) {
            const int r0 = 4 * (g - 8);
#pragma unroll 8
            for (int s2 = 0; s2 < C; ++s2) {
                float q[4], v[2];
                lds<4>(q, st + R::QKT + s2 * C + r0);
                lds<2>(v, su + s2 * DN_COLS + cp);
#pragma unroll
                for (int u = 0; u < 4; ++u)
                    acc[u][0] = fmaf(q[u], v[0], acc[u][0]), acc[u][1] = fmaf(q[u], v[1], acc[u][1]);
            }
            const int t0 = ci * C;
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (t0 + r0 + u < T)
                    *reinterpret_cast<float2*>(o + (row0 + t0 + r0 + u) * nv * dv + (size_t)h * dv + col0 + cp) =
                        make_float2(acc[u][0], acc[u][1]);
        }

        // S ← e^{γ_L} S + KDᵀ V' for rows RI·g .. +RI−1, columns cp, cp + 1
        {
            const int i0 = RI * g;
            const float el = st[R::EL];
            float sr[RI][2];
#pragma unroll
            for (int m = 0; m < RI; ++m) {
                float v[2];
                lds<2>(v, sS + (i0 + m) * DN_COLS + cp);
                sr[m][0] = el * v[0], sr[m][1] = el * v[1];
            }
#pragma unroll 4
            for (int r = 0; r < C; ++r) {
                float k[RI], v[2];
                lds<RI>(k, st + R::KD + r * DK + i0);
                lds<2>(v, su + r * DN_COLS + cp);
#pragma unroll
                for (int m = 0; m < RI; ++m)
                    sr[m][0] = fmaf(k[m], v[0], sr[m][0]), sr[m][1] = fmaf(k[m], v[1], sr[m][1]);
            }
#pragma unroll
            for (int m = 0; m < RI; ++m)
                *reinterpret_cast<float2*>(sS + (i0 + m) * DN_COLS + cp) = make_float2(sr[m][0], sr[m][1]);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < DK * DN_COLS; idx += kThreads) Sg[(size_t)(idx >> 5) * dv + (idx & 31)] = sS[idx];
}

}  // namespace

#define DN_CHUNKED(DK)                                                                                          \
    extern "C" __global__ void __launch_bounds__(kThreads) deltanet_chunk_prep_dk##DK(                        \
        float* __restrict__ c, const float* __restrict__ ba, const float* __restrict__ A_log,                  \
        const float* __restrict__ dt_bias, float* __restrict__ rec, int T, int nk, int nv, int dv) {          \
        ninfer_pdl_begin();                                                                                     \
        prep_impl<DK>(c, ba, A_log, dt_bias, rec, T, nk, nv, dv);                                              \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(kThreads) deltanet_chunk_state_dk##DK(                  \
        const float* __restrict__ c, const float* __restrict__ rec, float* __restrict__ ssm_state,             \
        const int* __restrict__ slot, float* __restrict__ o, int T, int nk, int nv, int dv) {                  \
        ninfer_pdl_begin();                                                                                     \
        state_impl<DK, 2>(c, rec, ssm_state, slot, o, T, nk, nv, dv);                                          \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(kThreads) deltanet_chunk_state_dk##DK##_s1(             \
        const float* __restrict__ c, const float* __restrict__ rec, float* __restrict__ ssm_state,             \
        const int* __restrict__ slot, float* __restrict__ o, int T, int nk, int nv, int dv) {                  \
        ninfer_pdl_begin();                                                                                     \
        state_impl<DK, 1>(c, rec, ssm_state, slot, o, T, nk, nv, dv);                                          \
    }
DN_CHUNKED(16)
DN_CHUNKED(32)
DN_CHUNKED(64)
DN_CHUNKED(128)
