// deltanet_chunked.cu: the gated delta rule over chunks of DN_CHUNK tokens (the prefill form), the
// deltanet_recurrent_dk* step of deltanet.cu for long T: same inputs, outputs and state update.
//
//   deltanet_chunked_dk{DK}   o = gated delta rule over T tokens             ops.gated_delta_rule_chunked
//   (dk = 16, 32, 64, 128)    (= ops.gated_delta_rule_recurrent up to fp32 rounding)
//
// Layouts as deltanet.cu: c fp32 [B·T, conv_dim] (the conv output: q | k | v), ba fp32 [B·T, 2·nv] ([b | a]),
// ssm_state fp32 [slots, nv, dk, dv] (S[h][i][j]), slot int32 [B], o fp32 [B·T, nv·dv].
//
// Per value head h and chunk of C tokens (rows r, s < C; rows past T are zeros, which leave S unchanged):
//   γ_r = Σ_{u≤r} g_u;  A_rs = β_r (k̂_r·k̂_s) e^{γ_r−γ_s} (s < r);  QK_rs = (q̂_r·k̂_s) e^{γ_r−γ_s} (s ≤ r)
//   W = (I + A)^-1 (β e^γ ⊙ k̂);  U = (I + A)^-1 (β ⊙ v);  V' = U − W S
//   o = (e^γ ⊙ q̂) S + QK V';  S ← e^{γ_L} S + (e^{γ_L−γ} ⊙ k̂)ᵀ V'          (γ_L = γ_{C−1})
// Why: the recurrent kernel steps token by token (a dependent chain per token); here a chunk's C tokens are
// dense products, and the only chain is C-long forward substitution inside the chunk.
//
// grid (dv / DN_COLS, nv, B), 256 threads: a block owns DN_COLS columns of one head's S (columns are independent
// in the delta rule) and walks the chunks in order; the column-free parts (A, QK, W) are recomputed by each of
// a head's dv / DN_COLS blocks. The next chunk's q, k, v and gates are loaded into registers while this one
// computes. Dynamic shared memory: ChunkSmem<DK>::FLOATS · 4 bytes (deltanet.py chunked_smem_bytes mirrors it).
#include "common.cuh"
#include "deltanet.cuh"

#define DN_CHUNK 32  // tokens per chunk: one warp's lanes in the γ scan; A and QK are [32][33]
#define DN_COLS 32   // columns of S per block: one per lane

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int C = DN_CHUNK, CP = C + 4, VP = DN_COLS + 1;  // A / QK rows of C + 4: float4-aligned

template <int DK>
struct ChunkSmem {
    static constexpr int P = DK + 4;  // q/k/w row stride: float4 rows that start in different bank quads
    static constexpr int Q = 0, K = Q + C * P, W = K + C * P, V = W + C * P;  // offsets in floats
    static constexpr int A = V + C * VP, QK = A + C * CP, S = QK + C * CP;
    static constexpr int GAM = S + DK * DN_COLS, BETA = GAM + C, EG = BETA + C, FL = EG + C, EL = FL + C;
    static constexpr int FLOATS = EL + 4;
};

template <int DK>
__device__ __forceinline__ void chunked_impl(const float* __restrict__ c, const float* __restrict__ ba,
                                             const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                             float* __restrict__ ssm_state, const int* __restrict__ slot,
                                             float* __restrict__ o, int T, int nk, int nv, int dv) {
    using L = ChunkSmem<DK>;
    constexpr int P = L::P;
    constexpr int QPT = C * DK / kThreads;       // q (and k) elements each thread stages per chunk
    constexpr int VPT = C * DN_COLS / kThreads;  // v elements each thread stages per chunk
    static_assert(QPT >= 1 && C * DK % kThreads == 0 && VPT == 4, "staging split");
    extern __shared__ __align__(16) float sm[];
    {
        uint32_t have;
        asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(have));
        if (have < (uint32_t)(L::FLOATS * 4)) __trap();  // deltanet.py and ChunkSmem disagree: fail loudly
    }
    float *sq = sm + L::Q, *sk = sm + L::K, *sw = sm + L::W, *sv = sm + L::V, *sA = sm + L::A, *sQK = sm + L::QK;
    float *sS = sm + L::S, *gam = sm + L::GAM, *beta = sm + L::BETA, *eg = sm + L::EG, *fL = sm + L::FL;
    float* eL = sm + L::EL;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (nv / nk);
    const int col0 = blockIdx.x * DN_COLS;
    const int conv_dim = 2 * nk * DK + nv * dv;
    const size_t row0 = (size_t)b * T;
    const float neg_A = -__expf(A_log[h]), dtb = dt_bias[h];
    const float q_scale = rsqrtf((float)DK);
    float* Sg = ssm_state + ((size_t)slot[b] * nv + h) * DK * dv + col0;
    for (int idx = tid; idx < DK * DN_COLS; idx += kThreads) sS[idx] = Sg[(size_t)(idx >> 5) * dv + (idx & 31)];

    // one chunk's raw inputs, as each thread stages them (rows past T read as 0)
    float rq[QPT], rk[QPT], rv[VPT], rb = 0.f, ra = 0.f;
    auto load = [&](int t0) {
        const int n = min(C, T - t0);
#pragma unroll
        for (int e = 0; e < QPT; ++e) {
            const int idx = tid + kThreads * e, r = idx / DK, i = idx % DK;
            const float* src = c + (row0 + t0 + r) * conv_dim + hk * DK + i;
            rq[e] = r < n ? src[0] : 0.f;
            rk[e] = r < n ? src[nk * DK] : 0.f;
        }
#pragma unroll
        for (int e = 0; e < VPT; ++e) {
            const int idx = tid + kThreads * e, r = idx >> 5, j = idx & 31;
            rv[e] = r < n ? c[(row0 + t0 + r) * conv_dim + 2 * nk * DK + (size_t)h * dv + col0 + j] : 0.f;
        }
        if (warp == 0 && lane < n) {
            rb = ba[(row0 + t0 + lane) * 2 * nv + h];
            ra = ba[(row0 + t0 + lane) * 2 * nv + nv + h];
        }
    };
    // store them; warp 0 turns the gates into β, γ (inclusive scan of g over the chunk's lanes) and the decays
    auto store = [&](int t0) {
        const int n = min(C, T - t0);
#pragma unroll
        for (int e = 0; e < QPT; ++e) {
            const int idx = tid + kThreads * e, r = idx / DK, i = idx % DK;
            sq[r * P + i] = rq[e];
            sk[r * P + i] = rk[e];
        }
#pragma unroll
        for (int e = 0; e < VPT; ++e) {
            const int idx = tid + kThreads * e;
            sv[(idx >> 5) * VP + (idx & 31)] = rv[e];
        }
        if (warp == 0) {
            const bool on = lane < n;
            float g = on ? neg_A * softplusf_(ra + dtb) : 0.f;
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
    };

    const int nchunks = (T + C - 1) / C;
    load(0);
    for (int ci = 0; ci < nchunks; ++ci) {
        const int t0 = ci * C, n = min(C, T - t0);
        store(t0);
        if (ci + 1 < nchunks) load(t0 + C);  // in flight while this chunk computes
        __syncthreads();

        // q̂ = q·rsqrt(Σq² + eps)·dk^-0.5, k̂ = k·rsqrt(Σk² + eps): one warp per vector, in place
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
        for (int idx = tid; idx < C * DN_COLS; idx += kThreads) sv[(idx >> 5) * VP + (idx & 31)] *= beta[idx >> 5];
        __syncthreads();

        // (I + A) X = rhs by forward substitution, one column per thread held in registers: W's DK, U's DN_COLS.
        // A's row is read 4 at a time (a broadcast float4) into 4 partial sums: 4x fewer loads, shorter chains.
        for (int col = tid; col < DK + DN_COLS; col += kThreads) {
            float* base = col < DK ? sw + col : sv + (col - DK);
            const int stride = col < DK ? P : VP;
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

        // W S and q̂ S in one pass over S (thread: rows warp + 8m, column lane); V' = U − W S in place on U
        float qs[4] = {0.f, 0.f, 0.f, 0.f};
        {
            float ws[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
            for (int i = 0; i < DK; i += 4) {
                const float s0 = sS[i * DN_COLS + lane], s1 = sS[(i + 1) * DN_COLS + lane];
                const float s2 = sS[(i + 2) * DN_COLS + lane], s3 = sS[(i + 3) * DN_COLS + lane];
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const float4 w = *reinterpret_cast<const float4*>(sw + (warp + 8 * m) * P + i);
                    const float4 q = *reinterpret_cast<const float4*>(sq + (warp + 8 * m) * P + i);
                    ws[m] += w.x * s0 + w.y * s1 + w.z * s2 + w.w * s3;
                    qs[m] += q.x * s0 + q.y * s1 + q.z * s2 + q.w * s3;
                }
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) sv[(warp + 8 * m) * VP + lane] -= ws[m];
        }
        __syncthreads();

        // o = e^γ (q̂ S) + QK V' (same thread split), written for the chunk's real rows
        {
            float qv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
            for (int s = 0; s < C; ++s) {
                const float vs = sv[s * VP + lane];
#pragma unroll
                for (int m = 0; m < 4; ++m) qv[m] = fmaf(sQK[(warp + 8 * m) * CP + s], vs, qv[m]);
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int r = warp + 8 * m;
                if (r < n) o[(row0 + t0 + r) * nv * dv + (size_t)h * dv + col0 + lane] = fmaf(eg[r], qs[m], qv[m]);
            }
        }
        __syncthreads();  // every read of S for this chunk is done

        // S ← e^{γ_L} S + (e^{γ_L−γ} ⊙ k̂)ᵀ V' (thread: rows i = RI·warp + m of column lane, so its k̂ values
        // of a row are contiguous: float4 broadcasts)
        {
            constexpr int RI = DK / kWarps;
            const int i0 = RI * warp;
            float s[RI];
            const float el = eL[0];
#pragma unroll
            for (int m = 0; m < RI; ++m) s[m] = el * sS[(i0 + m) * DN_COLS + lane];
#pragma unroll 4
            for (int r = 0; r < C; ++r) {
                const float vr = sv[r * VP + lane] * fL[r];
                const float* kr = sk + r * P + i0;
                if constexpr (RI % 4 == 0) {
#pragma unroll
                    for (int m = 0; m < RI; m += 4) {
                        const float4 kv = *reinterpret_cast<const float4*>(kr + m);
                        s[m] = fmaf(kv.x, vr, s[m]);
                        s[m + 1] = fmaf(kv.y, vr, s[m + 1]);
                        s[m + 2] = fmaf(kv.z, vr, s[m + 2]);
                        s[m + 3] = fmaf(kv.w, vr, s[m + 3]);
                    }
                } else {
#pragma unroll
                    for (int m = 0; m < RI; ++m) s[m] = fmaf(kr[m], vr, s[m]);
                }
            }
#pragma unroll
            for (int m = 0; m < RI; ++m) sS[(i0 + m) * DN_COLS + lane] = s[m];
        }
        __syncthreads();  // the next chunk's store overwrites q, k, v and the gates
    }
    for (int idx = tid; idx < DK * DN_COLS; idx += kThreads) Sg[(size_t)(idx >> 5) * dv + (idx & 31)] = sS[idx];
}

}  // namespace

#define DN_CHUNKED(DK)                                                                                          \
    extern "C" __global__ void __launch_bounds__(kThreads) deltanet_chunked_dk##DK(                           \
        const float* __restrict__ c, const float* __restrict__ ba, const float* __restrict__ A_log,            \
        const float* __restrict__ dt_bias, float* __restrict__ ssm_state, const int* __restrict__ slot,        \
        float* __restrict__ o, int T, int nk, int nv, int dv) {                                                \
        ninfer_pdl_begin();                                                                                     \
        chunked_impl<DK>(c, ba, A_log, dt_bias, ssm_state, slot, o, T, nk, nv, dv);                            \
    }
DN_CHUNKED(16)
DN_CHUNKED(32)
DN_CHUNKED(64)
DN_CHUNKED(128)
