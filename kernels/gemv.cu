// gemv.cu: the decode GEMV y = W x̂ for M = 1..8 activation rows (weights read once for all rows), with an
// optional fused zero-centred RMSNorm prologue, per-row output scale, residual add or SwiGLU epilogue; and the
// embedding gather.
//
// Layouts. W [N, K] in its artifact bytes (docs/format.md): q{4,5,6,8}g{32,64,128} planes qs/qh/scales with rows
// of Kp = round_up(K, 128) elements, or raw bf16 [N, K]. K % 32 == 0. x fp32 [M, ldx] (K valid columns, never
// read beyond), y fp32 [M, ldy]; norm_w fp32 [K]; row_scale fp32 [M]; ids int32 [M]; y must not overlap x.
//   x̂[m]  = x[m]                                   or, with norm_w:  x[m] · rsqrt(mean(x[m]²) + eps) · (1 + norm_w)
//   mode 0 (store):  y[m, n]  = s_m · Σ_k W[n, k] x̂[m, k]        s_m = row_scale[m], or 1 without row_scale
//   mode 1 (add):    y[m, n] += s_m · Σ_k W[n, k] x̂[m, k]
//   mode 2 (swiglu): rows interleaved in tiles of 16 (32t..32t+15 gate 16t.., 32t+16..32t+31 up 16t..):
//                    y[m, j] = silu(gate_j · x̂[m]) · (up_j · x̂[m]), j < N/2; row_scale ignored
// Reference ops: ninfer_rt.reference.ops.rms_norm_zc, x @ W.T, swiglu_mlp's silu(g)·u, embed_tokens[ids];
// weights decode as ninfer_rt.formats.IntFormat.decode (w = fp16 scale · code, exact in fp32).
//
// Work split (GEMV). A block is 8 warps; a warp owns 4 weight rows (a "row group") and each lane reads one
// 16-byte unit of all 4 rows per step (32 codes of q4/5/6, 16 of q8, 8 of bf16): coalesced 16-byte loads, and
// each x̂ value read from shared memory serves 4 rows. KW = 1/2/4/8 warps of a block may split the units of one
// row group (short N, long K); the block sums them in shared memory, so each output has exactly one writer.
// x̂ is staged in shared memory in K slabs of `ks` elements (under the 48 KB default), as chunks of 32 floats
// per row padded to 36 (conflict-free float4 reads); pad float 32 holds the chunk's Σ x̂ (see decode below).
// The norm is linear in the dot product: slabs hold x·(1 + norm_w), and rsqrt(mean x²) is applied at the end.
//
// M = 1 with K <= 10240 (all of x̂ in one slab) has its own persistent, register-pipelined kernel: gemv_*_s1
// (section "M = 1 stream" below).
//
// Decode. q8: magic-number byte -> float (2^23 + u) minus 2^23 + 128 gives the code exactly. q4/5/6 skip that
// subtraction: the byte goes under exponent 0x3F, giving f = 1 + u/2^b exactly, and per 32-element chunk
// Σ (u - off) x = 2^b Σ f x - (2^b + off) Σ x (the offset is small, so fp32 loses only ~2 bits to cancellation:
// measured ~1e-6 relative, not 2^23-sized). No int->float conversions are issued.
#include "quant.cuh"

namespace {

constexpr int kWarps = 8;  // warps per block (256 threads)
constexpr int kRows = 4;   // weight rows per warp
constexpr unsigned kFull = 0xffffffffu;

// Per-format constants. BITS = 16 is bf16. EU: elements of one 16-byte unit of the main plane.
template <int BITS>
struct Fmt {
    static constexpr int EU = BITS == 16 ? 8 : (BITS == 8 ? 16 : 32);
    static constexpr int NP = EU / 4;                   // 4-element pieces per unit (one float4 of x̂ each)
    static constexpr bool NIB = BITS <= 6;              // nibble plane: biased decode + Σx correction
    static constexpr float KB = (float)(1 << (BITS & 15));  // 2^b (NIB)
    static constexpr float CB = (float)((1 << (BITS & 15)) + (1 << ((BITS - 1) & 15)));  // 2^b + off (NIB)
};

__host__ __device__ constexpr int log2i(int n) { return n <= 1 ? 0 : 1 + log2i(n / 2); }
__host__ __device__ constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }
// Floats per 32-element chunk of x̂ for all M rows: row m at +36m; the stride is 4 (mod 8) float4s, so lanes
// reading consecutive units hit distinct banks.
__host__ __device__ constexpr int chunk_stride(int M) { return 36 * M + (M % 2 == 0 ? 4 : 0); }

// One unit of one row as loaded: 16 code bytes, high bits (q5: 32 bits, q6: 64 bits), fp16 scale bits.
struct Unit {
    int4 q;
    uint32_t h0, h1;
    unsigned short sc;
};

__device__ __forceinline__ uint32_t word_of(const int4& q, int j) {
    return (uint32_t)(j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w);
}

// (a & mask) | c as one LOP3: left to itself the compiler splits it in two when c is a constant too.
template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
    return d;
}

// Byte b of x placed at bits 16..23 under 0x3F: the byte's bit 7 is the exponent's low bit, so byte 0x80 | c
// gives exactly 1 + c / 2^7 (nibble formats, see header).
__device__ __forceinline__ float byte_hi(uint32_t x, int b) {
    return __uint_as_float(__byte_perm(x, 0x3F000000u, 0x7044u | ((uint32_t)b << 8)));
}
// float(2^23 + byte b of x), built bitwise (0x4B0000bb).
__device__ __forceinline__ float byte_lo(uint32_t x, int b) {
    return __uint_as_float(__byte_perm(x, 0x4B000000u, 0x7540u + (uint32_t)b));
}

// Elements 4pc..4pc+3 of a unit: q4/5/6 f = 1 + u/2^b; q8 the code; bf16 the value.
template <int BITS>
__device__ __forceinline__ void decode_piece(const Unit& d, int pc, float w[4]) {
    if constexpr (BITS == 16) {
        const uint32_t a = word_of(d.q, 2 * pc), b = word_of(d.q, 2 * pc + 1);
        w[0] = __uint_as_float(a << 16);
        w[1] = __uint_as_float(a & 0xFFFF0000u);
        w[2] = __uint_as_float(b << 16);
        w[3] = __uint_as_float(b & 0xFFFF0000u);
    } else if constexpr (BITS == 8) {
        const uint32_t u = word_of(d.q, pc) ^ 0x80808080u;  // int8 q -> unsigned q + 128 per byte
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = byte_lo(u, i) - (8388608.f + 128.f);
    } else {
        // Word j holds elements 8j..8j+7: element 8j+2i in the low nibble of byte i, 8j+2i+1 in the high one.
        // te / to get, in byte i, 0x80 | u << (7 - BITS) for element 8j+2i / 8j+2i+1: f = 1 + u / 2^BITS.
        const int j = pc >> 1, b = 2 * (pc & 1);
        const uint32_t v = word_of(d.q, j);
        uint32_t te, to;
        const uint32_t e7 = 0x80808080u;  // bit 7 of each byte: the exponent's low bit
        if constexpr (BITS == 4) {
            te = and_or<0x78787878u>(v << 3, e7);
            to = and_or<0x78787878u>(v >> 1, e7);
        } else if constexpr (BITS == 5) {
            // element 8j+e has bit e of byte j of qh: spread even / odd bits to bit 6 of bytes 0..3
            const uint32_t hb = d.h0 >> (8 * j);
            te = and_or<0x3C3C3C3Cu>(v << 2, and_or<0x40404040u>((hb & 0x55u) * 0x1041040u, e7));
            to = and_or<0x3C3C3C3Cu>(v >> 2, and_or<0x40404040u>(((hb >> 1) & 0x55u) * 0x1041040u, e7));
        } else {
            // element 8j+e has bits 2e..2e+1 of 16-bit field j of qh; nibble i of the field -> byte i of y
            const uint32_t h = j < 2 ? d.h0 : d.h1;
            const uint32_t a = __byte_perm(h, 0u, (j & 1) ? 0x4342u : 0x4140u);
            const uint32_t y = (a | (a << 4)) & 0x0F0F0F0Fu;
            te = and_or<0x1E1E1E1Eu>(v << 1, and_or<0x60606060u>(y << 5, e7));
            to = and_or<0x1E1E1E1Eu>(v >> 3, and_or<0x60606060u>(y << 3, e7));
        }
        w[0] = byte_hi(te, b);
        w[1] = byte_hi(to, b);
        w[2] = byte_hi(te, b + 1);
        w[3] = byte_hi(to, b + 1);
    }
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

// acc[r][m] += Σ_{e in unit} W[r][e] · x̂[m][e]; xb points at the unit's x̂ for m = 0 (row m at +36m). With USE_P
// (small M) the decoded values are multiplied by x̂ as they are and scaled per unit (nibble formats: corrected
// with the chunk's Σ x̂ at xb[36m + 32]); otherwise each weight is made exact and scaled first (no per-unit
// partial sums: 32 accumulators already fill the registers at large M).
template <int BITS, int M, bool USE_P>
__device__ __forceinline__ void compute_unit(const Unit (&d)[kRows], const float* xb, float (&acc)[kRows][M]) {
    using F = Fmt<BITS>;
    static_assert(F::KB >= 1.f && F::CB >= 1.f, "nibble decode constants");
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = BITS == 16 ? 1.f : __half2float(__ushort_as_half(d[r].sc));
    float p[kRows][M];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) p[r][m] = 0.f;
#pragma unroll
    for (int pc = 0; pc < F::NP; ++pc) {
        float w[kRows][4];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            decode_piece<BITS>(d[r], pc, w[r]);
            if constexpr (!USE_P && F::NIB) {
                // s (u - off) = f s 2^b - s (2^b + off), exact in one fma: s (2^b + off) = 3 s 2^(b-1) fits fp32
                const float a = s[r] * F::KB, c = -s[r] * F::CB;
#pragma unroll
                for (int e = 0; e < 4; ++e) w[r][e] = fmaf(w[r][e], a, c);
            } else if constexpr (!USE_P && BITS == 8) {
#pragma unroll
                for (int e = 0; e < 4; ++e) w[r][e] *= s[r];
            }
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4 xv = *reinterpret_cast<const float4*>(xb + m * 36 + 4 * pc);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                float& t = USE_P ? p[r][m] : acc[r][m];
                t = fmaf(w[r][0], xv.x, t);
                t = fmaf(w[r][1], xv.y, t);
                t = fmaf(w[r][2], xv.z, t);
                t = fmaf(w[r][3], xv.w, t);
            }
        }
    }
    if constexpr (USE_P) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float cx = F::NIB ? -F::CB * xb[m * 36 + 32] : 0.f;  // -(2^b + off) Σ x̂ of the chunk
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                const float v = F::NIB ? fmaf(p[r][m], F::KB, cx) : p[r][m];
                acc[r][m] = fmaf(s[r], v, acc[r][m]);
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

// Stage rows [M0, M0 + MB) of x̂ slab [k0, k0 + kn) into xs; ss[m] += Σ x² of the elements this thread staged;
// with SX, each chunk's Σ x̂ goes to its pad float 32. Loop bounds are warp-uniform (shuffles inside).
template <int M, int M0, int MB, bool SX>
__device__ __forceinline__ void stage_rows(float* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (&ss)[M]) {
    constexpr int CS = chunk_stride(M);
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
            if (norm_w && on) {
                g = __ldg(reinterpret_cast<const float4*>(norm_w + k0 + e));
                g.x += 1.f, g.y += 1.f, g.z += 1.f, g.w += 1.f;
            }
            float* dst = xs + (e >> 5) * CS + (e & 31);
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m].x * v[m].x + v[m].y * v[m].y + v[m].z * v[m].z + v[m].w * v[m].w;
                const float4 h = make_float4(v[m].x * g.x, v[m].y * g.y, v[m].z * g.z, v[m].w * g.w);
                if (on) *reinterpret_cast<float4*>(dst + 36 * (M0 + m)) = h;
                if constexpr (SX) {
                    float t = (h.x + h.y) + (h.z + h.w);
                    t += __shfl_xor_sync(kFull, t, 1);
                    t += __shfl_xor_sync(kFull, t, 2);
                    t += __shfl_xor_sync(kFull, t, 4);
                    if (on && (lane & 7) == 0) dst[36 * (M0 + m) + 32] = t;
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
            float* dst = xs + (e >> 5) * CS + (e & 31);
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                ss[M0 + m] += v[m] * v[m];
                const float h = v[m] * g;
                if (on) dst[36 * (M0 + m)] = h;
                if constexpr (SX) {
                    const float t = warp_sum(h);
                    if (on && lane == 0) dst[36 * (M0 + m) + 32] = t;
                }
            }
        }
    }
}

// Stage x̂ slab [k0, k0 + kn) of every row into xs (at most 4 rows per pass: registers are short at large M,
// where 32 accumulators are live), and add each row's Σ x² to ssred[warp][m] (norm only; one writer per slot).
template <int M, bool SX>
__device__ __forceinline__ void stage_slab(float* xs, const float* __restrict__ x, int ldx,
                                           const float* __restrict__ norm_w, int k0, int kn, bool vec,
                                           float (*ssred)[8]) {
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) ss[m] = 0.f;
    stage_rows<M, 0, (M < 4 ? M : 4), SX>(xs, x, ldx, norm_w, k0, kn, vec, ss);
    if constexpr (M > 4) stage_rows<M, 4, M - 4, SX>(xs, x, ldx, norm_w, k0, kn, vec, ss);
    if (norm_w) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float t = warp_sum(ss[m]);
            if (lane == 0) ssred[warp][m] = (k0 == 0 ? 0.f : ssred[warp][m]) + t;
        }
    }
}

template <int BITS, int M>
__device__ __forceinline__ void gemv_body(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                          const uint8_t* __restrict__ sc, const float* __restrict__ x,
                                          float* y, const float* __restrict__ norm_w,
                                          const float* __restrict__ row_scale, int N, int K, int kp, int gshift,
                                          int ldx, int ldy, int mode, float eps, int kw_log2, int ks, int xvec) {
    using F = Fmt<BITS>;
    constexpr int EU = F::EU;
    constexpr int CS = chunk_stride(M);
    constexpr bool USE_P = M <= 4 && BITS != 16;  // per-unit partial sums: registers allow them at small M
    constexpr bool SX = USE_P && F::NIB;          // the chunk sums Σ x̂ are needed
    constexpr int NV = next_pow2(kRows * M);
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);  // [ks / 32 chunks][CS]
    __shared__ float red[kWarps][32];
    __shared__ float ssred[kWarps][8];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int KW = 1 << kw_log2, RG = kWarps >> kw_log2;
    const int rg = warp >> kw_log2, kw = warp & (KW - 1);
    const int gi = blockIdx.x * RG + rg;  // row group of this warp
    const bool swiglu = mode == 2;

    Rows<BITS> rows;
    rows.q = reinterpret_cast<const int4*>(qs);
    rows.h = qh;
    rows.s = reinterpret_cast<const unsigned short*>(sc);
    rows.sshift = gshift - log2i(EU);
    {
        const unsigned nuq = BITS == 16 ? K / 8 : (BITS == 8 ? kp / 16 : kp / 32);  // units per stored row
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            // swiglu: 2 gate rows and the 2 matching up rows (16 further), so each warp holds whole pairs
            int n = swiglu ? 32 * (gi >> 3) + 2 * (gi & 7) + (r & 1) + 16 * (r >> 1) : kRows * gi + r;
            n = min(n, N - 1);  // rows past N read row N-1 and are never written
            rows.oq[r] = (unsigned)n * nuq;
        }
    }

    float acc[kRows][M];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][m] = 0.f;

    // Each warp loads its 4 rows' units, then decodes and accumulates them; memory parallelism comes from many
    // resident warps (a software prefetch was tried: ptxas sinks it below the compute under the register cap).
    const int us = 32 * KW;  // unit stride of a lane
    int u = kw * 32 + lane;  // this lane's next unit (global index along the row)
    Unit A[kRows];
    for (int k0 = 0; k0 < K; k0 += ks) {
        const int kn = min(ks, K - k0);
        const int ub = k0 / EU, ue = (k0 + kn) / EU;
        if (k0 > 0) __syncthreads();  // every warp is done with the previous slab
        // the first weights are in flight while x̂ is staged (at M > 4 registers are too short for that)
        if (M <= 4 && u < ue) rows.load(A, u);
        stage_slab<M, SX>(xs, x, ldx, norm_w, k0, kn, xvec != 0, ssred);
        __syncthreads();
        if (M > 4 && u < ue) rows.load(A, u);
        while (u < ue) {
            const int le = (u - ub) * EU;
            compute_unit<BITS, M, USE_P>(A, xs + (le >> 5) * CS + (le & 31), acc);
            u += us;
            if (u < ue) rows.load(A, u);
        }
    }

    // warp totals -> red[warp][r * M + m]
    {
        float v[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = i < kRows * M ? acc[i / M][i % M] : 0.f;
        ReduceScatter<NV, 16>::run(v, lane);
        constexpr int SH = 5 - log2i(NV);
        const int idx = lane >> SH;
        if ((lane & ((1 << SH) - 1)) == 0 && idx < kRows * M) red[warp][idx] = v[0];
    }
    __syncthreads();

    // epilogue: one thread per output element, consecutive threads on consecutive columns of y
    float inv = 1.f;
    if (!swiglu) {
        const int RT = RG * kRows;  // rows per block
        if (tid < RT * M) {
            const int m = tid / RT, q = tid - m * RT, g = q / kRows, r = q - g * kRows;
            const int n = kRows * (blockIdx.x * RG + g) + r;
            if (n < N) {
                float v = 0.f;
                for (int i = 0; i < KW; ++i) v += red[g * KW + i][r * M + m];
                if (norm_w) {
                    float t = 0.f;
                    for (int w = 0; w < kWarps; ++w) t += ssred[w][m];
                    inv = rsqrtf(t / (float)K + eps);
                }
                v *= inv;
                if (row_scale) v *= __ldg(row_scale + m);
                float* dst = y + (long long)m * ldy + n;
                *dst = mode == 1 ? *dst + v : v;
            }
        }
    } else {
        const int PT = RG * 2;  // outputs per block and row of y
        if (tid < PT * M) {
            const int m = tid / PT, q = tid - m * PT, g = q >> 1, pp = q & 1;
            const int gg = blockIdx.x * RG + g;
            const int j = 16 * (gg >> 3) + 2 * (gg & 7) + pp;
            if (j < N / 2) {
                float gate = 0.f, up = 0.f;
                for (int i = 0; i < KW; ++i) {
                    gate += red[g * KW + i][pp * M + m];
                    up += red[g * KW + i][(pp + 2) * M + m];
                }
                if (norm_w) {
                    float t = 0.f;
                    for (int w = 0; w < kWarps; ++w) t += ssred[w][m];
                    inv = rsqrtf(t / (float)K + eps);
                }
                gate *= inv;
                up *= inv;
                y[(long long)m * ldy + j] = siluf_(gate) * up;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------ M = 1 stream
//
// The M = 1 kernel (gemv_<code>_s1): the same task split as gemv_body (a warp owns a row group of 4 rows, KW
// warps of a block split its units), but blocks are persistent and stream their weights through registers.
// The block's "block tiles" (RG = 8 / KW row groups each) are bi = blockIdx.x, blockIdx.x + gridDim.x, ...; a
// warp walks its row group of each block tile in S steps ("tiles") of D units per lane and row, units
//   u = ((t · KW + kw) · D + d) · 32 + lane,   t < S = ceil(nu / (32 D KW)), d < D, u < nu = K / EU,
// so each warp load instruction still reads 512 contiguous bytes of a row. Two tiles of registers ping-pong: a
// tile's 4·D 16-byte units (and scales) are issued a whole tile ahead of their use, the first two before x̂ is
// staged, so every warp keeps 4·D to 8·D units in flight from its first instruction to its last; on top, L2 is
// asked (prefetch.global.L2, no registers) for the pf tiles after the two in registers. x̂ (all of K) is
// staged once per block, not once per block tile. A row group's KW partial sums meet in shared memory behind
// a named barrier of its KW warps (double-buffered by task parity); with KW = 1 a warp writes its own outputs
// and never waits for another. In "add" mode the old y is loaded before the task's last tile is decoded.
// Same semantics as gemv_body at M = 1 (the caller guarantees K <= the x̂ smem capacity and 1 <= D <=
// StreamDepth; blocks past the last block tile return at once). Sums differ from gemv_body's only in order (K split into D·32-unit pieces).

// Units per lane and row in one register tile: 2 where a unit is 4-5 registers, 1 for q5/q6 (6-7 registers).
template <int BITS>
struct StreamDepth {
    static constexpr int value = (BITS == 5 || BITS == 6) ? 1 : 2;
};

template <int DM>
struct Tile {
    Unit u[DM][kRows];
};

// Stage x̂ = x (· (1 + norm_w)) of one row, all K, as gemv_body's float4 staging does, but with every load of
// up to 4096 elements in flight together; ssred[warp][0] = the warp's Σ x² (norm only).
template <bool SX>
__device__ __forceinline__ void stage_m1_vec(float* xs, const float* __restrict__ x,
                                             const float* __restrict__ norm_w, int K, float (*ssred)[8]) {
    constexpr int XB = 4;  // float4s per thread per pass
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss = 0.f;
    for (int e0 = 0; e0 < K; e0 += 4 * kWarps * 32 * XB) {
        float4 v[XB], g[XB];
#pragma unroll
        for (int j = 0; j < XB; ++j) {
            const int e = e0 + 4 * (tid + kWarps * 32 * j);
            v[j] = e < K ? __ldg(reinterpret_cast<const float4*>(x + e)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < XB; ++j) {
            const int e = e0 + 4 * (tid + kWarps * 32 * j);
            g[j] = make_float4(1.f, 1.f, 1.f, 1.f);
            if (norm_w && e < K) {
                g[j] = __ldg(reinterpret_cast<const float4*>(norm_w + e));
                g[j].x += 1.f, g[j].y += 1.f, g[j].z += 1.f, g[j].w += 1.f;
            }
        }
#pragma unroll
        for (int j = 0; j < XB; ++j) {
            const int e = e0 + 4 * (tid + kWarps * 32 * j);
            const bool on = e < K;  // K % 32 == 0: the 8 lanes of a chunk agree
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
            const float4 h = make_float4(v[j].x * g[j].x, v[j].y * g[j].y, v[j].z * g[j].z, v[j].w * g[j].w);
            float* dst = xs + (e >> 5) * 36 + (e & 31);
            if (on) *reinterpret_cast<float4*>(dst) = h;
            if constexpr (SX) {
                float t = (h.x + h.y) + (h.z + h.w);
                t += __shfl_xor_sync(kFull, t, 1);
                t += __shfl_xor_sync(kFull, t, 2);
                t += __shfl_xor_sync(kFull, t, 4);
                if (on && (lane & 7) == 0) dst[32] = t;
            }
        }
    }
    if (norm_w) {
        const float t = warp_sum(ss);
        if (lane == 0) ssred[warp][0] = t;
    }
}

// Barrier 1 + rg among `threads` threads (the KW warps of row group rg); constant ids, so ptxas reserves 9
// barriers rather than all 16.
__device__ __forceinline__ void group_barrier(int rg, int threads) {
    switch (rg) {
        case 0: asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory"); break;
        case 1: asm volatile("bar.sync 2, %0;" ::"r"(threads) : "memory"); break;
        case 2: asm volatile("bar.sync 3, %0;" ::"r"(threads) : "memory"); break;
        case 3: asm volatile("bar.sync 4, %0;" ::"r"(threads) : "memory"); break;
        case 4: asm volatile("bar.sync 5, %0;" ::"r"(threads) : "memory"); break;
        case 5: asm volatile("bar.sync 6, %0;" ::"r"(threads) : "memory"); break;
        case 6: asm volatile("bar.sync 7, %0;" ::"r"(threads) : "memory"); break;
        default: asm volatile("bar.sync 8, %0;" ::"r"(threads) : "memory"); break;
    }
}

__device__ __forceinline__ void prefetch_l2(uintptr_t a) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

template <int BITS>
__device__ __forceinline__ void gemv_stream_body(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                                 const uint8_t* __restrict__ sc, const float* __restrict__ x,
                                                 float* y, const float* __restrict__ norm_w,
                                                 const float* __restrict__ row_scale, int N, int K, int kp,
                                                 int gshift, int ldx, int mode, float eps, int kw_log2, int xvec,
                                                 int D, int pf) {
    using F = Fmt<BITS>;
    constexpr int EU = F::EU;
    constexpr int DM = StreamDepth<BITS>::value;
    constexpr bool USE_P = BITS != 16;  // gemv_body's choice at M = 1
    constexpr bool SX = USE_P && F::NIB;
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);  // [K / 32 chunks][36]
    __shared__ float ssred[kWarps][8];
    __shared__ float part[2][kWarps][kRows];  // KW > 1: warp partial sums, by task parity

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int KW = 1 << kw_log2, RG = kWarps >> kw_log2;
    const int rg = warp >> kw_log2, kw = warp & (KW - 1);
    const bool swiglu = mode == 2;
    const int G = (N + kRows - 1) / kRows;  // row groups (swiglu: N % 32 == 0, so every group is whole)
    const int BI = (G + RG - 1) / RG;       // block tiles
    if ((int)blockIdx.x >= BI) return;      // whole block: before any barrier
    const int nu = K / EU;                  // units of a row holding the K valid elements
    const int span = 32 * D * KW;           // units of a row one tile step covers (all KW warps)
    const int S = (nu + span - 1) / span;   // tiles per task
    const unsigned nuq = BITS == 16 ? K / 8 : (BITS == 8 ? kp / 16 : kp / 32);  // units per stored row

    Rows<BITS> rows;
    rows.q = reinterpret_cast<const int4*>(qs);
    rows.h = qh;
    rows.s = reinterpret_cast<const unsigned short*>(sc);
    rows.sshift = gshift - log2i(EU);

    // Weight row r of row group g: swiglu holds 2 gate rows and the 2 matching up rows (16 further), as
    // gemv_body; rows past N read row N-1 and are never written.
    auto row_of = [&](int g, int r) {
        const int n = swiglu ? 32 * (g >> 3) + 2 * (g & 7) + (r & 1) + 16 * (r >> 1) : kRows * g + r;
        return min(n, N - 1);
    };

    // Issue the loads of tile t of block tile bi into T.
    auto issue = [&](Tile<DM>& T, int bi, int t) {
        const int g = bi * RG + rg;
#pragma unroll
        for (int r = 0; r < kRows; ++r) rows.oq[r] = (unsigned)row_of(g, r) * nuq;
        const int ub = (t * KW + kw) * D * 32 + lane;
#pragma unroll
        for (int d = 0; d < DM; ++d) {
            const int u = ub + 32 * d;
            if (d < D && u < nu) rows.load(T.u[d], u);
        }
    };

    // Ask L2 for tile t of block tile bi: the byte ranges its loads will read, one (row, unit step, plane) per
    // lane, in 128-byte lines, every address inside its range (a hint: no registers, nothing waits for it).
    auto prefetch = [&](int bi, int t) {
        constexpr int NPL = BITS == 16 ? 1 : (BITS == 5 || BITS == 6 ? 3 : 2);  // planes: qs, scales, qh
        if (lane >= kRows * NPL * D) return;
        const int r = lane & (kRows - 1), rest = lane >> 2;  // rest < NPL · D
        const int d = D == 1 ? 0 : (rest & 1), pl = D == 1 ? rest : (rest >> 1);
        const int u0 = (t * KW + kw) * D * 32 + 32 * d, u1 = min(u0 + 32, nu);
        if (u0 >= u1) return;
        const unsigned long long a0 = (unsigned long long)row_of(bi * RG + rg, r) * nuq + (unsigned)u0;
        const unsigned long long a1 = a0 + (unsigned)(u1 - u0);  // units [a0, a1) of the plane
        uintptr_t p, end;
        if (pl == 0) {
            p = reinterpret_cast<uintptr_t>(qs) + a0 * 16, end = reinterpret_cast<uintptr_t>(qs) + a1 * 16;
        } else if (pl == 1) {
            p = reinterpret_cast<uintptr_t>(sc) + (a0 >> rows.sshift) * 2;
            end = reinterpret_cast<uintptr_t>(sc) + (((a1 - 1) >> rows.sshift) + 1) * 2;
        } else {
            constexpr int HB = BITS == 5 ? 4 : 8;  // qh bytes per unit
            p = reinterpret_cast<uintptr_t>(qh) + a0 * HB, end = reinterpret_cast<uintptr_t>(qh) + a1 * HB;
        }
        prefetch_l2(p);
        for (uintptr_t a = (p & ~(uintptr_t)127) + 128; a < end; a += 128) prefetch_l2(a);
    };

    // Ask L2 for x and norm_w first, so their lines are not queued behind the weights (x is usually in L2
    // already, norm_w rarely); then issue the first two tiles and ask L2 for the pf after them, then stage x̂
    // while they are in flight.
    {
        const int lines = (K * 4 + 127) / 128;  // 128-byte steps covering one vector (every address inside)
        for (int i = threadIdx.x; i <= 2 * lines + 1; i += kWarps * 32) {
            const bool second = i > lines;
            const float* v = second ? norm_w : x;
            const int j = second ? i - lines - 1 : i;
            if (v) prefetch_l2(reinterpret_cast<uintptr_t>(v) + min(128 * j, K * 4 - 4));
        }
    }
    Tile<DM> A, B;
    int ibi = blockIdx.x, it = 0;  // the next tile to issue
    auto advance = [&](int& bi, int& t) {
        if (++t == S) {
            t = 0;
            bi += gridDim.x;
        }
    };
    issue(A, ibi, it);
    advance(ibi, it);
    if (ibi < BI) issue(B, ibi, it);
    advance(ibi, it);
    {
        int pbi = ibi, pt = it;  // tiles 2 .. pf + 1
        for (int i = 0; i < pf && pbi < BI; ++i) {
            prefetch(pbi, pt);
            advance(pbi, pt);
        }
    }
    // After tile q is issued (the issue pointer at q + 1): ask L2 for tile q + pf.
    auto prefetch_ahead = [&]() {
        if (pf <= 0) return;
        int pbi = ibi, pt = it;
        for (int i = 1; i < pf; ++i) advance(pbi, pt);
        if (pbi < BI) prefetch(pbi, pt);
    };
    // Weights are never written by earlier kernels, so their first tiles are already in flight; only now wait
    // for the previous kernel (programmatic dependent launch), before reading x, row_scale or y.
    ninfer_pdl_begin();
    const float rs = row_scale && !swiglu ? __ldg(row_scale) : 1.f;

    if (xvec) stage_m1_vec<SX>(xs, x, norm_w, K, ssred);
    else stage_slab<1, SX>(xs, x, ldx, norm_w, 0, K, false, ssred);
    __syncthreads();
    float inv = 1.f;
    if (norm_w) {
        float t = 0.f;
        for (int w = 0; w < kWarps; ++w) t += ssred[w][0];
        inv = rsqrtf(t / (float)K + eps);
    }

    float acc[kRows][1];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r][0] = 0.f;
    int par = 0;

    // The task of block tile bi is complete in acc: reduce it and write its outputs.
    auto finish = [&](int bi, float yv) {
        float v[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = i < kRows ? acc[i][0] : 0.f;
        ReduceScatter<kRows, 16>::run(v, lane);  // lane l: the warp's total of row l >> 3
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][0] = 0.f;
        float a, b;  // lane q < 4: total of row q; lane q < 2: also of row q + 2 (swiglu's up row)
        if (KW == 1) {
            a = __shfl_sync(kFull, v[0], 8 * (lane & 3));
            b = __shfl_sync(kFull, v[0], 8 * (lane & 1) + 16);
        } else {
            if ((lane & 7) == 0) part[par][warp][lane >> 3] = v[0];
            group_barrier(rg, 32 * KW);
            a = 0.f, b = 0.f;
            if (kw == 0) {
                for (int i = 0; i < KW; ++i) {
                    a += part[par][rg * KW + i][lane & 3];
                    b += part[par][rg * KW + i][(lane & 1) + 2];
                }
            }
            par ^= 1;
        }
        if (kw != 0) return;
        const int g = bi * RG + rg;
        if (!swiglu) {
            const int n = kRows * g + lane;
            if (lane < kRows && n < N) {
                float val = a * inv;
                if (row_scale) val *= rs;
                y[n] = mode == 1 ? yv + val : val;
            }
        } else {
            const int j = 16 * (g >> 3) + 2 * (g & 7) + lane;
            if (lane < 2 && j < N / 2) y[j] = siluf_(a * inv) * (b * inv);
        }
    };

    auto consume = [&](const Tile<DM>& T, int bi, int t) {
        // add mode, a task's last tile: the old y, loaded now and used after this tile's decode (it is in L2:
        // the residual stream was just written) -- a register held across the decode, not across the tiles
        float yv = 0.f;
        if (mode == 1 && kw == 0 && lane < kRows && t == S - 1) {
            const int n = kRows * (bi * RG + rg) + lane;
            if (n < N) yv = y[n];  // a plain load: y is written by this kernel (by this lane only)
        }
        const int ub = (t * KW + kw) * D * 32 + lane;
#pragma unroll
        for (int d = 0; d < DM; ++d) {
            const int u = ub + 32 * d;
            if (d < D && u < nu) {
                const int le = u * EU;
                compute_unit<BITS, 1, USE_P>(T.u[d], xs + (le >> 5) * 36 + (le & 31), acc);
            }
        }
        if (t == S - 1) finish(bi, yv);
    };

    // Ping-pong: consume one register tile, refill it with the tile two ahead, then the same with the other.
    int cbi = blockIdx.x, ct = 0;  // the next tile to consume
    while (true) {
        consume(A, cbi, ct);
        advance(cbi, ct);
        if (ibi < BI) issue(A, ibi, it);
        advance(ibi, it);
        prefetch_ahead();
        if (cbi >= BI) break;
        consume(B, cbi, ct);
        advance(cbi, ct);
        if (ibi < BI) issue(B, ibi, it);
        advance(ibi, it);
        prefetch_ahead();
        if (cbi >= BI) break;
    }
}

// Embedding gather: one thread per 32-element chunk of row ids[m]; out-of-range ids give NaN rows.
template <int BITS, int G>
__device__ __forceinline__ void embed_body(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                           const uint8_t* __restrict__ sc, const int* __restrict__ ids,
                                           float* __restrict__ out, int V, int K, int kp) {
    const int m = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= K / 32) return;
    const int id = __ldg(ids + m);
    float w[32];
    if (id < 0 || id >= V) {
#pragma unroll
        for (int e = 0; e < 32; ++e) w[e] = __int_as_float(0x7FC00000);
    } else if constexpr (BITS == 16) {
        bf16_chunk32(reinterpret_cast<const uint16_t*>(qs) + (long long)id * K, c, w);
    } else {
        const QRow row = q_row<BITS>(qs, qh, reinterpret_cast<const __half*>(sc), id, kp, G);
        q_chunk32<BITS>(row, c, w);
        const float s = q_scale<G>(row, c);
#pragma unroll
        for (int e = 0; e < 32; ++e) w[e] *= s;  // exact: an fp16 scale times an 8-bit code fits fp32
    }
    float* o = out + (long long)m * K + 32 * c;
    if ((reinterpret_cast<uintptr_t>(o) & 15) == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            reinterpret_cast<float4*>(o)[i] = make_float4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    } else {
#pragma unroll
        for (int e = 0; e < 32; ++e) o[e] = w[e];
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

// Entry points per code width (the group size is a runtime shift): gemv_q{4,5,6,8}_m{M}, gemv_bf16_m{M}.
// Blocks per SM for the register budget: 4 (64 registers) at M = 1, 3 at M = 2, 2 above (more accumulators).
#define NINFER_GEMV_M(name, BITS, M)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, M == 1 ? 4 : M == 2 ? 3 : 2)                        \
        gemv_##name##_m##M(NINFER_GEMV_ARGS) { ninfer_pdl_begin();                                                             \
        gemv_body<BITS, M>(NINFER_GEMV_PASS);                                                              \
    }
#define NINFER_GEMV(name, BITS)                                                                            \
    NINFER_GEMV_M(name, BITS, 1) NINFER_GEMV_M(name, BITS, 2) NINFER_GEMV_M(name, BITS, 3)                 \
    NINFER_GEMV_M(name, BITS, 4) NINFER_GEMV_M(name, BITS, 5) NINFER_GEMV_M(name, BITS, 6)                 \
    NINFER_GEMV_M(name, BITS, 7) NINFER_GEMV_M(name, BITS, 8)
// The M = 1 stream kernels gemv_{q4,q5,q6,q8,bf16}_s1: the same arguments (ldy and ks unused), then d, the
// units per lane and row of one register tile (1..StreamDepth), and pf, how many tiles ahead of the register
// tiles L2 is asked for (0: none). 2 blocks per SM: 128 registers hold two tiles.
#define NINFER_GEMV_S1(name, BITS)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1(NINFER_GEMV_ARGS, int d, int pf) {                                                \
        gemv_stream_body<BITS>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift, ldx, mode, eps,      \
                               kw_log2, xvec, d, pf);                                                      \
    }
#define NINFER_EMBED(name, BITS, G)                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                                      \
        embed_##name(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,                       \
                     const uint8_t* __restrict__ sc, const int* __restrict__ ids, float* __restrict__ out, \
                     int V, int K, int kp) { ninfer_pdl_begin();                                                               \
        embed_body<BITS, G>(qs, qh, sc, ids, out, V, K, kp);                                               \
    }

NINFER_GEMV(q4, 4)
NINFER_GEMV(q5, 5)
NINFER_GEMV(q6, 6)
NINFER_GEMV(q8, 8)
NINFER_GEMV(bf16, 16)
NINFER_GEMV_S1(q4, 4)
NINFER_GEMV_S1(q5, 5)
NINFER_GEMV_S1(q6, 6)
NINFER_GEMV_S1(q8, 8)
NINFER_GEMV_S1(bf16, 16)
NINFER_QFORMATS(NINFER_EMBED)
NINFER_EMBED(bf16, 16, 32)
