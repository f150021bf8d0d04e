// deltanet_chunked.cu: the gated delta rule over chunks of DN_CHUNK tokens (the prefill form), the
// deltanet_recurrent_dk* step of deltanet.cu for long T: same inputs, outputs and state update, in two launches.
//
//   deltanet_chunk_prep_dk{DK}        per (chunk, head), all in parallel: the parts that do not depend on S
//   deltanet_chunk_state_dk{DK}[_s1]  per (head, 32 columns of S), chunk after chunk: V', o and S, on tensor
//                                     cores (mma.sync tf32, three terms: fp32 accuracy)
//   (DK = 16, 32, 64, 128; _s1: one record stage, for GPUs whose shared memory does not hold two)
//   together: ops.gated_delta_rule_chunked (= ops.gated_delta_rule_recurrent up to fp32-level rounding)
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
// Record (floats, C·(3·DK + C) + 4, 16-byte aligned; index (b·chunks + chunk)·nv + h); the state kernel's copy
// pads its rows (StateGeo) so the MMA fragments load without bank conflicts:
//   WQ [DK][2C]: WQ[i][r] = W[r][i], WQ[i][C + r] = (e^γ ⊙ q̂)[r][i] | KD [C][DK] e^{γ_L−γ} ⊙ k̂ |
//   QKT [C][C]: QKT[s][r] = QK[r][s] (zeros where s > r) | e^{γ_L}, 0, 0, 0
// U overwrites v in c (rows < T): block (chunk, h) is the only reader and writer of those elements.
// deltanet.py chunked_scratch_bytes sizes the records; prep_smem_bytes / state_smem_bytes mirror the layouts here.
#include "common.cuh"
#include "deltanet.cuh"

#define DN_CHUNK 32  // tokens per chunk: one warp's lanes in the γ scan; A and QK are [32][36]
#define DN_COLS 32   // columns of S per state block: four 8-column MMA tiles

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

// mma.sync m16n8k8 on tf32 (sm_80+), fp32 accumulate: d += a · b. Fragments (lane = 4g + t): a = A(g, t), A(g+8, t),
// A(g, t+4), A(g+8, t+4); b = B(t, g), B(t+4, g); d = D(g, 2t), D(g, 2t+1), D(g+8, 2t), D(g+8, 2t+1).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x as hi + lo, both tf32 (hi: x rounded to 11 significant bits; lo: the rest, rounded the same way): 3xTF32 drops
// only lo·lo, so a product keeps ~2^-21 relative accuracy, about fp32's (the test bound is 1e-4).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
}

// The hi and lo A fragments of a 16 × 8 tile whose element (m, k) sits at p[k·ks + m].
template <int KS>
__device__ __forceinline__ void frag_a(const float* p, int g, int t, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    split_tf32(p[t * KS + g], hi[0], lo[0]);
    split_tf32(p[t * KS + g + 8], hi[1], lo[1]);
    split_tf32(p[(t + 4) * KS + g], hi[2], lo[2]);
    split_tf32(p[(t + 4) * KS + g + 8], hi[3], lo[3]);
}

// The hi and lo B fragments of an 8 × 8 tile whose element (k, n) sits at p[k·ks + n].
template <int KS>
__device__ __forceinline__ void frag_b(const float* p, int g, int t, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
    split_tf32(p[t * KS + g], hi[0], lo[0]);
    split_tf32(p[(t + 4) * KS + g], hi[1], lo[1]);
}

// d += a · b in 3xTF32, the small terms first
__device__ __forceinline__ void mma3(float (&d)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                     const uint32_t (&bh)[2], const uint32_t (&bl)[2]) {
    mma_tf32(d, al, bh);
    mma_tf32(d, ah, bl);
    mma_tf32(d, ah, bh);
}

// Shared-memory rows of the state kernel, in floats, padded so that every fragment load is bank-conflict free (a
// lane's address is 8t + g apart from its neighbours' modulo 32): one stage = a chunk's record re-laid by the copy
// (WQ [DK][2C + 8], KD [C][DK + 8], QKT [C][C + 8], e^{γ_L} and 3 pads) and its U columns [C][DN_COLS + 8].
// deltanet.py state_smem_bytes mirrors StateGeo.
template <int DK>
struct StateGeo {
    static constexpr int WQP = 2 * C + 8, KDP = DK + 8, QKP = C + 8, SP = DN_COLS + 8;  // SP: S, V' and U rows
    static constexpr int WQ = 0, KD = DK * WQP, QK = KD + C * KDP, EL = QK + C * QKP, U = EL + 4, STAGE = U + C * SP;
    static constexpr int FIXED = (DK + C) * SP;  // S [DK][SP], V' [C][SP]
};

// grid (dv / DN_COLS, nv, B), kThreads: a block owns DN_COLS columns of one head's S (columns are independent in
// the delta rule) and walks the chunks in order, the three products with S on tensor cores in 3xTF32
// (perf-history.md v22: 4% faster than v18's fp32 FMAs; both are latency-bound at 8 warps per SM). Each chunk's
// record and U columns are copied (bulk copies on sm_90+, else cp.async) into one of STAGES stages, the next
// chunk's while this one computes (STAGES = 2), else prefetched into L2; the chunk after that is prefetched into L2
// either way.
//   1. [W; QG] S (2C × DK times DK × 32): warp w the 16 rows 16(w / 2) and columns 16(w % 2) .. + 15; the W rows
//      give V' = U − W S (into shared memory), the QG rows stay in registers for o.
//   2. o = QG S + QK V' (the QG warps; QK is lower triangular), written for the chunk's real rows.
//   3. S ← e^{γ_L} S + KDᵀ V' (DK × C times C × 32): S lives in the registers of these tiles (fp32; warp w: tiles
//      w·PW .. of 16 rows × 8 columns), copied to shared memory for step 1 of the next chunk.
template <int DK, int STAGES>
__device__ __forceinline__ void state_impl(const float* __restrict__ c, const float* __restrict__ rec,
                                           float* __restrict__ ssm_state, const int* __restrict__ slot,
                                           float* __restrict__ o, int T, int nk, int nv, int dv) {
    using R = Rec<DK>;
    using G = StateGeo<DK>;
    constexpr int SP = G::SP, T3 = DK / 4, PW = (T3 + kWarps - 1) / kWarps;  // step-3 tiles, per warp
    static_assert(kThreads == 256 && C == 32 && DN_COLS == 32, "8 warps: 4 × 2 tiles of 16 × 16 in step 1");
    static_assert(PW == 1 || PW == 2 || PW == 4, "a warp's step-3 tiles share their 16 rows");
    extern __shared__ __align__(16) float sm[];
    float* sS = sm;            // S [DK][SP]
    float* sV = sS + DK * SP;  // V' [C][SP]
    require_dynamic_smem((G::FIXED + STAGES * G::STAGE) * 4);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z, col0 = blockIdx.x * DN_COLS;
    const int conv_dim = 2 * nk * DK + nv * dv, nchunks = (T + C - 1) / C;
    const size_t row0 = (size_t)b * T;
    const float* recs = rec + ((size_t)b * nchunks * nv + h) * R::FLOATS;  // chunk ci: + ci·nv·FLOATS
    const float* ug = c + row0 * conv_dim + 2 * nk * DK + (size_t)h * dv + col0;
    float* Sg = ssm_state + ((size_t)slot[b] * nv + h) * DK * dv + col0;

    // step-3 tiles x < PW: element e at row m3 + g + 8(e >> 1), column c3(x) + 2t + (e & 1), tile id warp·PW + x
    const int m3 = 16 * ((warp * PW) >> 2);
    const bool has3 = warp * PW < T3;
    auto c3 = [&](int x) { return 8 * ((warp * PW + x) & 3); };
    float s3[PW][4];
#pragma unroll
    for (int x = 0; x < PW; ++x)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s3[x][e] = has3 ? Sg[(size_t)(m3 + g + 8 * (e >> 1)) * dv + c3(x) + 2 * t + (e & 1)] : 0.f;
    auto store_s = [&](float* base, size_t stride) {  // the step-3 tiles into S at base, rows stride apart
        if (!has3) return;
#pragma unroll
        for (int x = 0; x < PW; ++x)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                *reinterpret_cast<float2*>(base + (m3 + g + 8 * hh) * stride + c3(x) + 2 * t) =
                    make_float2(s3[x][2 * hh], s3[x][2 * hh + 1]);
    };
    store_s(sS, SP);

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // sm_90+: one bulk copy per padded row, all completing on the stage's mbarrier, in place of ~3,600 16-byte
    // cp.async a chunk (perf-history.md v22: 39.7 -> 38.1 ms at the 35B's 8K chunk)
    __shared__ __align__(8) uint64_t bars[2];
    if (tid == 0) {
        mbar_init(smem_addr(bars), 1), mbar_init(smem_addr(bars + 1), 1);
        mbar_init_fence();
    }
    __syncthreads();
    auto issue = [&](int ci, float* st) {  // chunk ci's record rows and U rows into st; U rows past T: zeros
        const float* src = recs + (size_t)ci * nv * R::FLOATS;
        const uint32_t bar = smem_addr(bars + (STAGES == 2 ? (ci & 1) : 0));
        const int real = min(C, T - ci * C);
        if (tid == 0)
            mbar_expect_tx(bar, 4u * (DK * 2 * C + C * DK + C * C + 4 + real * DN_COLS));
        static_assert(DK + 3 * C + 1 <= kThreads, "one thread per row");
        if (tid < DK) {
            bulk_copy_g2s(smem_addr(st + G::WQ + tid * G::WQP), src + R::WQ + tid * 2 * C, 4 * 2 * C, bar);
        } else if (tid < DK + C) {
            const int r = tid - DK;
            bulk_copy_g2s(smem_addr(st + G::KD + r * G::KDP), src + R::KD + r * DK, 4 * DK, bar);
        } else if (tid < DK + 2 * C) {
            const int s2 = tid - DK - C;
            bulk_copy_g2s(smem_addr(st + G::QK + s2 * G::QKP), src + R::QKT + s2 * C, 4 * C, bar);
        } else if (tid < DK + 3 * C) {
            const int r = tid - DK - 2 * C;
            float* to = st + G::U + r * SP;
            if (r < real) bulk_copy_g2s(smem_addr(to), ug + (size_t)(ci * C + r) * conv_dim, 4 * DN_COLS, bar);
            else
                for (int j = 0; j < DN_COLS; j += 4)
                    *reinterpret_cast<float4*>(to + j) = make_float4(0.f, 0.f, 0.f, 0.f);
        } else if (tid == DK + 3 * C) {
            bulk_copy_g2s(smem_addr(st + G::EL), src + R::EL, 16, bar);
        }
    };
    auto wait_chunk = [&](int ci) {  // a barrier's k-th use waits for the phase of parity k & 1
        mbar_wait(smem_addr(bars + (STAGES == 2 ? (ci & 1) : 0)), (STAGES == 2 ? ci >> 1 : ci) & 1);
    };
#else
    auto issue = [&](int ci, float* st) {  // chunk ci's record (re-laid into padded rows) and U columns into st
        const float* src = recs + (size_t)ci * nv * R::FLOATS;
        constexpr int NWQ = DK * (2 * C / 4), NKD = C * (DK / 4), NQK = C * (C / 4), NU = C * (DN_COLS / 4);
        for (int idx = tid; idx < NWQ + NKD + NQK + 1 + NU; idx += kThreads) {
            const float* from;
            float* to;
            bool ok = true;
            if (idx < NWQ) {
                const int i = idx / (2 * C / 4), u = idx % (2 * C / 4);
                from = src + R::WQ + i * 2 * C + 4 * u, to = st + G::WQ + i * G::WQP + 4 * u;
            } else if (idx < NWQ + NKD) {
                const int j = idx - NWQ, r = j / (DK / 4), u = j % (DK / 4);
                from = src + R::KD + r * DK + 4 * u, to = st + G::KD + r * G::KDP + 4 * u;
            } else if (idx < NWQ + NKD + NQK) {
                const int j = idx - NWQ - NKD, s2 = j / (C / 4), u = j % (C / 4);
                from = src + R::QKT + s2 * C + 4 * u, to = st + G::QK + s2 * G::QKP + 4 * u;
            } else if (idx == NWQ + NKD + NQK) {
                from = src + R::EL, to = st + G::EL;
            } else {  // U rows past T: zeros
                const int j = idx - NWQ - NKD - NQK - 1, r = j / (DN_COLS / 4), q = 4 * (j % (DN_COLS / 4));
                ok = ci * C + r < T;
                from = ok ? ug + (size_t)(ci * C + r) * conv_dim + q : ug, to = st + G::U + r * SP + q;
            }
            cp_async16(smem_addr(to), from, ok);
        }
        cp_async_commit();
    };
    auto wait_chunk = [&](int) { cp_async_wait<0>(); };
#endif
    // chunk ci's record and U rows into L2 a chunk or two before their copy (perf-history.md v22: 38.1 -> 37.6 ms)
    auto prefetch = [&](int ci) {
        if (ci >= nchunks) return;
        const char* src = reinterpret_cast<const char*>(recs + (size_t)ci * nv * R::FLOATS);
        for (int off = 128 * tid; off < R::FLOATS * 4; off += 128 * kThreads) prefetch_l2(src + off);
        if (tid < C && ci * C + tid < T) prefetch_l2(ug + (size_t)(ci * C + tid) * conv_dim);
    };

    const int mt = warp >> 1, n1 = 16 * (warp & 1);  // step 1: rows 16·mt (W below C, QG from C), columns n1..
    if (STAGES == 2) issue(0, sm + G::FIXED);
    for (int ci = 0; ci < nchunks; ++ci) {
        float* st = sm + G::FIXED + (STAGES == 2 ? (ci & 1) * G::STAGE : 0);
        if (STAGES == 1) {
            __syncthreads();  // everyone is done with chunk ci−1's stage
            issue(ci, st);
        }
        wait_chunk(ci);
        __syncthreads();  // chunk ci has landed for everyone; S of chunk ci−1 is in sS; V' is free
        if (STAGES == 2 && ci + 1 < nchunks) issue(ci + 1, sm + G::FIXED + ((ci + 1) & 1) * G::STAGE);
        if (STAGES == 1) prefetch(ci + 1);
        prefetch(ci + 2);

        // 1. [W; QG] S for rows 16·mt .. + 15, columns n1 .. + 15 (two n-tiles)
        float acc[2][4] = {};
#pragma unroll 4
        for (int k0 = 0; k0 < DK; k0 += 8) {
            uint32_t ah[4], al[4];
            frag_a<G::WQP>(st + G::WQ + k0 * G::WQP + 16 * mt, g, t, ah, al);
#pragma unroll
            for (int nn = 0; nn < 2; ++nn) {
                uint32_t bh[2], bl[2];
                frag_b<SP>(sS + k0 * SP + n1 + 8 * nn, g, t, bh, bl);
                mma3(acc[nn], ah, al, bh, bl);
            }
        }
        if (mt < 2) {  // V' = U − W S
#pragma unroll
            for (int nn = 0; nn < 2; ++nn)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int r = 16 * mt + g + 8 * hh, j = n1 + 8 * nn + 2 * t;
                    const float2 u = *reinterpret_cast<const float2*>(st + G::U + r * SP + j);
                    *reinterpret_cast<float2*>(sV + r * SP + j) =
                        make_float2(u.x - acc[nn][2 * hh], u.y - acc[nn][2 * hh + 1]);
                }
        }
        __syncthreads();  // V' complete; every read of S for this chunk is done

        // 2. o = QG S + QK V' for rows 16(mt − 2) .. + 15 of the chunk (the QG warps)
        if (mt >= 2) {
            const int r0 = 16 * (mt - 2);
#pragma unroll
            for (int k0 = 0; k0 < C; k0 += 8) {
                uint32_t ah[4], al[4];
                frag_a<G::QKP>(st + G::QK + k0 * G::QKP + r0, g, t, ah, al);
#pragma unroll
                for (int nn = 0; nn < 2; ++nn) {
                    uint32_t bh[2], bl[2];
                    frag_b<SP>(sV + k0 * SP + n1 + 8 * nn, g, t, bh, bl);
                    mma3(acc[nn], ah, al, bh, bl);
                }
            }
            const int t0 = ci * C;
#pragma unroll
            for (int nn = 0; nn < 2; ++nn)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int r = r0 + g + 8 * hh;
                    if (t0 + r < T)
                        *reinterpret_cast<float2*>(o + (row0 + t0 + r) * nv * dv + (size_t)h * dv + col0 + n1 + 8 * nn +
                                                   2 * t) = make_float2(acc[nn][2 * hh], acc[nn][2 * hh + 1]);
                }
        }

        // 3. S ← e^{γ_L} S + KDᵀ V' on this warp's tiles, then into sS for the next chunk's step 1
        if (has3) {
            const float el = st[G::EL];
#pragma unroll
            for (int x = 0; x < PW; ++x)
#pragma unroll
                for (int e = 0; e < 4; ++e) s3[x][e] *= el;
#pragma unroll
            for (int k0 = 0; k0 < C; k0 += 8) {
                uint32_t ah[4], al[4];
                frag_a<G::KDP>(st + G::KD + k0 * G::KDP + m3, g, t, ah, al);
#pragma unroll
                for (int x = 0; x < PW; ++x) {
                    uint32_t bh[2], bl[2];
                    frag_b<SP>(sV + k0 * SP + c3(x), g, t, bh, bl);
                    mma3(s3[x], ah, al, bh, bl);
                }
            }
            store_s(sS, SP);
        }
    }
    store_s(Sg, dv);
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
