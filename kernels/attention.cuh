// attention.cuh: device helpers shared by the attention kernels (attention_prepare.cu; attention.cu: the mma decode
// and its combine; attention_prefill.cu: the mma prefill; attention_decode.cu: the CUDA-core decode for few query
// rows, attention_combine.cu its combine): the mma fragment geometry and the K/V tile swizzle among them. No op
// lives here.
#pragma once
#include "common.cuh"

namespace {

constexpr float kMasked = -1e30f;          // score of a masked key (finite: no inf arithmetic under fast math)
constexpr unsigned kFull = 0xffffffffu;

// Byte i of u (= 4 int8 codes ^ 0x80808080) as an exact float: the bits 0x4B0000uu are 2^23 + code + 128.
__device__ __forceinline__ float i8_at(uint32_t u, int i) {
    return __uint_as_float(__byte_perm(0x4B000000u, u, 0x3004u + i)) - 8388736.f;
}

// Keys per split for a sequence whose last token sees n keys: the launch's cs, or with a runtime split (rt != 0)
// n dealt evenly over the n_splits splits in whole 32-key steps, never fewer than cs, so whatever the context
// within its graph's bucket, every split is busy and equally long. The decode and its combine both call this.
__device__ __forceinline__ int split_keys(int cs, int n_splits, int n, int rt) {
    if (!rt) return cs;
    const int even = (n + n_splits - 1) / n_splits;
    return max(cs, (even + 31) & ~31);
}

template <int BYTES>
__device__ __forceinline__ void lds(uint32_t* w, const unsigned char* p) {
    if constexpr (BYTES == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (BYTES == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x, w[1] = v.y;
    } else {
        static_assert(BYTES == 4, "runs are 4, 8 or 16 bytes");
        w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
}

// ------------------------------------------------------------------------------------------------ mma helpers

// D += A(16x16, row) * B(16x8, col), bf16 in, fp32 accumulate
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bf162_bits(__nv_bfloat162 v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

// Two floats exactly representable in bf16 (small integers) -> packed bf16x2, lo in the low half.
__device__ __forceinline__ uint32_t pack_exact(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632u);
}

// Fragment geometry (lane = 4g + t). mma m16n8k16: A reg0 = (row g, k 2t..2t+1), reg1 = (row g+8, same k),
// reg2 = (row g, k 2t+8..2t+9), reg3 = (row g+8, k 2t+8..); B reg0 = (k 2t..2t+1, col g), reg1 = (k 2t+8.., col g);
// C c0,c1 = (row g, col 2t, 2t+1), c2,c3 = (row g+8, same cols).
// QK^T: k indices are permuted so each lane reads one contiguous run: in K group c (16*KS dims), k-step s, the
//   lane's k slots {2t, 2t+1, 2t+8, 2t+9} are dims 16*KS*c + 4*KS*t + 4s + {0,1,2,3}, for q and k alike.
//   n-tile j of a 16-key step holds keys sigma(j, n) = 4*(n/2) + 2j + n%2, so lane t's scores are keys 4t..4t+3.
// PV: k slot {2t, 2t+1, 2t+8, 2t+9} = keys 4t + {0,1,2,3}, which makes P's A fragment the scores' C fragments;
//   in V group a (8E dims) n-tile u, column n is dim 8E*a + E*n + u, so lane g reads one run of E dims per key row.
template <int D, bool I8>
struct Geo {
    static constexpr int ES = I8 ? 1 : 2;                                 // bytes per cached element
    static constexpr int RB = D * ES;                                     // bytes per cached row (key, kv head)
    static constexpr int KS = I8 ? (D / 16 < 4 ? D / 16 : 4) : 2;         // k-steps per K run
    static constexpr int KRUN = 4 * KS * ES;                              // bytes of a lane's K run
    static constexpr int NKG = D / (16 * KS);                             // K groups
    static constexpr int E = I8 ? (D / 8 < 16 ? D / 8 : 16) : (D / 8 < 8 ? D / 8 : 8);  // V dims per run
    static constexpr int VRUN = E * ES;
    static constexpr int NVG = D / (8 * E);                               // V groups
    static constexpr int QSTRIDE = 2 * D + (KS == 4 ? 16 : 64);           // padded bf16 q row: conflict-free runs
    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim");
};

// Offset of byte `byte` of row `row` in a 16-row K/V tile. Rows of >= 128 bytes are XOR-swizzled in 16-byte chunks
// so that both the K reads (rows r, r^1 together) and the V reads (rows 4t+i for t = 0..3) are bank-conflict free.
template <int RB>
__device__ __forceinline__ int tile_off(int row, int byte) {
    if constexpr (RB >= 128) {
        const int sw = ((row & 1) << 2) ^ (((row >> 2) & 3) << 1);
        return row * RB + ((((byte >> 4) ^ sw) << 4) | (byte & 15));
    } else {
        return row * RB + byte;
    }
}

// The causal limits of a warp's two fragment rows r0 + g, r0 + g + 8 (query rows r = t·G + j of a sequence whose
// first new token sits at p0): keys < lim[h] are visible to row g + 8h, 0 for a row past R.
__device__ __forceinline__ void row_limits(int r0, int g, int R, int G, int p0, int cap, int k_end, int (&lim)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rr = r0 + g + 8 * h;
        lim[h] = rr < R ? min(min(p0 + rr / G + 1, cap), k_end) : 0;
    }
}

// ------------------------------------------------------------------------------------------------ one 16-key step
// (attention.cu's decode and attention_prefill.cu share these; a warp's tile is 16 query rows: rows g, g+8 of the
// mma fragments, lane = 4g + t)

// Scores of a 16-key step in log2 units from the two k-step-parity partial sums: s[j][c] is row g + 8(c/2), key
// kb + 4t + 2j + c%2, times fac[2j + c%2] (sc, or sc × the int8 key scale); keys at or past lim[row] are masked.
__device__ __forceinline__ void step_scores(const float (&sacc)[2][2][4], const float (&fac)[4], int kb, int t4,
                                            const int (&lim)[2], float (&s)[2][4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int kk = 2 * j + (c & 1);
            const float v = (sacc[0][j][c] + sacc[1][j][c]) * fac[kk];
            s[j][c] = kb + 4 * t4 + kk < lim[c >> 1] ? v : kMasked;
        }
}

// One row's running max m_run advanced by a step whose scores have the lane maximum mx (the row sits in the 4 lanes
// of a quad): returns the exponent base of the step's p = 2^(s - base), and alpha, the factor for the sums so far.
__device__ __forceinline__ float online_base(float mx, float& m_run, float& alpha) {
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
    const float m_new = fmaxf(m_run, mx);
    const float base = m_new == kMasked ? 0.f : m_new;  // a row with nothing visible yet keeps p = 0
    alpha = m_new == m_run ? 1.f : exp2f(m_run - base);   // unmoved max (or still nothing visible): no rescale
    m_run = m_new;
    return base;
}

// Online softmax over a step's 16 keys (a row's scores sit in the 4 lanes of its quad): s becomes p = 2^(s - m),
// the running max m_run and lane-partial sum l_run advance, and o is rescaled where the max moved.
template <int NO>
__device__ __forceinline__ void step_softmax(float (&s)[2][4], float (&m_run)[2], float (&l_run)[2],
                                             float (&o)[NO][4]) {
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
        const float base = online_base(mx, m_run[h], alpha[h]);
        float ps = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float pe = exp2f(s[j][2 * h + e] - base);
                s[j][2 * h + e] = pe;
                ps += pe;
            }
        l_run[h] = l_run[h] * alpha[h] + ps;  // lane-partial sum, reduced over the quad at the end
    }
    if (__any_sync(kFull, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            o[n][0] *= alpha[0], o[n][1] *= alpha[0];
            o[n][2] *= alpha[1], o[n][3] *= alpha[1];
        }
    }
}

// The lane-partial softmax sums of rows g and g + 8 summed over their quad (every lane gets the row total).
__device__ __forceinline__ void quad_total(float (&l_run)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(kFull, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(kFull, l_run[h], 2);
    }
}

// Block row rr (< R; G query heads per token) of kv head kvh, split sp: its row in the partials (acc [., D],
// ml) of attention.cu's scratch layout, also the output row when sp = 0; tt its token, j its head in the group.
__device__ __forceinline__ size_t partial_row(int rr, int G, int sp, int M, int b, int T, int nH, int kvh, int& tt,
                                              int& j) {
    tt = rr / G, j = rr - tt * G;
    return ((size_t)sp * M + (size_t)b * T + tt) * nH + kvh * G + j;
}

// The split's partials of the warp's rows r0 + g, r0 + g + 8 (those < R): unnormalised o into acc and (max, sum)
// into ml (attention.cu's scratch layout). Lane t holds dims 8E·a + 2E·t .. + 2E of each V group a (its c0
// columns, then its c1 columns), C the fragment geometry the PV products used.
template <typename C, int D>
__device__ __forceinline__ void store_partials(const float (&o)[D / 8][4], const float (&m_run)[2], float (&l_run)[2],
                                               int r0, int R, int G, int sp, int M, int b, int T, int nH, int kvh,
                                               float* __restrict__ acc, float2* __restrict__ ml) {
    const int g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
    quad_total(l_run);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rr = r0 + g + 8 * h;
        if (rr >= R) continue;
        int tt, j;
        const size_t idx = partial_row(rr, G, sp, M, b, T, nH, kvh, tt, j);
        float* dst = acc + idx * D;
#pragma unroll
        for (int a = 0; a < C::NVG; ++a) {
#pragma unroll
            for (int v4 = 0; v4 < 2 * C::E / 4; ++v4) {
                float e[4];
#pragma unroll
                for (int z = 0; z < 4; ++z) {
                    const int col = 4 * v4 + z;  // 0..E-1: column 2t of n-tile col; E..2E-1: column 2t+1
                    e[z] = col < C::E ? o[a * C::E + col][2 * h] : o[a * C::E + col - C::E][2 * h + 1];
                }
                *reinterpret_cast<float4*>(dst + 8 * C::E * a + 2 * C::E * t4 + 4 * v4) =
                    make_float4(e[0], e[1], e[2], e[3]);
            }
        }
        if (t4 == 0) ml[idx] = make_float2(m_run[h], l_run[h]);
    }
}

// The combines' walk over one partial row's splits j, j + SJ, .. < ns: fold(e, a) for each, with e its (max, sum)
// and a the float4 at column col of its o, in split order. The loads go in batches of NB splits, all issued before
// the batch's folds (a loop of one split an iteration waited one L2 round trip per split).
template <int NB, typename Fold>
__device__ __forceinline__ void for_each_split(const float* __restrict__ acc, const float2* __restrict__ ml,
                                               size_t per_split, size_t row, int D, int col, int j, int SJ, int ns,
                                               Fold fold) {
    for (int s0 = j; s0 < ns; s0 += NB * SJ) {
        float2 e[NB];
        float4 a[NB];
#pragma unroll
        for (int u = 0; u < NB; ++u) {
            const int sp = s0 + u * SJ;
            if (sp < ns) {
                const size_t i = (size_t)sp * per_split + row;
                e[u] = ml[i];
                a[u] = *reinterpret_cast<const float4*>(acc + i * D + col);
            }
        }
#pragma unroll
        for (int u = 0; u < NB; ++u) {
            if (s0 + u * SJ >= ns) break;
            fold(e[u], a[u]);
        }
    }
}

}  // namespace
