// attention_prefill_wgmma.cu: attn_prefill_wgmma_int8_d{D} (D = 64, 128, 256; sm_90a only), the split-KV partials
// of gated full attention for one long sequence over an int8 KV cache, on Hopper's warpgroup MMA: what
// attn_prefill_int8_d{D} (attention_prefill.cu) computes, with the same arguments, grid rule per 128 rows and scratch
// layout; with one split and a gate it also does attn_combine's merge and gate (three more arguments: gate, ld_gate,
// out; gate = null: partials only). Reference: ops.gated_attention (with attn_combine where there are partials).
//
// Numerics as attention_prefill.cu: q and p · v_scale rounded to bf16 (one term), K/V codes exact in bf16, the key
// scale applied to the fp32 scores, fp32 sums; only the summation order differs.
//
// Method: block = 2 warpgroups (256 threads) = 128 query rows (r = t·G + j) of one kv head and split, sharing each
// 64-key step of K and V. Why: the mma.sync kernel reloads q and every K/V fragment from shared memory per 16 keys
// (bound by those loads and by two barriers per 16 keys); wgmma reads q and K straight from shared memory.
//   * q: bf16 [D/64 panels][128 rows][128 B], 128-byte swizzle (wgmma K-major, wgmma.cuh wg_desc).
//   * Per step: the raw int8 K and V rows (cp.async, two steps in flight, 16-byte units XOR-swizzled against bank
//     conflicts in the conversion) become bf16 K [D/64 panels][64 keys][128 B] (K-major B of S = q Kᵀ) and Vᵀ
//     [D rows][64 keys = 128 B] (K-major B of O += P V), both 128-byte swizzled; the V conversion overlaps the S
//     wgmmas. P stays in registers: S's accumulator fragment is the A fragment of P V.
// Dynamic shared memory WgGeo<D>::SMEM (attention.py _prefill_wgmma_smem mirrors it).
#include "attention.cuh"
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace {

constexpr int WA_THREADS = 256, WA_ROWS = 128, WA_KEYS = 64;

template <int D>
struct WgGeo {
    static constexpr int U = D / 16;                     // 16-byte units of a raw int8 row
    static constexpr int QP = WA_ROWS * 128;             // a q panel (64 dims of 128 rows)
    static constexpr int KP = WA_KEYS * 128;             // a K panel (64 dims of 64 keys)
    static constexpr int RAW = WA_KEYS * D;              // a raw int8 K or V tile
    static constexpr int Q = 0, K = Q + (D / 64) * QP, VT = K + (D / 64) * KP, RAWS = VT + D * 128;
    static constexpr int SCR = RAWS + 2 * 2 * RAW;       // raw scales [stage][K, V][64]
    static constexpr int SCU = SCR + 2 * 2 * WA_KEYS * 4;  // in-use scales: [K·sc, V][64]
    static constexpr int SMEM = 1024 + SCU + 2 * WA_KEYS * 4;  // + slack to align the base to 1024
};

// (wgmma_ss_n64: wgmma.cuh)
template <int D>
__device__ __forceinline__ void wg_prefill(const float* __restrict__ q, const unsigned char* __restrict__ kc,
                                           const unsigned char* __restrict__ vc, const float* __restrict__ ks,
                                           const float* __restrict__ vs, const int* __restrict__ pos,
                                           const int* __restrict__ slot, float* __restrict__ acc,
                                           float2* __restrict__ ml, int T, int nH, int nKV, int M, int slots,
                                           int max_ctx, int cs, int n_splits, float sc, const float* __restrict__ gate,
                                           int ld_gate, float* __restrict__ out) {
    using W = WgGeo<D>;
    constexpr int U = W::U;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    require_dynamic_smem(W::SMEM);
    const uint32_t a0 = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((a0 + 1023) & ~1023u) - a0);
    const uint32_t s0 = smem_addr(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wgi = warp >> 2, g = lane >> 2, t4 = lane & 3;
    const int sp = blockIdx.y, b = blockIdx.z / nKV, kvh = blockIdx.z - b * nKV;
    const int bx = gridDim.x - 1 - blockIdx.x;  // the longest (latest) row blocks first: a shorter tail
    const int G = nH / nKV, R = T * G, rb0 = WA_ROWS * bx, r0 = rb0 + 16 * warp;
    const int p0 = pos[b], sl = slot[b];
    if (rb0 >= R) return;  // block-uniform
    if (sl < 0 || sl >= slots || p0 < 0) {  // no keys: the merged rows are 0, as attn_combine writes them
        if (gate)
            for (int i = tid; i < min(WA_ROWS, R - rb0) * D; i += WA_THREADS) {
                const int rr = rb0 + i / D, tt = rr / G;
                out[((size_t)(b * T + tt) * nH + kvh * G + rr - tt * G) * D + i % D] = 0.f;
            }
        return;
    }
    const int cap = min(max_ctx, n_splits * cs);
    const int t_hi = (min(R, rb0 + WA_ROWS) - 1) / G;
    const int k_begin = sp * cs, k_end = min(k_begin + cs, min(p0 + t_hi + 1, cap));
    if (k_begin >= k_end) return;

    int lim[2];  // keys < lim[h] are visible to row g + 8h of this warp
    row_limits(r0, g, R, G, p0, cap, k_end, lim);
    const size_t row0 = (size_t)sl * max_ctx * nKV + kvh;
    unsigned char* raw = smem + W::RAWS;
    float* scr = reinterpret_cast<float*>(smem + W::SCR);  // [stage][K, V][64]
    float* scu = reinterpret_cast<float*>(smem + W::SCU);  // [K·sc, V][64]

    // the raw K and V rows and scales of the 64 keys from kb into stage st (keys >= k_end zero-filled); one group
    auto issue = [&](int kb, int st) {
        if (kb < k_end) {
#pragma unroll
            for (int i = 0; i < 2 * WA_KEYS * U / WA_THREADS; ++i) {
                const int it = tid + WA_THREADS * i, kv = it / (WA_KEYS * U), rem = it - kv * WA_KEYS * U;
                const int k = rem / U, u = rem - k * U;
                const bool valid = kb + k < k_end;
                const size_t row = row0 + (size_t)(valid ? kb + k : k_begin) * nKV;
                const int su = u ^ ((kv ? k >> 1 : k) & (U - 1));  // V pairs rows 2p, 2p + 1 in the conversion
                cp_async16(smem_addr(raw + (st * 2 + kv) * W::RAW + k * D + 16 * su), (kv ? vc : kc) + row * D + 16 * u,
                           valid);
            }
            if (tid < 2 * WA_KEYS) {
                const int kv = tid / WA_KEYS, k = tid - kv * WA_KEYS;
                const bool valid = kb + k < k_end;
                const size_t row = row0 + (size_t)(valid ? kb + k : k_begin) * nKV;
                cp_async_small<4>(smem_addr(scr + (st * 2 + kv) * WA_KEYS + k), (kv ? vs : ks) + row, valid);
            }
        }
        cp_async_commit();
    };
    issue(k_begin, 0);
    issue(k_begin + WA_KEYS, 1);

    // q of the block's 128 rows (zeros past R) -> bf16, swizzled panels, while the first tiles load
    for (int it = tid; it < WA_ROWS * (D / 8); it += WA_THREADS) {
        const int r = it / (D / 8), v = it - r * (D / 8), rr = rb0 + r;
        float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
        if (rr < R) {
            const int tt = rr / G, j = rr - tt * G;
            const float* src = q + ((size_t)(b * T + tt) * nH + kvh * G + j) * D + 8 * v;
            x0 = *reinterpret_cast<const float4*>(src), x1 = *reinterpret_cast<const float4*>(src + 4);
        }
        *reinterpret_cast<uint4*>(smem + W::Q + (v >> 3) * W::QP + wg_x_offset(r, v & 7)) =
            make_uint4(pack_bf2(x0.x, x0.y), pack_bf2(x0.z, x0.w), pack_bf2(x1.x, x1.y), pack_bf2(x1.z, x1.w));
    }

    float o[D / 2];  // O fragment: o[64q + 4j + c] = (row g + 8(c >> 1), dim 128q + 8j + 2t + (c & 1))
#pragma unroll
    for (int n = 0; n < D / 2; ++n) o[n] = 0.f;
    float m_run[2] = {kMasked, kMasked}, l_run[2] = {0.f, 0.f};

    for (int kb = k_begin, step = 0; kb < k_end; kb += WA_KEYS, ++step) {
        const int st = step & 1;
        const unsigned char* rk = raw + (st * 2) * W::RAW;
        const unsigned char* rv = rk + W::RAW;
        cp_async_wait<1>();
        __syncthreads();  // this step's raw rows have landed for everyone; every warpgroup's last P·V is done
        // ---- K codes -> bf16 K panels (unit (key k, 16 dims u) per item), key scales · sc -> in use
#pragma unroll
        for (int i = 0; i < WA_KEYS * U / WA_THREADS; ++i) {
            const int it = tid + WA_THREADS * i, u = it / WA_KEYS, k = it - u * WA_KEYS;
            const uint4 c = *reinterpret_cast<const uint4*>(rk + k * D + 16 * (u ^ (k & (U - 1))));
            const uint32_t w[4] = {c.x ^ 0x80808080u, c.y ^ 0x80808080u, c.z ^ 0x80808080u, c.w ^ 0x80808080u};
            unsigned char* dst = smem + W::K + (u >> 2) * W::KP;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                *reinterpret_cast<uint4*>(dst + wg_x_offset(k, 2 * (u & 3) + hh)) =
                    make_uint4(pack_exact(i8_at(w[2 * hh], 0), i8_at(w[2 * hh], 1)),
                               pack_exact(i8_at(w[2 * hh], 2), i8_at(w[2 * hh], 3)),
                               pack_exact(i8_at(w[2 * hh + 1], 0), i8_at(w[2 * hh + 1], 1)),
                               pack_exact(i8_at(w[2 * hh + 1], 2), i8_at(w[2 * hh + 1], 3)));
        }
        if (tid < 2 * WA_KEYS) {
            const float v = scr[st * 2 * WA_KEYS + tid];
            scu[tid] = tid < WA_KEYS ? v * sc : v;
        }
        fence_proxy_async();
        __syncthreads();  // bf16 K visible to wgmma, scales to everyone

        // ---- S = q Kᵀ (async), while the V codes become Vᵀ
        float s[32];
#pragma unroll
        for (int n = 0; n < 32; ++n) s[n] = 0.f;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss_n64(s, wg_desc(s0 + W::Q + (kk >> 2) * W::QP + wgi * 64 * 128, kk & 3),
                         wg_desc(s0 + W::K + (kk >> 2) * W::KP, kk & 3));
        wg_commit();
        constexpr int NV = WA_KEYS / 2 * U;  // items: keys 2p, 2p + 1 × 16 dims u (128 at D = 64: half the threads)
#pragma unroll
        for (int i = 0; i < (NV + WA_THREADS - 1) / WA_THREADS; ++i) {
            const int it = tid + WA_THREADS * i, u = it / (WA_KEYS / 2), p = it - u * (WA_KEYS / 2);
            if (it >= NV) break;
            const int su = 16 * (u ^ (p & (U - 1)));
            const uint4 c0 = *reinterpret_cast<const uint4*>(rv + 2 * p * D + su);
            const uint4 c1 = *reinterpret_cast<const uint4*>(rv + (2 * p + 1) * D + su);
            const uint32_t x0[4] = {c0.x ^ 0x80808080u, c0.y ^ 0x80808080u, c0.z ^ 0x80808080u, c0.w ^ 0x80808080u};
            const uint32_t x1[4] = {c1.x ^ 0x80808080u, c1.y ^ 0x80808080u, c1.z ^ 0x80808080u, c1.w ^ 0x80808080u};
#pragma unroll
            for (int e = 0; e < 16; ++e) {  // Vᵀ row d = 16u + e, keys 2p, 2p + 1: one word
                const int d = 16 * u + e;
                *reinterpret_cast<uint32_t*>(smem + W::VT + d * 128 + (((p >> 2) ^ (d & 7)) << 4) + 4 * (p & 3)) =
                    pack_exact(i8_at(x0[e >> 2], e & 3), i8_at(x1[e >> 2], e & 3));
            }
        }
        fence_proxy_async();
        wg_wait<0>();
        wg_pin(s, 32);

        // ---- scores (log2 units), mask, online softmax; s[4j + c]: row g + 8(c >> 1), key kb + 8j + 2t + (c & 1)
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = kMasked;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float2 f = *reinterpret_cast<const float2*>(scu + 8 * j + 2 * t4);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = kb + 8 * j + 2 * t4 + e;
                    const float v = s[4 * j + 2 * h + e] * (e ? f.y : f.x);
                    s[4 * j + 2 * h + e] = key < lim[h] ? v : kMasked;
                    mx = fmaxf(mx, s[4 * j + 2 * h + e]);
                }
            }
            const float base = online_base(mx, m_run[h], alpha[h]);
            float ps = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pe = exp2f(s[4 * j + 2 * h + e] - base);
                    s[4 * j + 2 * h + e] = pe;
                    ps += pe;
                }
            l_run[h] = l_run[h] * alpha[h] + ps;  // lane-partial sum, reduced over the quad at the end
        }
        if (__any_sync(kFull, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int n = 0; n < D / 2; n += 4) o[n] *= alpha[0], o[n + 1] *= alpha[0], o[n + 2] *= alpha[1],
                                                  o[n + 3] *= alpha[1];
        }
        // P · v_scale in bf16 as the A fragments of the four 16-key slices: slice h = S n-tiles 2h, 2h + 1
        uint32_t pa[4][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 f = *reinterpret_cast<const float2*>(scu + WA_KEYS + 8 * j + 2 * t4);
            pa[j >> 1][2 * (j & 1)] = pack_bf2(s[4 * j] * f.x, s[4 * j + 1] * f.y);
            pa[j >> 1][2 * (j & 1) + 1] = pack_bf2(s[4 * j + 2] * f.x, s[4 * j + 3] * f.y);
        }
        __syncthreads();  // Vᵀ complete (every thread fenced it); the raw stage is free

        issue(kb + 2 * WA_KEYS, st);  // an empty group past k_end: one group per step for the wait count

        // ---- O += P Vᵀᵀ
        wg_fence();
        const uint32_t vt = s0 + W::VT;
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            if constexpr (D == 64) {
                wgmma_n64(o, pa[h], wg_desc(vt, h));
            } else {
#pragma unroll
                for (int qh = 0; qh < D / 128; ++qh) wgmma_n128(o + 64 * qh, pa[h], wg_desc(vt + qh * 128 * 128, h));
            }
        }
        wg_commit();
        wg_wait<0>();
        wg_pin(o, D / 2);
    }
    cp_async_wait<0>();

    // ---- unnormalised o into acc and (max, sum) into ml (attention.cu's scratch layout); or with one split (gate
    // given) what attn_combine would make of them, bit for bit: out = RN(o / l) · sigmoid(gate), 0 where l = 0
    quad_total(l_run);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rr = r0 + g + 8 * h;
        if (rr >= R) continue;
        int tt, j;
        const size_t idx = partial_row(rr, G, sp, M, b, T, nH, kvh, tt, j);
        const float* gr = gate ? gate + (size_t)(b * T + tt) * ld_gate + (size_t)(kvh * G + j) * D : nullptr;
        float* dst = gate ? out + idx * D : acc + idx * D;  // idx = the output row when sp = 0
#pragma unroll
        for (int n = 0; n < D / 2; n += 4) {
            const int dim = 128 * (n >> 6) + 2 * (n & 63) + 2 * t4;  // n = 64q + 4j: dim 128q + 8j + 2t
            float2 v = make_float2(o[n + 2 * h], o[n + 2 * h + 1]);
            if (gate) {
                const float2 gv = *reinterpret_cast<const float2*>(gr + dim);
                const float L = l_run[h];
                v = make_float2(L > 0.f ? __fdiv_rn(v.x, L) * sigmoidf_(gv.x) : 0.f,
                                L > 0.f ? __fdiv_rn(v.y, L) * sigmoidf_(gv.y) : 0.f);
            }
            *reinterpret_cast<float2*>(dst + dim) = v;
        }
        if (!gate && t4 == 0) ml[idx] = make_float2(m_run[h], l_run[h]);
    }
}

}  // namespace

#define NINFER_PREFILL_WG(D)                                                                                       \
    extern "C" __global__ void __launch_bounds__(WA_THREADS, 1) attn_prefill_wgmma_int8_d##D(                      \
        const float* q, const unsigned char* kc, const unsigned char* vc, const float* ks, const float* vs,       \
        const int* pos, const int* slot, float* acc, float2* ml, int T, int nH, int nKV, int M, int slots,        \
        int max_ctx, int cs, int n_splits, float sc, const float* gate, int ld_gate, float* out) {                 \
        ninfer_pdl_begin();                                                                                        \
        wg_prefill<D>(q, kc, vc, ks, vs, pos, slot, acc, ml, T, nH, nKV, M, slots, max_ctx, cs, n_splits, sc, gate, \
                      ld_gate, out);                                                                               \
    }
NINFER_PREFILL_WG(64)
NINFER_PREFILL_WG(128)
NINFER_PREFILL_WG(256)
#endif
