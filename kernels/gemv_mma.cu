// gemv_mma.cu: the M = 1 decode GEMV on 8-bit integer tensor cores (gemv_q{4,5,6,8}_mma), for quantized weights
// with all of x̂ in one shared-memory slab (K <= 18688). Semantics as gemv.cu at M = 1: y = W x̂ with the fused
// RMSNorm and the store / add / SwiGLU epilogues; the same exact integer sums of weight codes and int16 x̂ codes
// as the dp2a kernels (reference: ops.act_codes16 for x̂, x̂ @ W.T), tested with them in tests/gpu/test_linear.py.
//
// Why: the dp2a kernels spend ~62 instructions per 512 bytes of weights (perf.md v14) and are bound by that
// stream; one mma.sync m16n8k32 consumes 512 weights. x̂'s int16 codes are split q = 256·hi + lo into two int8
// planes (xcodes.cuh store_split4), and the chunks go on the MMA's N axis:
//   * a row group is 32 rows, two m16 tiles (a SwiGLU group: 16 gate rows, then their 16 up rows, the
//     artifact's interleave) whose steps come one tile after the other; in a step lane (g, t) = (lane / 4,
//     lane % 4) loads units 4(sD + d) + t, d < D, of rows g and g + 8 of the tile, so the 4 lanes of a row read
//     64 contiguous bytes per load and 64·D per step. q4/q5/q6: unit = chunk; q8: half t % 2 of chunk
//     2(sD + d) + t / 2.
//   * A = the unit's codes as the fragment wants them (row g: a0, a2; row g + 8: a1, a3), k in any order; B has
//     a nonzero column only where lane t's chunk meets its own x̂: column 2c + s holds split s (lo, hi) of the
//     chunk in slot c (q4-6: c = t; q8: c = t / 2) at the k positions of the lanes holding that chunk. So
//     C[row][2c + s] is the chunk's dot product with split s, and lane (g, t) ends up holding its own chunk's
//     (lo, hi) sums for rows g and g + 8: Σ = 256·hi + lo (- 2^(b-1) Σq for the unsigned nibble codes), exact
//     in int32, then one conversion and the scale s_w · d_chunk in fp32, as the dp2a path.
// Work split, register ping-pong, PDL and the cut-group reduction as gemv_stream.cu. The host picks this kernel
// only for a 16-byte aligned x and norm weight (xvec).
#include "gemv.cuh"

namespace {

constexpr int kGroupRows = 32;  // rows per row group: two m16 tiles

// D (16×8 s32) += A (16×32 8-bit, row) · B (32×8 s8, col); A unsigned (nibble formats, u = q + 2^(b-1)) or not
template <bool UA>
__device__ __forceinline__ void mma_i8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
    if constexpr (UA)
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Units per lane and row in one step: 4 where a unit is 4-5 registers, 2 for q5/q6 (two rows, two steps in
// registers; the stream microbenchmark: 16 rows x 4 units reach 97% of the plain copy's bandwidth, 32 x 1 77%).
template <int BITS>
struct MmaDepth {
    static constexpr int value = (BITS == 5 || BITS == 6) ? 2 : 4;
};

// One step's loads of a lane: unit d of rows g (h = 0) and g + 8 (h = 1) of the step's m16 tile; sc is the scale
// of the chunk whose sums the lane keeps (q8: chunk 2(sD + d) + t, t < 2; nibble formats: the unit's own chunk).
template <int D>
struct MStep {
    Unit u[2][D];
};

template <int BITS>
__device__ __forceinline__ void gemv_mma_body(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                              const uint8_t* __restrict__ sc, const float* __restrict__ x,
                                              float* y, const float* __restrict__ norm_w,
                                              const float* __restrict__ row_scale, int N, int K, int kp,
                                              int gshift, int mode, float eps) {
    constexpr bool Q8 = BITS == 8;
    constexpr int D = MmaDepth<BITS>::value;
    constexpr int EU = Q8 ? 16 : 32;      // elements per 16-byte unit
    constexpr int EL = 4 * D * EU;        // elements of a row per step
    constexpr int NP = Q8 ? 2 : 4;        // MMAs per unit column (k = 32 each)
    constexpr int REC = qchunk_bytes(1);  // x̂ record bytes per chunk
    extern __shared__ float4 smem4[];
    __shared__ float ssred[kWarps][8];
    __shared__ float part[kWarps][2][kGroupRows];  // a warp's partial sums of its first / last group, when cut

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const bool swiglu = mode == 2;
    const int G = (N + kGroupRows - 1) / kGroupRows;
    const int g0 = (int)((long long)blockIdx.x * G / gridDim.x);
    const int g1 = (int)((long long)(blockIdx.x + 1) * G / gridDim.x);
    if (g0 >= g1) return;  // whole block: before any barrier
    const int nc = K / 32;                // x̂ chunks
    const int S = (K + EL - 1) / EL;      // steps per m16 tile; a row group is 2S steps, tile 0 then tile 1
    const int SG = 2 * S;
    const int L = (g1 - g0) * SG;         // steps of this block
    auto range_begin = [&](int w) { return (int)((long long)w * L / kWarps); };
    const int sb = range_begin(warp), se = range_begin(warp + 1);
    const int fg = sb / SG;
    const bool head_cut = sb != fg * SG;
    const unsigned nuq = Q8 ? kp / 16 : kp / 32;  // units per stored row (4DS <= nuq: Kp = round_up(K, 128))
    const int sshift = gshift - log2i(EU);
    const int4* q16 = reinterpret_cast<const int4*>(qs);
    const unsigned short* s16 = reinterpret_cast<const unsigned short*>(sc);
    const unsigned ts = Q8 ? 2u * (t & 1) : (unsigned)t;  // scale unit offset of this lane's kept chunk

    // Loads of step j of local row group gl: tile m = j / S, units 4(sD + d) + t of rows g, g + 8.
    auto issue = [&](MStep<D>& T, int gl, int j) {
        const int m = j >= S ? 1 : 0, s = j - m * S;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = min(kGroupRows * (g0 + gl) + 16 * m + 8 * h + g, N - 1);
            const unsigned base = (unsigned)row * nuq + 4u * (unsigned)(s * D);
#pragma unroll
            for (int d = 0; d < D; ++d) {
                Unit& w = T.u[h][d];
                const unsigned u = base + 4u * d + t;
                w.q = __ldg(q16 + u);
                w.h0 = w.h1 = 0;
                if constexpr (BITS == 5) w.h0 = __ldg(reinterpret_cast<const uint32_t*>(qh) + u);
                if constexpr (BITS == 6) {
                    const uint2 v = __ldg(reinterpret_cast<const uint2*>(qh) + u);
                    w.h0 = v.x, w.h1 = v.y;
                }
                w.sc = __ldg(s16 + ((base + 4u * d + ts) >> sshift));
            }
        }
    };
    auto advance = [&](int& gr, int& j) {
        if (++j == SG) j = 0, ++gr;
    };
    prefetch_l2_span(x, (size_t)K * 4, threadIdx.x, kWarps * 32);
    if (norm_w) prefetch_l2_span(norm_w, (size_t)K * 4, threadIdx.x, kWarps * 32);
    MStep<D> A, B;
    int ig = fg, ij = sb - fg * SG;
    auto issue_next = [&](MStep<D>& T) {
        issue(T, ig, ij);
        advance(ig, ij);
    };
    if (se - sb >= 1) issue_next(A);
    if (se - sb >= 2) issue_next(B);
    ninfer_pdl_begin();  // weights are never written by earlier kernels; x, row_scale and y are

    stage_m1_vec<Q8 ? 1 : 2, true>(smem4, x, norm_w, K, ssred);
    __syncthreads();
    float inv = 1.f;
    if (norm_w) {
        float tt = 0.f;
        for (int w = 0; w < kWarps; ++w) tt += ssred[w][0];
        inv = rsqrtf(tt / (float)K + eps);
    }
    const uint8_t* xb = reinterpret_cast<const uint8_t*>(smem4);

    // Row totals of group gr, every lane holding all four (tile m, row g + 8h): lane t writes (m, h) = (t / 2,
    // t % 2); SwiGLU lanes t < 2 write output 16 gr + 8t + g from gate (tile 0) and up (tile 1) of row g + 8t.
    auto write = [&](int gr, float v, float gate, float up) {
        if (!swiglu) {
            const int n = kGroupRows * gr + 8 * t + g;
            if (n < N) {
                float val = v * inv;
                if (row_scale) val *= __ldg(row_scale);
                y[n] = mode == 1 ? y[n] + val : val;
            }
        } else {
            const int j = 16 * gr + 8 * t + g;
            if (t < 2 && j < N / 2) y[j] = siluf_(gate * inv) * (up * inv);
        }
    };

    float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    int cg = fg, cj = sb - fg * SG, left = se - sb;
    int own = -1;

    auto consume = [&](const MStep<D>& T) {
        const bool last = cj == SG - 1 || left == 1;
        const bool starts_here = cg != fg || !head_cut;
        const bool whole = starts_here && cj == SG - 1;
        const int m = cj >= S ? 1 : 0, s = cj - m * S;
        float part_h[2] = {0.f, 0.f};  // this step's sums of rows g, g + 8 of tile m (this lane's chunks)
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int col = s * D + d;  // unit column: q4-6 chunks 4col + t, q8 chunks 2col, 2col + 1
            // B: lane (g, t) supplies column g; nonzero where column g's chunk slot is this lane's chunk
            const int cb = Q8 ? 2 * col + (t >> 1) : 4 * col + t;
            const bool bon = (Q8 ? g < 4 && (g >> 1) == (t >> 1) : (g >> 1) == t) && cb < nc;
            uint32_t b[NP][2];
            {
                uint4 v0 = make_uint4(0u, 0u, 0u, 0u), v1 = v0;
                const uint8_t* p = xb + cb * REC + 32 * (g & 1) + (Q8 ? 16 * (t & 1) : 0);
                if (bon) {
                    v0 = *reinterpret_cast<const uint4*>(p);
                    if constexpr (!Q8) v1 = *reinterpret_cast<const uint4*>(p + 16);
                }
                b[0][0] = v0.x, b[0][1] = v0.y, b[1][0] = v0.z, b[1][1] = v0.w;
                if constexpr (!Q8) b[2][0] = v1.x, b[2][1] = v1.y, b[3][0] = v1.z, b[3][1] = v1.w;
            }
            int c[4] = {0, 0, 0, 0};
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                uint32_t a0, a1, a2, a3;
                if constexpr (Q8) {  // words 2p, 2p + 1 of the unit: elements 8p .. 8p + 7 of its half chunk
                    a0 = word_of(T.u[0][d].q, 2 * p), a2 = word_of(T.u[0][d].q, 2 * p + 1);
                    a1 = word_of(T.u[1][d].q, 2 * p), a3 = word_of(T.u[1][d].q, 2 * p + 1);
                } else {  // elements 8p + {0, 2, 4, 6} and 8p + {1, 3, 5, 7} of the chunk (the x̂ nibble order)
                    nibble_words<BITS>(T.u[0][d], p, a0, a2);
                    nibble_words<BITS>(T.u[1][d], p, a1, a3);
                }
                mma_i8<!Q8>(c, a0, a1, a2, a3, b[p][0], b[p][1]);
            }
            // this lane's chunk: C columns 2t, 2t + 1 (q8: t < 2 only; columns 4..7 are empty)
            const int co = Q8 ? 2 * col + t : 4 * col + t;
            if ((!Q8 || t < 2) && co < nc) {
                const float2 meta = *reinterpret_cast<const float2*>(xb + co * REC + 64);  // (d, Σq as int bits)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int v = 256 * c[2 * h + 1] + c[2 * h];
                    if constexpr (!Q8) v -= (1 << (BITS - 1)) * __float_as_int(meta.y);
                    const float sw = __half2float(__ushort_as_half(T.u[h][d].sc));
                    part_h[h] = fmaf((float)v, sw * meta.x, part_h[h]);
                }
            }
        }
        if (m == 0) acc[0][0] += part_h[0], acc[0][1] += part_h[1];
        else acc[1][0] += part_h[0], acc[1][1] += part_h[1];
        if (last) {
#pragma unroll
            for (int mm = 0; mm < 2; ++mm)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    acc[mm][h] += __shfl_xor_sync(kFull, acc[mm][h], 1);
                    acc[mm][h] += __shfl_xor_sync(kFull, acc[mm][h], 2);
                }
            const float mine = t == 0 ? acc[0][0] : t == 1 ? acc[0][1] : t == 2 ? acc[1][0] : acc[1][1];
            if (whole) {
                write(g0 + cg, mine, t & 1 ? acc[0][1] : acc[0][0], t & 1 ? acc[1][1] : acc[1][0]);
            } else {
                part[warp][cg == fg ? 0 : 1][8 * t + g] = mine;  // row 16m + 8h + g of the group, t = 2m + h
                if (starts_here) own = cg;
            }
#pragma unroll
            for (int mm = 0; mm < 2; ++mm) acc[mm][0] = acc[mm][1] = 0.f;
        }
        advance(cg, cj);
        --left;
    };

    while (left > 0) {
        consume(A);
        if (left >= 2) issue_next(A);
        if (left <= 0) break;
        consume(B);
        if (left >= 2) issue_next(B);
    }

    __syncthreads();  // every warp's partials are in part
    if (own >= 0) {
        const int ge = (own + 1) * SG, slot = own == fg ? 0 : 1;
        float v = part[warp][slot][8 * t + g];
        float gate = part[warp][slot][8 * (t & 1) + g], up = part[warp][slot][16 + 8 * (t & 1) + g];
        for (int w = warp + 1; w < kWarps; ++w) {
            const int wb = range_begin(w);
            if (wb >= ge) break;
            if (wb == range_begin(w + 1)) continue;
            v += part[w][0][8 * t + g];
            gate += part[w][0][8 * (t & 1) + g];
            up += part[w][0][16 + 8 * (t & 1) + g];
        }
        write(g0 + own, v, gate, up);
    }
}

}  // namespace

// gemv_{q4,q5,q6,q8}_mma: the gemv kernels' arguments (ldx, ldy, kw_log2 and ks unused; xvec must be 1), then d
// (unused, 1). 2 blocks per SM.
#define NINFER_GEMV_MMA(name, BITS)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 2) gemv_##name##_mma(NINFER_GEMV_ARGS, int d) { \
        if (!xvec) __trap();                                                                         \
        gemv_mma_body<BITS>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift, mode, eps);       \
    }

NINFER_GEMV_MMA(q4, 4)
NINFER_GEMV_MMA(q5, 5)
NINFER_GEMV_MMA(q6, 6)
NINFER_GEMV_MMA(q8, 8)
