// gemv.cuh: what the two decode-GEMV files share (gemv.cu: M = 1..8 and the embedding gather; gemv_stream.cu:
// the persistent M = 1 kernel): format constants, unit decoding, the per-unit dot products, x̂ staging, and the
// kernels' common argument list. Layouts and semantics: the header comment of gemv.cu.
#pragma once
#include "xcodes.cuh"  // int16 x̂ codes and their integer dot products (and quant.cuh)

namespace {

constexpr int kWarps = 8;  // warps per block (256 threads)
constexpr int kRows = 4;   // weight rows per warp
constexpr unsigned kFull = 0xffffffffu;

// Per-format constants. BITS = 16 is bf16. EU: elements of one 16-byte unit of the main plane.
template <int BITS>
struct Fmt {
    static constexpr int EU = BITS == 16 ? 8 : (BITS == 8 ? 16 : 32);
    static constexpr int XQ = BITS == 16 ? 0 : (BITS == 8 ? 1 : 2);  // x̂: fp32 / int16 natural / nibble order
};

__host__ __device__ constexpr int log2i(int n) { return n <= 1 ? 0 : 1 + log2i(n / 2); }
__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }
// Floats per 32-element chunk of x̂ for all M rows: row m at +36m; the stride is 4 (mod 8) float4s, so lanes
// reading consecutive units hit distinct banks.
__host__ __device__ constexpr int chunk_stride(int M) { return 36 * M + (M % 2 == 0 ? 4 : 0); }
// Elements 4pc..4pc+3 of a bf16 unit as floats.
__device__ __forceinline__ void bf16_piece(const Unit& d, int pc, float w[4]) {
    const uint32_t a = word_of(d.q, 2 * pc), b = word_of(d.q, 2 * pc + 1);
    w[0] = __uint_as_float(a << 16);
    w[1] = __uint_as_float(a & 0xFFFF0000u);
    w[2] = __uint_as_float(b << 16);
    w[3] = __uint_as_float(b & 0xFFFF0000u);
}

// Plane bases and the warp's rows as 32-bit unit offsets (row · units per row; the wrapper checks they fit).
template <int BITS>
struct Rows {
    const int4* q;            // qs (or bf16 data) as 16-byte units
    const uint8_t* h;         // qh: one u32 (q5) / u64 (q6) per 32 elements, indexed like q
    const unsigned short* s;  // fp16 scales
    unsigned oq[kRows];       // first unit of each row
    int sshift;               // log2(group / EU): unit index -> scale index (groups never straddle rows)

    __device__ __forceinline__ void load(Unit (&d)[kRows], int u) const {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const unsigned iq = oq[r] + (unsigned)u;
            d[r].q = __ldg(q + iq);
            d[r].h0 = d[r].h1 = 0;
            if constexpr (BITS == 5) d[r].h0 = __ldg(reinterpret_cast<const uint32_t*>(h) + iq);
            if constexpr (BITS == 6) {
                const uint2 t = __ldg(reinterpret_cast<const uint2*>(h) + iq);
                d[r].h0 = t.x;
                d[r].h1 = t.y;
            }
            d[r].sc = 0;
            if constexpr (BITS != 16) d[r].sc = __ldg(s + (iq >> sshift));
        }
    }
};

// acc[r][m] += Σ_{e in unit} W[r][e] · x̂[m][e] for bf16 weights and fp32 x̂; xb points at the unit's x̂ for
// m = 0 (row m at +36m).
template <int M>
__device__ __forceinline__ void compute_unit_bf16(const Unit (&d)[kRows], const float* xb, float (&acc)[kRows][M]) {
#pragma unroll
    for (int pc = 0; pc < 2; ++pc) {
        float w[kRows][4];
#pragma unroll
        for (int r = 0; r < kRows; ++r) bf16_piece(d[r], pc, w[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4 xv = *reinterpret_cast<const float4*>(xb + m * 36 + 4 * pc);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                float& t = acc[r][m];
                t = fmaf(w[r][0], xv.x, t);
                t = fmaf(w[r][1], xv.y, t);
                t = fmaf(w[r][2], xv.z, t);
                t = fmaf(w[r][3], xv.w, t);
            }
        }
    }
}

// Sum NV values v[0..NV) over the warp; afterwards lane l holds the total of value l >> (5 - log2 NV).
// Halving exchanges (NV - 1 shuffles) instead of one butterfly per value (5 NV shuffles); O is the lane offset.
template <int NV, int O>
struct ReduceScatter {
    static __device__ __forceinline__ void run(float (&v)[32], int lane) {
        constexpr int H = NV / 2;
        const bool up = (lane & O) != 0;
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float send = up ? v[i] : v[i + H];
            const float keep = up ? v[i + H] : v[i];
            v[i] = keep + __shfl_xor_sync(kFull, send, O);
        }
        ReduceScatter<H, O / 2>::run(v, lane);
    }
};
template <int O>
struct ReduceScatter<1, O> {
    static __device__ __forceinline__ void run(float (&v)[32], int lane) {
        v[0] += __shfl_xor_sync(kFull, v[0], O);
        ReduceScatter<1, O / 2>::run(v, lane);
    }
};
template <>
struct ReduceScatter<1, 0> {
    static __device__ __forceinline__ void run(float (&)[32], int) {}
};

// The zero-centred norm's gain 1 + w of 4 consecutive elements (the staging multiplies x by it).
__device__ __forceinline__ float4 norm_gain4(float4 w) {
    w.x += 1.f, w.y += 1.f, w.z += 1.f, w.w += 1.f;
    return w;
}

// Stage rows [M0, M0 + MB) of x̂ slab [k0, k0 + kn) into xs; ss[m] += Σ x² of the elements this thread staged.
// XQ 0 (bf16 weights): fp32 chunks of chunk_stride(M) floats; XQ 1 / 2 (quantized weights): int16 chunk
// records of qchunk_bytes(M) (store_codes4). Loop bounds are warp-uniform (shuffles inside).
template <int M, int M0, int MB, int XQ>
__device__ __forceinline__ void stage_rows(void* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (&ss)[M]) {
    constexpr int CS = chunk_stride(M), CB = qchunk_bytes(M);
    float* xf = reinterpret_cast<float*>(xs);
    uint8_t* xb = reinterpret_cast<uint8_t*>(xs);
    const int tid = threadIdx.x, lane = tid & 31;
    if (vec) {  // 8 lanes cover one 32-element chunk
#pragma unroll 2
        for (int e0 = 0; e0 < kn; e0 += 4 * kWarps * 32) {
            const int e = e0 + 4 * tid;
            const bool on = e < kn;  // kn % 32 == 0: a chunk's 8 lanes agree
            float4 v[MB];            // every row's load in flight together
#pragma unroll
            for (int m = 0; m < MB; ++m)
                v[m] = on ? __ldg(reinterpret_cast<const float4*>(x + (long long)(M0 + m) * ldx + k0 + e))
                          : make_float4(0.f, 0.f, 0.f, 0.f);
            float4 g = make_float4(1.f, 1.f, 1.f, 1.f);
            if (norm_w && on) g = norm_gain4(__ldg(reinterpret_cast<const float4*>(norm_w + k0 + e)));
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m].x * v[m].x + v[m].y * v[m].y + v[m].z * v[m].z + v[m].w * v[m].w;
                const float4 h = make_float4(v[m].x * g.x, v[m].y * g.y, v[m].z * g.z, v[m].w * g.w);
                if constexpr (XQ) {
                    store_codes4<M, XQ>(xb + (e >> 5) * CB, M0 + m, e & 31, h, on);
                } else {
                    if (on) *reinterpret_cast<float4*>(xf + (e >> 5) * CS + (e & 31) + 36 * (M0 + m)) = h;
                }
            }
        }
    } else {  // a warp covers one chunk
#pragma unroll 4
        for (int e0 = 0; e0 < kn; e0 += kWarps * 32) {
            const int e = e0 + tid;
            const bool on = e < kn;  // kn % 32 == 0: a warp agrees
            float v[MB];
#pragma unroll
            for (int m = 0; m < MB; ++m) v[m] = on ? __ldg(x + (long long)(M0 + m) * ldx + k0 + e) : 0.f;
            const float g = norm_w && on ? 1.f + __ldg(norm_w + k0 + e) : 1.f;
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m] * v[m];
                const float h = v[m] * g;
                if constexpr (XQ) {
                    store_code1<M, XQ>(xb + (e >> 5) * CB, M0 + m, lane, h, on);
                } else {
                    if (on) xf[(e >> 5) * CS + (e & 31) + 36 * (M0 + m)] = h;
                }
            }
        }
    }
}

// Stage x̂ slab [k0, k0 + kn) of every row into xs (at most 4 rows per pass: registers are short at large M,
// where 32 accumulators are live), and add each row's Σ x² to ssred[warp][m] (norm only; one writer per slot).
template <int M, int XQ>
__device__ __forceinline__ void stage_slab(void* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (*ssred)[8]) {
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.f;
    stage_rows<M, 0, (M < 4 ? M : 4), XQ>(xs, x, ldx, norm_w, k0, kn, vec, ss);
    if constexpr (M > 4) stage_rows<M, 4, M - 4, XQ>(xs, x, ldx, norm_w, k0, kn, vec, ss);
    if (norm_w) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float t = warp_sum(ss[m]);
            if (lane == 0) ssred[warp][m] = (k0 == 0 ? 0.f : ssred[warp][m]) + t;
        }
    }
}

}  // namespace

#define NINFER_GEMV_ARGS                                                                                      \
    const uint8_t *__restrict__ qs, const uint8_t *__restrict__ qh, const uint8_t *__restrict__ sc,           \
        const float *__restrict__ x, float *y, const float *__restrict__ norm_w,                              \
        const float *__restrict__ row_scale, int N, int K, int kp, int gshift, int ldx, int ldy, int mode,    \
        float eps, int kw_log2, int ks, int xvec
#define NINFER_GEMV_PASS \
    qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift, ldx, ldy, mode, eps, kw_log2, ks, xvec
