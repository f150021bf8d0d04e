// attention_prefill.cu: attn_prefill_{bf16,int8}_d{D}, the split-KV partials of gated full attention for one long
// sequence (a prompt chunk): attention.cu's attn_decode_* with q and the softmax weights p rounded to bf16 (one term,
// as flash-attention kernels do), which moves each output by <= 2^-8 of its Σ p|v|. Reference: ops.gated_attention
// (with attn_combine, which merges the partials and applies the gate).
//
// Layouts, scratch and the split rule are attention.cu's (its header). What differs is the tiling:
// grid (ceil(R / (16 W)), n_splits, B·nKV), block 32·W: warp w owns query rows 16 (W·x + w) .. + 15 (rows are
// (token, head-in-group) pairs r = t·G + j) and the W warps share each 16-key K/V tile of their split. An int8
// tile is copied raw and converted once to bf16 codes (exact: |code| <= 127) by the whole block; its scales stay
// outside the mma as in attn_decode_int8_*. Why: in decode's one-warp blocks every warp loaded and converted its
// own tiles, W times the copies and the conversion work per query row (perf-history.md v18). W = 8 for an int8
// cache (the conversion is per block), 4 for bf16 (whose two tile stages and 8 warps' q would not fit the ~99 KB of
// sm_86/89/120).
// Dynamic shared memory PrefillGeo<D, I8>::SMEM (attention.py _prefill_smem mirrors it).
#include "attention.cuh"

namespace {

template <int D, bool I8>
struct PrefillGeo {
    static constexpr int PF_WARPS = I8 ? 8 : 4;  // warps per block, 16 query rows each (attention.py _prefill_warps)
    using C = Geo<D, false>;  // fragments are read from bf16 tiles
    static constexpr int RB = 2 * D, TILE = 16 * RB;      // a bf16 K or V tile: 16 swizzled rows
    static constexpr int RAW = 16 * D;                     // a raw int8 tile: 16 plain rows
    static constexpr int STAGES = I8 ? 1 : 2;              // bf16: the next tile is copied while this one computes
    static constexpr int Q = 0;                            // q: [W][16][QSTRIDE] bf16
    static constexpr int KV = Q + PF_WARPS * 16 * C::QSTRIDE;  // STAGES × (K tile, V tile)
    static constexpr int RAWKV = KV + STAGES * 2 * TILE;        // int8: raw K, raw V
    static constexpr int SC = RAWKV + (I8 ? 2 * RAW : 0);       // int8: scales [K, V][16] of the tile in use, then raw
    static constexpr int SMEM = SC + (I8 ? 4 * 16 * 4 : 0);
};

template <int D, bool I8>
__device__ __forceinline__ void prefill_impl(const float* __restrict__ q, const unsigned char* __restrict__ kc,
                                             const unsigned char* __restrict__ vc, const float* __restrict__ ks,
                                             const float* __restrict__ vs, const int* __restrict__ pos,
                                             const int* __restrict__ slot, float* __restrict__ acc,
                                             float2* __restrict__ ml, int T, int nH, int nKV, int M, int slots,
                                             int max_ctx, int cs, int n_splits, float sc) {
    using PG = PrefillGeo<D, I8>;
    using C = typename PG::C;
    constexpr int PF_WARPS = PG::PF_WARPS, NT = 32 * PF_WARPS;
    constexpr int ES = I8 ? 1 : 2, CRB = D * ES;  // bytes of a cached element, of a cached row
    extern __shared__ __align__(16) unsigned char smem[];
    require_dynamic_smem(PG::SMEM);  // attention.py _prefill_smem mirrors PrefillGeo
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int sp = blockIdx.y, b = blockIdx.z / nKV, kvh = blockIdx.z - b * nKV;
    const int G = nH / nKV, R = T * G, rb0 = 16 * PF_WARPS * blockIdx.x, r0 = rb0 + 16 * warp;
    const int p0 = pos[b], sl = slot[b];
    if (sl < 0 || sl >= slots || p0 < 0 || rb0 >= R) return;  // block-uniform
    const int cap = min(max_ctx, n_splits * cs);
    const int t_hi = (min(R, rb0 + 16 * PF_WARPS) - 1) / G;  // the block's last token
    const int k_begin = sp * cs;
    const int k_end = min(k_begin + cs, min(p0 + t_hi + 1, cap));
    if (k_begin >= k_end) return;

    int lim[2];  // keys < lim[h] are visible to row g + 8h of this warp
    row_limits(r0, g, R, G, p0, cap, k_end, lim);

    const size_t row0 = (size_t)sl * max_ctx * nKV + kvh;
    unsigned char* q_s = smem + PG::Q + warp * 16 * C::QSTRIDE;
    unsigned char* raw = smem + PG::RAWKV;
    float* scl = reinterpret_cast<float*>(smem + PG::SC);  // [K, V][16] in use; int8: then [K, V][16] raw

    // 16 keys from kb: K and V rows (keys >= k_end zero-filled) into `dst` (bf16: swizzled tiles; int8: raw rows) and
    // the int8 scales; one commit group
    auto issue = [&](int kb, unsigned char* dst) {
        for (int ci = tid; ci < 2 * 16 * (CRB / 16); ci += NT) {
            const int kv = ci / (16 * (CRB / 16)), c2 = ci - kv * 16 * (CRB / 16), r = c2 / (CRB / 16);
            const int ch = c2 - r * (CRB / 16);
            const bool valid = kb + r < k_end;
            const size_t row = row0 + (size_t)(valid ? kb + r : k_begin) * nKV;
            const unsigned char* src = (kv ? vc : kc) + row * CRB + ch * 16;
            unsigned char* to = I8 ? dst + kv * PG::RAW + r * CRB + ch * 16
                                   : dst + kv * PG::TILE + tile_off<PG::RB>(r, ch * 16);
            cp_async16(smem_addr(to), src, valid);
        }
        if constexpr (I8) {
            if (tid < 32) {
                const int kv = tid >> 4, r = tid & 15;
                const bool valid = kb + r < k_end;
                const size_t row = row0 + (size_t)(valid ? kb + r : k_begin) * nKV;
                cp_async_small<4>(smem_addr(scl + 32 + tid), (kv ? vs : ks) + row, valid);
            }
        }
        cp_async_commit();
    };

    issue(k_begin, I8 ? raw : smem + PG::KV);

    // q of this warp's 16 rows (zeros past R) -> bf16 in shared memory, while the first tiles load
#pragma unroll 4
    for (int idx = lane; idx < 16 * (D / 4); idx += 32) {
        const int r = idx / (D / 4), c4 = idx - r * (D / 4), rr = r0 + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (rr < R) {
            const int tt = rr / G, j = rr - tt * G;
            x = *reinterpret_cast<const float4*>(q + ((size_t)(b * T + tt) * nH + kvh * G + j) * D + 4 * c4);
        }
        *reinterpret_cast<uint2*>(q_s + r * C::QSTRIDE + c4 * 8) =
            make_uint2(bf162_bits(__floats2bfloat162_rn(x.x, x.y)), bf162_bits(__floats2bfloat162_rn(x.z, x.w)));
    }

    // fragment runs as attention.cu's decode reads a bf16 tile: K row 4(g/2) + 2j + g%2, V rows 4t + i
    const int krow = 4 * (g >> 1) + (g & 1);
    int koff[2], voff[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        if constexpr (PG::RB >= 128) {
            koff[x] = krow * PG::RB + (((4 * x + t4) ^ (((g & 1) << 2) ^ (((g >> 1) & 3) << 1))) << 4);
            voff[x] = 4 * t4 * PG::RB + ((g ^ (x << 2) ^ (t4 << 1)) << 4);
        } else {
            koff[x] = krow * PG::RB + 4 * C::KS * t4 * 2;
            voff[x] = 4 * t4 * PG::RB + C::E * g * 2;
        }
    }
    auto k_run = [&](const unsigned char* k_s, int c, int j) {
        return PG::RB >= 128 ? k_s + koff[c & 1] + 2 * j * PG::RB + 128 * (c >> 1)
                             : k_s + koff[0] + 2 * j * PG::RB + 16 * C::KS * c * 2;
    };
    auto v_run = [&](const unsigned char* v_s, int a, int i) {
        return PG::RB >= 128 ? v_s + voff[i & 1] + i * PG::RB + 128 * a : v_s + voff[0] + i * PG::RB + 8 * C::E * a * 2;
    };

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {kMasked, kMasked}, l_run[2] = {0.f, 0.f};

    for (int kb = k_begin, step = 0; kb < k_end; kb += 16, ++step) {
        cp_async_wait<0>();
        __syncthreads();  // this step's copies have landed for everyone; every warp is done with the last step
        const unsigned char* k_s = smem + PG::KV + (I8 ? 0 : (step & 1) * 2 * PG::TILE);
        const unsigned char* v_s = k_s + PG::TILE;
        if constexpr (I8) {  // raw codes -> exact bf16 codes (8 per thread and chunk), scales -> the in-use slots
            for (int ci = tid; ci < 2 * 16 * (D / 8); ci += NT) {
                const int kv = ci / (16 * (D / 8)), c2 = ci - kv * 16 * (D / 8);
                const int r = c2 / (D / 8), ch = c2 - r * (D / 8);
                const uint2 u = *reinterpret_cast<const uint2*>(raw + kv * PG::RAW + r * D + 8 * ch);
                const uint32_t a = u.x ^ 0x80808080u, bb = u.y ^ 0x80808080u;
                *reinterpret_cast<uint4*>(smem + PG::KV + kv * PG::TILE + tile_off<PG::RB>(r, 16 * ch)) =
                    make_uint4(pack_exact(i8_at(a, 0), i8_at(a, 1)), pack_exact(i8_at(a, 2), i8_at(a, 3)),
                               pack_exact(i8_at(bb, 0), i8_at(bb, 1)), pack_exact(i8_at(bb, 2), i8_at(bb, 3)));
            }
            if (tid < 32) scl[tid] = scl[32 + tid];
            __syncthreads();  // bf16 tiles and scales ready; the raw buffers are free
        }
        if (kb + 16 < k_end) issue(kb + 16, I8 ? raw : smem + PG::KV + ((step + 1) & 1) * 2 * PG::TILE);

        // ---- S = q k^T: two partial sums per n-tile (k-step parity) to shorten the mma dependency chains
        float sacc[2][2][4];
#pragma unroll
        for (int x = 0; x < 2; ++x)
#pragma unroll
            for (int j = 0; j < 2; ++j) sacc[x][j][0] = sacc[x][j][1] = sacc[x][j][2] = sacc[x][j][3] = 0.f;
#pragma unroll
        for (int c = 0; c < C::NKG; ++c) {
            uint32_t kf[2][2 * C::KS];
#pragma unroll
            for (int j = 0; j < 2; ++j) lds<C::KRUN>(kf[j], k_run(k_s, c, j));
            uint32_t qa[2][2 * C::KS];
#pragma unroll
            for (int h = 0; h < 2; ++h)
                lds<16>(qa[h], q_s + (g + 8 * h) * C::QSTRIDE + (16 * C::KS * c + 4 * C::KS * t4) * 2);
#pragma unroll
            for (int s = 0; s < C::KS; ++s) {
                const uint32_t a[4] = {qa[0][2 * s], qa[1][2 * s], qa[0][2 * s + 1], qa[1][2 * s + 1]};
                mma_bf16(sacc[s & 1][0], a, kf[0][2 * s], kf[0][2 * s + 1]);
                mma_bf16(sacc[s & 1][1], a, kf[1][2 * s], kf[1][2 * s + 1]);
            }
        }
        // scores in log2 units; s[j][c] is row g + 8*(c/2), key kb + 4t + 2j + c%2
        float fac[4] = {sc, sc, sc, sc};
        if constexpr (I8) {
            const float4 f = *reinterpret_cast<const float4*>(scl + 4 * t4);
            fac[0] = f.x * sc, fac[1] = f.y * sc, fac[2] = f.z * sc, fac[3] = f.w * sc;
        }
        float s[2][4];
        step_scores(sacc, fac, kb, t4, lim, s);

        // ---- online softmax over the 16 keys
        step_softmax(s, m_run, l_run, o);

        // ---- o += p v, with p (times the value scale for int8) rounded to bf16
        if constexpr (I8) {
            const float4 f = *reinterpret_cast<const float4*>(scl + 16 + 4 * t4);
            const float vf[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[j][c] *= vf[2 * j + (c & 1)];
        }
        const uint32_t pa[4] = {bf162_bits(__floats2bfloat162_rn(s[0][0], s[0][1])),   // row g, keys 4t, 4t+1
                                bf162_bits(__floats2bfloat162_rn(s[0][2], s[0][3])),   // row g+8, keys 4t, 4t+1
                                bf162_bits(__floats2bfloat162_rn(s[1][0], s[1][1])),   // row g, keys 4t+2, 4t+3
                                bf162_bits(__floats2bfloat162_rn(s[1][2], s[1][3]))};  // row g+8, keys 4t+2, 4t+3
#pragma unroll
        for (int a = 0; a < C::NVG; ++a) {
            uint32_t vw[4][C::VRUN / 4];  // key rows 4t + i, dims 8E*a + E*g .. + E
#pragma unroll
            for (int i = 0; i < 4; ++i) lds<C::VRUN>(vw[i], v_run(v_s, a, i));
#pragma unroll
            for (int u = 0; u < C::E; ++u) {
                const int w = u >> 1;
                const uint32_t sel = (u & 1) ? 0x7632u : 0x5410u;
                mma_bf16(o[a * C::E + u], pa, __byte_perm(vw[0][w], vw[1][w], sel),
                         __byte_perm(vw[2][w], vw[3][w], sel));
            }
        }
    }

    store_partials<C, D>(o, m_run, l_run, r0, R, G, sp, M, b, T, nH, kvh, acc, ml);
}

}  // namespace

#define NINFER_PREFILL(D, KIND, I8)                                                                               \
    extern "C" __global__ void __launch_bounds__(32 * PrefillGeo<D, I8>::PF_WARPS) attn_prefill_##KIND##_d##D(  \
        const float* q, const unsigned char* kc, const unsigned char* vc, const float* ks, const float* vs,      \
        const int* pos, const int* slot, float* acc, float2* ml, int T, int nH, int nKV, int M, int slots,       \
        int max_ctx, int cs, int n_splits, float sc) {                                                            \
        ninfer_pdl_begin();                                                                                       \
        prefill_impl<D, I8>(q, kc, vc, ks, vs, pos, slot, acc, ml, T, nH, nKV, M, slots, max_ctx, cs, n_splits,   \
                            sc);                                                                                  \
    }
NINFER_PREFILL(32, bf16, false)
NINFER_PREFILL(64, bf16, false)
NINFER_PREFILL(128, bf16, false)
NINFER_PREFILL(256, bf16, false)
NINFER_PREFILL(32, int8, true)
NINFER_PREFILL(64, int8, true)
NINFER_PREFILL(128, int8, true)
NINFER_PREFILL(256, int8, true)
