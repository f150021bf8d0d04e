// attention.cu: the split-KV part of Qwen3.5/3.6 gated full attention on tensor cores, from the prepared q rows
// and KV cache to the input of o_proj (ninfer_rt/reference/model.py GatedAttention.__call__ after the rotated q and
// cached k, v, up to `@ o_proj`). attn_prepare_d{D} (attention_prepare.cu) writes the q rows and cache entries.
//
// attn_decode_{bf16,int8}_d{D} + attn_combine: ops.gated_attention per sequence. Query t of sequence b attends to
//     cache positions 0 .. pos[b]+t of slot[b]; query head h reads kv head h / (nH/nKV); softmax in fp32 with scale
//     D^-0.5; out = o * sigmoid(gate). Split-KV: one warp per (16 query rows, key split, sequence, kv head), the rows
//     being (token, head-in-group) pairs r = t*G + j, so K/V are read once for all G heads and 16/G tokens; partial
//     (max, sum, unnormalised o) go to scratch and attn_combine merges them and applies the gate.
//     Tensor cores at fp32 accuracy: K/V are exact in bf16 (bf16 cache, or int8 codes with the scale applied
//     outside the mma), and q and p are split into three bf16 terms (hi + mid + lo carries 24 bits), so every
//     product is exact and only the fp32 accumulation rounds. For few query rows per kv head (decode, MTP verify)
//     ninfer_rt/gpu/attention.py takes attention_decode.cu's CUDA-core kernels instead (same scratch layout).
// attn_prefill_{bf16,int8}_d{D} (attention_prefill.cu): the same partials with q and p rounded to bf16, in blocks
//     of several warps that share each K/V tile.
//
// Layouts (row-major):
//   qkvg     fp32 [M, ld]: [q (nH*D) | k (nKV*D) | v (nKV*D) | gate (nH*D)]
//   q_out    fp32 [M, nH, D]; gate rows of stride ld_gate; out fp32 [M, nH*D]
//   cache    k, v [slots, max_ctx, nKV, D] bf16 bits or int8 codes; k_scale, v_scale fp32 [slots, max_ctx, nKV]
//   scratch  acc fp32 [n_splits, M, nH, D] (unnormalised o), ml float2 [n_splits, M, nH] (max in log2 units, sum)
// Split sp holds keys [sp*cs, sp*cs + cs). Row t of sequence b sees keys < n = min(pos[b]+t+1, max_ctx, n_splits*cs)
// (0 for a slot outside [0, slots) or pos < 0); the combine reads the splits sp < ceil(n / cs), exactly those that
// decode wrote for that row, so blocks beyond the real length exit at once.
#include "attention.cuh"  // kMasked, kFull, cp.async wrappers, i8_at, lds (and common.cuh)

namespace {

// ------------------------------------------------------------------------------------------------ device helpers

// (x0, x1) = hi + mid + lo, each a packed bf16 pair (x0 in the low half); the residual is ~2^-27 relative
__device__ __forceinline__ void split3(float x0, float x1, uint32_t& hi, uint32_t& mid, uint32_t& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    float r0 = x0 - __low2float(h), r1 = x1 - __high2float(h);
    const __nv_bfloat162 m = __floats2bfloat162_rn(r0, r1);
    r0 -= __low2float(m);
    r1 -= __high2float(m);
    hi = bf162_bits(h);
    mid = bf162_bits(m);
    lo = bf162_bits(__floats2bfloat162_rn(r0, r1));
}

// ------------------------------------------------------------------------------------------------ decode

template <int D, bool I8>
__device__ __forceinline__ void decode_impl(const float* __restrict__ q, const unsigned char* __restrict__ kc,
                                            const unsigned char* __restrict__ vc, const float* __restrict__ ks,
                                            const float* __restrict__ vs, const int* __restrict__ pos,
                                            const int* __restrict__ slot, float* __restrict__ acc,
                                            float2* __restrict__ ml, int T, int nH, int nKV, int M, int slots,
                                            int max_ctx, int cs, int n_splits, float sc) {
    using C = Geo<D, I8>;
    constexpr int TERMS = 3;  // q and p as hi + mid + lo bf16 terms
    __shared__ __align__(16) unsigned char q_s[TERMS * 16 * C::QSTRIDE];  // [term][row][QSTRIDE] bf16
    __shared__ __align__(16) unsigned char k_s[16 * C::RB];
    __shared__ __align__(16) unsigned char v_s[16 * C::RB];
    __shared__ __align__(16) float ksc_s[16], vsc_s[16];

    const int lane = threadIdx.x, g = lane >> 2, t4 = lane & 3;
    const int qt = blockIdx.x, sp = blockIdx.y, b = blockIdx.z / nKV, kvh = blockIdx.z - b * nKV;
    const int G = nH / nKV, R = T * G, r0 = 16 * qt;
    const int p0 = pos[b], sl = slot[b];
    if (sl < 0 || sl >= slots || p0 < 0) return;
    const int cap = min(max_ctx, n_splits * cs);
    const int t_hi = (min(R, r0 + 16) - 1) / G;
    const int k_begin = sp * cs;
    const int k_end = min(k_begin + cs, min(p0 + t_hi + 1, cap));
    if (k_begin >= k_end) return;  // beyond the real length (or the last token of this tile)

    int lim[2];  // keys < lim[h] are visible to row g + 8h of this warp
    row_limits(r0, g, R, G, p0, cap, k_end, lim);

    // cache rows of (slot, position p, kv head) sit at (sl*max_ctx + p)*nKV + kvh
    const size_t row0 = (size_t)sl * max_ctx * nKV + kvh;
    const unsigned char* kbase = kc + row0 * C::RB;
    const unsigned char* vbase = vc + row0 * C::RB;
    const float* ksbase = I8 ? ks + row0 : nullptr;
    const float* vsbase = I8 ? vs + row0 : nullptr;
    const size_t kstride = (size_t)nKV * C::RB;

    // 16 keys from kb into a tile (keys >= k_end zero-filled), scales into sc_s; the caller commits the group
    auto issue = [&](unsigned char* tile, float* sc_s, const unsigned char* base, const float* sbase, int kb) {
#pragma unroll 1  // a runtime loop: unrolled, its 16 invariant addresses would be hoisted into registers
        for (int i = 0; i < C::RB / 32; ++i) {
            const int ci = lane + 32 * i, r = ci / (C::RB / 16), ch = ci - r * (C::RB / 16);
            const bool valid = kb + r < k_end;
            const unsigned char* src = base + (size_t)(valid ? kb + r : k_begin) * kstride + ch * 16;
            cp_async16(smem_addr(tile + tile_off<C::RB>(r, ch * 16)), src, valid);
        }
        if constexpr (I8) {
            if (lane < 16) {
                const bool valid = kb + lane < k_end;
                cp_async_small<4>(smem_addr(sc_s + lane), sbase + (size_t)(valid ? kb + lane : k_begin) * nKV, valid);
            }
        }
    };

    // Fragment runs in the tiles, as tile_off would place them, written as base + constant so that the compiler
    // keeps two bases per tile instead of one register per (group, n-tile). K: row 4(g/2) + 2j + g%2, chunk 4c + t
    // (whose XOR with the row's swizzle splits into 8(c/2) + ((4(c%2) + t) ^ sw)); V: row 4t + i, chunk 8a + g.
    const int krow = 4 * (g >> 1) + (g & 1);
    const unsigned char* kr[2];
    const unsigned char* vr[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        if constexpr (C::RB >= 128) {
            kr[x] = k_s + krow * C::RB + (((4 * x + t4) ^ (((g & 1) << 2) ^ (((g >> 1) & 3) << 1))) << 4);
            vr[x] = v_s + 4 * t4 * C::RB + ((g ^ (x << 2) ^ (t4 << 1)) << 4);
        } else {
            kr[x] = k_s + krow * C::RB + 4 * C::KS * t4 * C::ES;
            vr[x] = v_s + 4 * t4 * C::RB + C::E * g * C::ES;
        }
    }
    auto k_run = [&](int c, int j) {
        return C::RB >= 128 ? kr[c & 1] + 2 * j * C::RB + 128 * (c >> 1)
                            : kr[0] + 2 * j * C::RB + 16 * C::KS * c * C::ES;
    };
    auto v_run = [&](int a, int i) {
        return C::RB >= 128 ? vr[i & 1] + i * C::RB + 128 * a : vr[0] + i * C::RB + 8 * C::E * a * C::ES;
    };

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {kMasked, kMasked}, l_run[2] = {0.f, 0.f};

    issue(k_s, ksc_s, kbase, ksbase, k_begin);
    cp_async_commit();
    issue(v_s, vsc_s, vbase, vsbase, k_begin);
    cp_async_commit();

    // q of the 16 rows (zeros past R) -> TERMS bf16 terms in shared memory, while the first tiles load
#pragma unroll 4
    for (int idx = lane; idx < 16 * (D / 4); idx += 32) {
        const int r = idx / (D / 4), c4 = idx - r * (D / 4), rr = r0 + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (rr < R) {
            const int tt = rr / G, j = rr - tt * G;
            x = *reinterpret_cast<const float4*>(q + ((size_t)(b * T + tt) * nH + kvh * G + j) * D + 4 * c4);
        }
        uint32_t h01, m01, l01, h23, m23, l23;
        split3(x.x, x.y, h01, m01, l01);
        split3(x.z, x.w, h23, m23, l23);
        unsigned char* dst = q_s + r * C::QSTRIDE + c4 * 8;
        *reinterpret_cast<uint2*>(dst) = make_uint2(h01, h23);
        *reinterpret_cast<uint2*>(dst + 16 * C::QSTRIDE) = make_uint2(m01, m23);
        *reinterpret_cast<uint2*>(dst + 32 * C::QSTRIDE) = make_uint2(l01, l23);
    }

    for (int kb = k_begin; kb < k_end; kb += 16) {
        cp_async_wait<1>();  // this step's K (its V may still be in flight)
        __syncwarp();        // ... and every lane's copies (and q_s) visible to the warp

        // ---- S = q k^T: two partial sums per n-tile (k-step parity) to shorten the mma dependency chains
        float sacc[2][2][4];
#pragma unroll
        for (int x = 0; x < 2; ++x)
#pragma unroll
            for (int j = 0; j < 2; ++j) sacc[x][j][0] = sacc[x][j][1] = sacc[x][j][2] = sacc[x][j][3] = 0.f;
#pragma unroll
        for (int c = 0; c < C::NKG; ++c) {
            uint32_t kf[2][2 * C::KS];  // B fragments: [n-tile][2s + reg]
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                uint32_t w[C::KRUN / 4];
                lds<C::KRUN>(w, k_run(c, j));
                if constexpr (I8) {
#pragma unroll
                    for (int s = 0; s < C::KS; ++s) {
                        const uint32_t u = w[s] ^ 0x80808080u;
                        kf[j][2 * s] = pack_exact(i8_at(u, 0), i8_at(u, 1));
                        kf[j][2 * s + 1] = pack_exact(i8_at(u, 2), i8_at(u, 3));
                    }
                } else {
#pragma unroll
                    for (int s = 0; s < 2 * C::KS; ++s) kf[j][s] = w[s];
                }
            }
#pragma unroll
            for (int term = 0; term < TERMS; ++term) {
                uint32_t qa[2][2 * C::KS];  // runs of rows g, g+8: word 2s -> reg0/1, word 2s+1 -> reg2/3
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned char* src =
                        q_s + (term * 16 + g + 8 * h) * C::QSTRIDE + (16 * C::KS * c + 4 * C::KS * t4) * 2;
                    lds<16>(qa[h], src);
                    if constexpr (C::KS == 4) lds<16>(qa[h] + 4, src + 16);
                }
#pragma unroll
                for (int s = 0; s < C::KS; ++s) {
                    const uint32_t a[4] = {qa[0][2 * s], qa[1][2 * s], qa[0][2 * s + 1], qa[1][2 * s + 1]};
                    mma_bf16(sacc[s & 1][0], a, kf[0][2 * s], kf[0][2 * s + 1]);
                    mma_bf16(sacc[s & 1][1], a, kf[1][2 * s], kf[1][2 * s + 1]);
                }
            }
        }
        // scores in log2 units; s[j][c] is row g + 8*(c/2), key kb + 4t + 2j + c%2
        float fac[4] = {sc, sc, sc, sc};
        if constexpr (I8) {
            const float4 f = *reinterpret_cast<const float4*>(ksc_s + 4 * t4);
            fac[0] = f.x * sc, fac[1] = f.y * sc, fac[2] = f.z * sc, fac[3] = f.w * sc;
        }
        float s[2][4];
        step_scores(sacc, fac, kb, t4, lim, s);
        __syncwarp();  // every lane is done with k_s / ksc_s
        if (kb + 16 < k_end) issue(k_s, ksc_s, kbase, ksbase, kb + 16);
        cp_async_commit();  // possibly empty: keeps one group per tile for the wait counts

        // ---- online softmax over the 16 keys
        step_softmax(s, m_run, l_run, o);

        cp_async_wait<1>();  // this step's V (the next K may still be in flight)
        __syncwarp();

        // ---- o += p v, with p (times the value scale for int8) split into TERMS bf16 terms
        if constexpr (I8) {
            const float4 f = *reinterpret_cast<const float4*>(vsc_s + 4 * t4);
            const float vf[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[j][c] *= vf[2 * j + (c & 1)];
        }
        uint32_t pa[3][4];
        split3(s[0][0], s[0][1], pa[0][0], pa[1][0], pa[2][0]);  // row g, keys 4t, 4t+1
        split3(s[0][2], s[0][3], pa[0][1], pa[1][1], pa[2][1]);  // row g+8, keys 4t, 4t+1
        split3(s[1][0], s[1][1], pa[0][2], pa[1][2], pa[2][2]);  // row g, keys 4t+2, 4t+3
        split3(s[1][2], s[1][3], pa[0][3], pa[1][3], pa[2][3]);  // row g+8, keys 4t+2, 4t+3
#pragma unroll
        for (int a = 0; a < C::NVG; ++a) {
            uint32_t vw[4][C::VRUN / 4];  // key rows 4t + i, dims 8E*a + E*g .. + E
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lds<C::VRUN>(vw[i], v_run(a, i));
                if constexpr (I8) {
#pragma unroll
                    for (int w = 0; w < C::VRUN / 4; ++w) vw[i][w] ^= 0x80808080u;
                }
            }
#pragma unroll
            for (int u = 0; u < C::E; ++u) {
                uint32_t b0, b1;
                if constexpr (I8) {
                    const int w = u >> 2, by = u & 3;
                    b0 = pack_exact(i8_at(vw[0][w], by), i8_at(vw[1][w], by));
                    b1 = pack_exact(i8_at(vw[2][w], by), i8_at(vw[3][w], by));
                } else {
                    const int w = u >> 1;
                    const uint32_t sel = (u & 1) ? 0x7632u : 0x5410u;
                    b0 = __byte_perm(vw[0][w], vw[1][w], sel);
                    b1 = __byte_perm(vw[2][w], vw[3][w], sel);
                }
#pragma unroll
                for (int term = 0; term < TERMS; ++term) mma_bf16(o[a * C::E + u], pa[term], b0, b1);
            }
        }
        __syncwarp();  // every lane is done with v_s / vsc_s
        if (kb + 16 < k_end) issue(v_s, vsc_s, vbase, vsbase, kb + 16);
        cp_async_commit();
    }
    cp_async_wait<0>();

    store_partials<C, D>(o, m_run, l_run, r0, R, G, sp, M, b, T, nH, kvh, acc, ml);
}

}  // namespace

// ------------------------------------------------------------------------------------------------ entry points

#define NINFER_DECODE(D, KIND, I8)                                                                                \
    extern "C" __global__ void __launch_bounds__(32) attn_decode_##KIND##_d##D(                                  \
        const float* q, const unsigned char* kc, const unsigned char* vc, const float* ks, const float* vs,      \
        const int* pos, const int* slot, float* acc, float2* ml, int T, int nH, int nKV, int M, int slots,       \
        int max_ctx, int cs, int n_splits, float sc) {                                                            \
        ninfer_pdl_begin();                                                                                       \
        decode_impl<D, I8>(q, kc, vc, ks, vs, pos, slot, acc, ml, T, nH, nKV, M, slots, max_ctx, cs, n_splits,    \
                           sc);                                                                                   \
    }
NINFER_DECODE(32, bf16, false)
NINFER_DECODE(64, bf16, false)
NINFER_DECODE(128, bf16, false)
NINFER_DECODE(256, bf16, false)
NINFER_DECODE(32, int8, true)
NINFER_DECODE(64, int8, true)
NINFER_DECODE(128, int8, true)
NINFER_DECODE(256, int8, true)

// grid (M, nH, Z), block 8*SJ (SJ = 4..32 split lanes): column blocks zb = z, z+Z, ... (32 columns each) of
// out[m, h*D + i] =
// (sum_sp acc_sp * w_sp) / (sum_sp l_sp * w_sp) * sigmoid(gate), w_sp = 2^(m_sp - max m), over the splits that
// row m's keys reach (see the header); no keys -> 0. Thread (j, c) sums float4 column c over splits j, j+SJ, ...
// so that hundreds of splits are read with many loads in flight.
extern "C" __global__ void __launch_bounds__(256)
    attn_combine(const float* __restrict__ acc, const float2* __restrict__ ml, const float* __restrict__ gate,
                 int ld_gate, const int* __restrict__ pos, const int* __restrict__ slot, float* __restrict__ out,
                 int T, int M, int nH, int D, int slots, int max_ctx, int cs, int n_splits) { ninfer_pdl_begin();
    __shared__ float red[32];
    __shared__ float4 part[256];
    __shared__ float lpart[32];
    const int m = blockIdx.x, h = blockIdx.y, b = m / T, t = m - b * T;
    const int c4 = threadIdx.x & 7, j = threadIdx.x >> 3, SJ = blockDim.x >> 3;
    const int p0 = pos[b], sl = slot[b];
    const int keys = (sl >= 0 && sl < slots && p0 >= 0) ? min(p0 + t + 1, min(max_ctx, n_splits * cs)) : 0;
    const int ns = (keys + cs - 1) / cs;
    const size_t row = (size_t)m * nH + h, per_split = (size_t)M * nH;
    // loads in batches of NB splits a thread, all issued before their use: one L2 round trip per batch, not per split
    constexpr int NB = 4;
    float mx = kMasked;
    for (int s0 = j; s0 < ns; s0 += NB * SJ) {
        float e[NB];
#pragma unroll
        for (int u = 0; u < NB; ++u) e[u] = s0 + u * SJ < ns ? ml[(s0 + u * SJ) * per_split + row].x : kMasked;
#pragma unroll
        for (int u = 0; u < NB; ++u) mx = fmaxf(mx, e[u]);
    }
    mx = block_max(mx, red);
    for (int zb = blockIdx.z; zb < D / 32; zb += gridDim.z) {
        const int col = 32 * zb + 4 * c4;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        float L = 0.f;
        for_each_split<NB>(acc, ml, per_split, row, D, col, j, SJ, ns, [&](float2 e, float4 a) {
            const float w = exp2f(e.x - mx);
            L += e.y * w;
            o.x += a.x * w, o.y += a.y * w, o.z += a.z * w, o.w += a.w * w;
        });
        part[threadIdx.x] = o;
        if (c4 == 0) lpart[j] = L;
        __syncthreads();
        if (threadIdx.x < 8) {
            float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
            float Ls = 0.f;
            for (int jj = 0; jj < SJ; ++jj) {
                const float4 a = part[8 * jj + c4];
                s.x += a.x, s.y += a.y, s.z += a.z, s.w += a.w;
                Ls += lpart[jj];
            }
            const float r[4] = {s.x, s.y, s.z, s.w};
            const float* g = gate + (size_t)m * ld_gate + (size_t)h * D + col;
            float* dst = out + row * D + col;
#pragma unroll
            for (int z = 0; z < 4; ++z) dst[z] = Ls > 0.f ? __fdiv_rn(r[z], Ls) * sigmoidf_(g[z]) : 0.f;
        }
        __syncthreads();  // part / lpart are rewritten by the next column block
    }
}
