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
//   block kernels, mode 0 with amax (uint64 [9]): also out[m] = argmax_{n < V} y[m, n] (argmax_publish; ties to
//   the lowest n, NaN as -inf: ninfer_rt.gpu.misc.argmax's result, torch.argmax's on finite rows)
// Reference ops: ninfer_rt.reference.ops.rms_norm_zc, x @ W.T, swiglu_mlp's silu(g)·u, embed_tokens[ids];
// weights decode as ninfer_rt.formats.IntFormat.decode (w = fp16 scale · code, exact in fp32).
//
// Work split (GEMV). A block is 8 warps; a warp owns 4 weight rows (a "row group") and each lane reads one
// 16-byte unit of all 4 rows per step (32 codes of q4/5/6, 16 of q8, 8 of bf16): coalesced 16-byte loads, and
// each x̂ value read from shared memory serves 4 rows. KW = 1/2/4/8 warps of a block may split the units of one
// row group (short N, long K); the block sums them in shared memory, so each output has exactly one writer.
// x̂ is staged in shared memory in K slabs of `ks` elements (under the 48 KB default), per 32-element chunk.
// The norm is linear in the dot product: slabs hold x·(1 + norm_w), and rsqrt(mean x²) is applied at the end.
//
// M = 1 with all of x̂ in one slab (K <= 10240 for bf16 weights, 18688 for quantized) has its own persistent,
// register-pipelined kernel: gemv_*_s1 (gemv_stream.cu).
//
// Arithmetic. Quantized weights (q4/5/6/8) take integer dot products: x̂ is staged as int16 codes per chunk,
// q = rint(x̂ / d) with d a power of two from the chunk's largest |x̂| (xcodes.cuh chunk_scale: every element
// errs by at most 2^-14 of that largest value; bf16, which the prefill GEMMs read, errs by 2^-8 of each
// element), and the weight codes meet them in dp2a instructions (two int16 x two int8 products each, exact
// in int32). Per unit and row one scale: s_w · d · (Σ u q - 2^(b-1) Σ q) for the nibble formats (u = code +
// 2^(b-1); Σ q is staged with the chunk), s_w · d · Σ code · q for q8. llama.cpp's MMVQ quantizes x the same
// way, to int8. bf16 weights (router, DeltaNet b|a) keep fp32 x̂ (chunks of 36 floats per row) and fmas.
// Reference: ninfer_rt.reference.ops.act_codes16 (the staged codes; the tests' oracle is y = W (d · q)).
#include "gemv.cuh"

namespace {

// The arg-max epilogue (mode store, amax != null): y's rows n < amax_v of each row m also pass through one 64-bit
// key (argmax_key) to amax[m] by atomicMax, and the block that takes the last ticket (amax[8]'s low word) writes
// out[m] = the best index and leaves amax zero for the next launch: misc.argmax's result with no launch of its
// own (the lm_head's decode draw). Keys order by the value (NaN as -inf, -0 as +0), then the lowest index, as
// torch.argmax (ties -> lowest index). amax: uint64 [9], zero before the first launch.
__device__ __forceinline__ unsigned long long argmax_key(float v, int n) {
    unsigned u = is_nan_bits(v) ? 0xff800000u : __float_as_uint(v == 0.f ? 0.f : v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // IEEE order as unsigned order
    return (unsigned long long)u << 32 | (0xffffffffu - (unsigned)n);
}

__device__ __forceinline__ void argmax_publish(unsigned long long* amax, int* out, const unsigned long long* s_key,
                                               int M) {
    __shared__ bool s_last;
    __syncthreads();  // every key of the block is in s_key
    if (threadIdx.x < M) atomicMax(amax + threadIdx.x, s_key[threadIdx.x]);
    __threadfence();  // the keys before the ticket: whoever takes the last ticket sees them all
    __syncthreads();
    unsigned* ticket = reinterpret_cast<unsigned*>(amax + 8);
    if (threadIdx.x == 0) s_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (threadIdx.x < M) out[threadIdx.x] = (int)(0xffffffffu - (unsigned)atomicExch(amax + threadIdx.x, 0ull));
    if (threadIdx.x == 0) atomicExch(ticket, 0u);
}

template <int BITS, int M>
__device__ __forceinline__ void gemv_body(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                          const uint8_t* __restrict__ sc, const float* __restrict__ x,
                                          float* y, const float* __restrict__ norm_w,
                                          const float* __restrict__ row_scale, int N, int K, int kp, int gshift,
                                          int ldx, int ldy, int mode, float eps, int kw_log2, int ks, int xvec,
                                          unsigned long long* amax, int* amax_out, int amax_v) {
    using F = Fmt<BITS>;
    constexpr int EU = F::EU;
    constexpr int CS = chunk_stride(M), CB = qchunk_bytes(M);
    constexpr int NV = next_pow2(kRows * M);
    extern __shared__ float4 smem4[];  // [ks / 32 chunks]: CS floats (bf16 weights) or CB bytes (quantized)
    __shared__ float red[kWarps][32];
    __shared__ float ssred[kWarps][8];
    __shared__ unsigned long long s_key[8];  // the arg-max epilogue: this block's best key of each row m

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
        stage_slab<M, F::XQ>(smem4, x, ldx, norm_w, k0, kn, xvec != 0, ssred);
        __syncthreads();
        if (M > 4 && u < ue) rows.load(A, u);
        while (u < ue) {
            const int le = (u - ub) * EU;
            if constexpr (F::XQ != 0)
                compute_unit_q<BITS, M, kRows>(A, reinterpret_cast<const uint8_t*>(smem4) + (le >> 5) * CB,
                                               (le >> 4) & 1, acc);
            else
                compute_unit_bf16<M>(A, reinterpret_cast<const float*>(smem4) + (le >> 5) * CS + (le & 31), acc);
            u += us;
            if (u < ue) rows.load(A, u);
        }
    }

    if (amax && tid < M) s_key[tid] = 0ull;  // ordered before its atomics by the barrier below
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
                if (amax && n < amax_v) atomicMax(s_key + m, argmax_key(v, n));
            }
        }
        if (amax) argmax_publish(amax, amax_out, s_key, M);
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

// Entry points per code width (the group size is a runtime shift): gemv_q{4,5,6,8}_m{M}, gemv_bf16_m{M}.
// Blocks per SM for the register budget: 4 (64 registers) at M = 1, 2 above (more accumulators and the
// decoded weight words of compute_unit_q).
#define NINFER_GEMV_M(name, BITS, M)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, M == 1 ? 4 : 2)                                      \
        gemv_##name##_m##M(NINFER_GEMV_ARGS, unsigned long long* amax, int* amax_out, int amax_v) {        \
        ninfer_pdl_begin();                                                                                \
        gemv_body<BITS, M>(NINFER_GEMV_PASS, amax, amax_out, amax_v);                                      \
    }
#define NINFER_GEMV(name, BITS)                                                                            \
    NINFER_GEMV_M(name, BITS, 1) NINFER_GEMV_M(name, BITS, 2) NINFER_GEMV_M(name, BITS, 3)                 \
    NINFER_GEMV_M(name, BITS, 4) NINFER_GEMV_M(name, BITS, 5) NINFER_GEMV_M(name, BITS, 6)                 \
    NINFER_GEMV_M(name, BITS, 7) NINFER_GEMV_M(name, BITS, 8)
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
NINFER_QFORMATS(NINFER_EMBED)
NINFER_EMBED(bf16, 16, 32)
