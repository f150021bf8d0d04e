// gemv_stream.cu: the persistent, register-pipelined decode GEMV for M = 1 (gemv_<code>_s1), used when all of
// x̂ fits one shared-memory slab (K <= 10240 / 18688). Semantics, layouts and reference ops: as gemv.cu (y = W x̂
// with the fused RMSNorm, store / add / SwiGLU epilogues); tested with it in tests/gpu/test_linear.py.
#include "gemv.cuh"

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

namespace {

template <int BITS>
struct StreamDepth {
    static constexpr int value = (BITS == 5 || BITS == 6) ? 1 : 2;
};

template <int DM>
struct Tile {
    Unit u[DM][kRows];
};

// Stage x̂ = x (· (1 + norm_w)) of one row, all K, as gemv_body's float4 staging does (fp32 chunks or int16
// chunk records by XQ), but with every load of up to 4096 elements in flight together; ssred[warp][0] = the
// warp's Σ x² (norm only).
template <int XQ>
__device__ __forceinline__ void stage_m1_vec(void* xs, const float* __restrict__ x,
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
            if constexpr (XQ != 0)
                store_codes4<1, XQ>(reinterpret_cast<uint8_t*>(xs) + (e >> 5) * qchunk_bytes(1), 0, e & 31, h, on);
            else if (on)
                *reinterpret_cast<float4*>(reinterpret_cast<float*>(xs) + (e >> 5) * 36 + (e & 31)) = h;
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
    extern __shared__ float4 smem4[];  // [K / 32 chunks]: 36 floats (bf16 weights) or qchunk_bytes(1) bytes
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

    if (xvec) stage_m1_vec<F::XQ>(smem4, x, norm_w, K, ssred);
    else stage_slab<1, F::XQ>(smem4, x, ldx, norm_w, 0, K, false, ssred);
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
                const uint8_t* xb = reinterpret_cast<const uint8_t*>(smem4);
                if constexpr (F::XQ != 0)
                    compute_unit_q<BITS, 1, kRows>(T.u[d], xb + (le >> 5) * qchunk_bytes(1), (le >> 4) & 1, acc);
                else
                    compute_unit_bf16<1>(T.u[d], reinterpret_cast<const float*>(xb) + (le >> 5) * 36 + (le & 31), acc);
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

}  // namespace

// The M = 1 stream kernels gemv_{q4,q5,q6,q8,bf16}_s1: the same arguments (ldy and ks unused), then d, the
// units per lane and row of one register tile (1..StreamDepth), and pf, how many tiles ahead of the register
// tiles L2 is asked for (0: none). 2 blocks per SM: 128 registers hold two tiles.
#define NINFER_GEMV_S1(name, BITS)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1(NINFER_GEMV_ARGS, int d, int pf) {                                                \
        gemv_stream_body<BITS>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift, ldx, mode, eps,      \
                               kw_log2, xvec, d, pf);                                                      \
    }

NINFER_GEMV_S1(q4, 4)
NINFER_GEMV_S1(q5, 5)
NINFER_GEMV_S1(q6, 6)
NINFER_GEMV_S1(q8, 8)
NINFER_GEMV_S1(bf16, 16)
