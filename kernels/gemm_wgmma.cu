// gemm_wgmma.cu: the prefill GEMM of gemm.cu on Hopper's warpgroup MMA and tensor-memory copies (sm_90a only).
//
//   gemm_wgmma_<fmt>, moe_gemm_wgmma_<fmt>: the operations, epilogues and grids of gemm_<fmt> / moe_gemm_<fmt> in
//   gemm.cu (reference: x @ W.T, ops.swiglu_mlp, ops.moe), on tiles of 256 weight rows × 128 x rows.
//
// Layouts: x, y and the weight planes as gemm.cu, plus TMA descriptors (CUtensorMap, 128 bytes, by value; gemm.py
// encodes them): tmw over the qs plane (bf16 data for bf16 weights) as uint8 [rows, row bytes], box 256 rows × 64 k;
// tmx (dense only) over x as bf16 [M, K] with row pitch ldx, box 128 rows × 64 k, 128-byte swizzle.
//
// Method: 512 threads = 4 warpgroups, each 64 weight rows × 128 x rows of fp32 accumulators in registers (wgmma
// m64n128k16; m64n64 when a grouped tile holds <= 64 rows). A = the weights, decoded from the staged planes into
// registers in the MMA's k order as RN(q · s) in bf16 (wgmma.cuh); B = x, read by the MMA from shared memory.
//   * Stages of 64 k. Thread 0 starts the TMA copies of a stage (qs, and x when dense) on the stage's mbarrier;
//     q5/q6 high bits and a grouped launch's gathered x rows go by cp.async; scales through registers, as gemm.cu.
//   * Software pipeline: while stage kt's wgmmas run, the warps decode stage kt + 1 into a second register set; one
//     block barrier per stage frees the stage read two steps back for stage kt + S - 1.
//   * Warp q's MMA rows g and g + 8 are weight rows 32(q>>1) + 8(q&1) + g and that + 16 of the tile: a gate row and
//     its up row (interleave of 16 in 32, docs/format.md), so SwiGLU pairs them in registers.
// Dequantized path (gemm_wgmma_dequant_<fmt>, then gemm_wgmma_ss; reference and epilogues as gemm_wgmma_<fmt>): one
// pass writes the weight as bf16 RN(q · s) into a scratch, rows in dq_row order; then both operands go by TMA and
// every wgmma reads both from shared memory, so a stage costs each thread a few instructions instead of a decode.
// Numerics: every quantized format as RN(q · s) in bf16 (relative error <= 2^-8 per weight; gemm.cu keeps nibble
// codes exact), x in bf16, fp32 sums; swiglu rounds its output to bf16.
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace {

constexpr int WBN = 256, WBM = 128, WNT = 512;    // weight rows, x rows, threads per tile
constexpr int ALIGN = 1024;                        // the swizzled x tile's alignment
constexpr int BAR_BYTES = 64, ROW_BYTES = WBM * 12;

// Per format (BITS 4, 5, 6, 8; 16 = raw bf16): one stage = x [128 rows][128 B] (swizzled), qs [256 rows][2 chunks],
// then per chunk qh [256][QH] and fp32 scales [256]; as many stages as fit 200 KB (one block per SM), up to 8.
// gemm.py mirrors SMEM (smem_bytes); the kernel traps if it is given less.
template <int BITS>
struct WT {
    static constexpr bool SCALED = BITS != 16;
    static constexpr int QS = BITS == 16 ? 64 : (BITS == 8 ? 32 : 16);  // qs bytes of a row's 32-wide chunk
    static constexpr int QH = BITS == 5 ? 4 : (BITS == 6 ? 8 : 0);
    static constexpr int X_BYTES = WBM * 128;
    static constexpr int QS_BYTES = WBN * 2 * QS;
    static constexpr int QH_BYTES = WBN * QH;               // per chunk
    static constexpr int SC_BYTES = SCALED ? WBN * 4 : 0;   // per chunk
    static constexpr int RAW = X_BYTES + QS_BYTES + 2 * (QH_BYTES + SC_BYTES);
    static constexpr int STAGE = (RAW + ALIGN - 1) / ALIGN * ALIGN;
    static constexpr int FIT = (200 * 1024 - ALIGN - BAR_BYTES - ROW_BYTES) / STAGE;
    static constexpr int STAGES = FIT < 8 ? FIT : 8;
    static constexpr int SMEM = ALIGN + STAGES * STAGE + BAR_BYTES + ROW_BYTES;
    static_assert(STAGES >= 3, "the pipeline refills the stage of tile kt - 1 while tile kt + 1 is read");
};

// The epilogue of a tile: d[4j + c] is (weight row n0 + ra + 16(c>>1), tile row 8j + 2t + (c&1)), ra the weight row
// of warp q's MMA row g (wg_tile); rid as tile_rows wrote it.
__device__ __forceinline__ void wg_store(const float (&d)[64], const int* rid, int n0, int N, float* __restrict__ y,
                                         int ldy, const float* __restrict__ row_scale, int ydiv, int mode) {
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const int ra = 32 * (warp >> 1) + 8 * (warp & 1) + g;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int cm = 0; cm < 2; ++cm) {
            const int id = rid[8 * j + 2 * t + cm];
            if (id < 0) continue;
            const size_t yo = (size_t)(id / ydiv) * ldy;
            if (mode == MODE_SWIGLU) {
                const int nb = n0 + 32 * (warp >> 1);  // the 32-row block of ra: gate rows, then up rows
                if (nb < N) store_act(y, yo + nb / 2 + 8 * (warp & 1) + g, d[4 * j + cm], d[4 * j + 2 + cm]);
                continue;
            }
            const float rs = row_scale ? row_scale[id] : 1.f;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (n0 + ra + 16 * h < N) store_out(mode, y + yo, n0 + ra + 16 * h, rs * d[4 * j + 2 * h + cm]);
        }
}

template <int BITS, int GROUP, bool XTMA>
__device__ __forceinline__ void wg_tile(const TmaDesc* tmw, const TmaDesc* tmx, const uint8_t* __restrict__ qh,
                                        const __half* __restrict__ sc, int kp, long long w0, int N, int K, int ntile,
                                        const uint16_t* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
                                        const float* __restrict__ row_scale, const int* __restrict__ rows, int count,
                                        int m0, int xdiv, int ydiv, int mode) {
    using T = WT<BITS>;
    constexpr int S = T::STAGES;
    extern __shared__ __align__(16) uint8_t smem[];
    require_dynamic_smem(T::SMEM);
    const uint32_t s0 = smem_addr(smem);
    uint8_t* stages = smem + (((s0 + ALIGN - 1) & ~(uint32_t)(ALIGN - 1)) - s0);
    uint64_t* bars = reinterpret_cast<uint64_t*>(stages + S * T::STAGE);
    long long* xoff = reinterpret_cast<long long*>(stages + S * T::STAGE + BAR_BYTES);  // x row offset, -1: none
    int* rid = reinterpret_cast<int*>(xoff + WBM);                                      // row id, -1: none
    const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;
    const int n0 = ntile * WBN, KC = K / 32, KT = (KC + 1) / 2;

    tile_rows(rid, xoff, rows, count, m0, xdiv, ldx, WBM);
    if (tid == 0) {
        for (int s = 0; s < S; ++s) mbar_init(smem_addr(bars + s), 1);
        mbar_init_fence();
    }
    __syncthreads();

    auto stage = [&](int s) { return stages + s * T::STAGE; };
    auto qh_at = [&](int s, int c) { return stage(s) + T::X_BYTES + T::QS_BYTES + c * T::QH_BYTES; };
    auto sc_at = [&](int s, int c) {
        return reinterpret_cast<float*>(stage(s) + T::X_BYTES + T::QS_BYTES + 2 * T::QH_BYTES + c * T::SC_BYTES);
    };
    auto scale_of = [&](int c) -> float {  // this thread's row's scale of chunk c (threads < 256)
        if (!T::SCALED || tid >= WBN || n0 + tid >= N || c >= KC) return 0.f;
        const unsigned short* p = reinterpret_cast<const unsigned short*>(sc) + (size_t)(w0 + n0 + tid) * (kp / GROUP);
        return __half2float(__ushort_as_half(__ldg(p + (c * 32) / GROUP)));
    };
    // stage kt into slot s: TMA for qs (and dense x), cp.async for qh and gathered x rows
    auto load = [&](int kt, int s) {
        const int nc = min(2, KC - 2 * kt);
        const uint32_t bar = smem_addr(bars + s);
        if (tid == 0) {
            mbar_expect_tx(bar, T::QS_BYTES + (XTMA ? T::X_BYTES : 0));
            tma_load_2d(smem_addr(stage(s) + T::X_BYTES), tmw, kt * 2 * T::QS, (int)(w0 + n0), bar);
            if constexpr (XTMA) tma_load_2d(smem_addr(stage(s)), tmx, kt * 64, m0, bar);
        }
        if constexpr (!XTMA) {
#pragma unroll
            for (int i = 0; i < WBM * 8 / WNT; ++i) {  // 16-byte unit u of row r; k beyond the last chunk read as 0
                const int p = tid + WNT * i, r = p >> 3, u = p & 7;
                const long long off = xoff[r];
                const bool ok = off >= 0 && 2 * kt + (u >> 2) < KC;
                cp_async16(smem_addr(stage(s) + wg_x_offset(r, u)), x + (ok ? off + kt * 64 + 8 * u : 0), ok);
            }
        }
        if constexpr (T::QH > 0) {
            const int hrow = tid - (WNT - WBN);
            const bool ok = n0 + hrow < N;
#pragma unroll
            for (int c = 0; c < 2; ++c)
                if (hrow >= 0 && c < nc)
                    cp_async_small<T::QH>(smem_addr(qh_at(s, c) + hrow * T::QH),
                                          qh + (ok ? (size_t)(w0 + n0 + hrow) * ((size_t)kp * (BITS - 4) / 8) +
                                                         (size_t)(2 * kt + c) * T::QH : 0), ok);
        }
    };
    float sc_next[2];
    auto put_scales = [&](int s, const float (&v)[2]) {
        if (T::SCALED && tid < WBN) sc_at(s, 0)[tid] = v[0], sc_at(s, 1)[tid] = v[1];
    };

    // ---- prologue: stages 0..S-2 in flight; the scales of the stage copied next wait in registers
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < KT) {
            const float v[2] = {scale_of(2 * s), scale_of(2 * s + 1)};
            put_scales(s, v);
            load(s, s);
        }
        cp_async_commit();
    }
    sc_next[0] = scale_of(2 * (S - 1)), sc_next[1] = scale_of(2 * (S - 1) + 1);

    // Refill the stage read two steps ago with stage kt + S - 1.
    auto refill = [&](int kt) {
        const int nt = kt + S - 1;
        if (nt < KT) {
            put_scales(nt % S, sc_next);
            load(nt, nt % S);
        }
        cp_async_commit();
        sc_next[0] = scale_of(2 * (nt + 1)), sc_next[1] = scale_of(2 * (nt + 1) + 1);
    };

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    const int ra = 32 * (warp >> 1) + 8 * (warp & 1) + g;  // the weight row of MMA row g (tile-local)
    const bool n64 = count - m0 <= 64;                      // the tile's rows fit m64n64 (a grouped tile's tail)
    using Frag = uint32_t[4][4];                            // [16-wide k slice][A register]
    Frag fa, fb;
    auto decode = [&](int kt, Frag& af) {
        const int s = kt % S;
        mbar_wait(smem_addr(bars + s), (kt / S) & 1);  // the stage's TMA copies have landed
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            if (2 * kt + c >= KC) break;
            const uint8_t* wq = stage(s) + T::X_BYTES + c * T::QS;
            const float* scs = sc_at(s, c);
            uint32_t pa[4], pb[4];
            wg_decode<BITS>(wq, 2 * T::QS, qh_at(s, c), ra, t, T::SCALED ? scs[ra] : 1.f, pa);
            wg_decode<BITS>(wq, 2 * T::QS, qh_at(s, c), ra + 16, t, T::SCALED ? scs[ra + 16] : 1.f, pb);
#pragma unroll
            for (int h = 0; h < 2; ++h)
                af[2 * c + h][0] = pa[2 * h], af[2 * c + h][1] = pb[2 * h], af[2 * c + h][2] = pa[2 * h + 1],
                af[2 * c + h][3] = pb[2 * h + 1];
        }
    };
    // one straight run of wgmmas per case: a register write or branch between them makes ptxas fence each
    auto issue = [&](int kt, const Frag& af) {
        const uint32_t x0 = smem_addr(stage(kt % S));
        const int ns = 2 * min(2, KC - 2 * kt);
        wg_fence();
        if (n64) wg_issue<64>(d, af, x0, ns);
        else wg_issue<128>(d, af, x0, ns);
        wg_commit();
    };
    // after issuing stage kt: stage kt + 1 has landed and stage kt - 1's wgmmas are done (every warpgroup's, past
    // the barrier), so its slot takes stage kt + S - 1 and its register set stage kt + 1
    auto advance = [&](int kt) {
        wg_wait<1>();
        cp_async_wait<S - 3>();
        fence_proxy_async();  // this thread's cp.async copies are visible to wgmma's reads
        __syncthreads();
        refill(kt);
    };

    cp_async_wait<S - 2>();
    fence_proxy_async();
    __syncthreads();
    decode(0, fa);
    for (int kt = 0; kt < KT; kt += 2) {  // two stages a turn: the register sets are named, not indexed
        issue(kt, fa);
        advance(kt);
        if (kt + 1 >= KT) break;
        decode(kt + 1, fb);
        issue(kt + 1, fb);
        advance(kt + 1);
        if (kt + 2 < KT) decode(kt + 2, fa);
    }
    wg_wait<0>();
    wg_pin(d, 64);
    cp_async_wait<0>();

    wg_store(d, rid, n0, N, y, ldy, row_scale, ydiv, mode);
}

// ------------------------------------------------------------------------------------------------ dequantized path

// A dense GEMM whose weights were dequantized to bf16 (gemm_wgmma_dequant_<fmt>): both operands by TMA into
// 128-byte swizzled tiles, and every wgmma reads both from shared memory, so a stage costs each thread a barrier
// wait, 4 wgmma issues and one block barrier. One stage: x [128 rows][128 B], then A [256 rows][128 B].
constexpr int SS_A = WBN * 128, SS_X = WBM * 128, SS_STAGE = SS_A + SS_X;
constexpr int SS_STAGES = (200 * 1024 - ALIGN - BAR_BYTES - ROW_BYTES) / SS_STAGE;
constexpr int SS_SMEM = ALIGN + SS_STAGES * SS_STAGE + BAR_BYTES + ROW_BYTES;  // gemm.py ss_smem_bytes
static_assert(SS_STAGES >= 3, "the pipeline refills the stage of tile kt - 1 while tile kt + 1 is read");

// Scratch row p holds weight row dq_row(p): bits 3 and 4 of p swapped, so that warpgroup MMA row 16w + g + 8h of a
// 64-row slice (what an A tile in shared memory gives warp w) is the weight row ra + 16h wg_store expects: a gate row
// and its up row (interleave of 16 in 32) meet in one thread. An involution: the inverse is itself.
__device__ __forceinline__ int dq_row(int p) { return (p & ~0x18) | ((p & 8) << 1) | ((p >> 1) & 8); }

__device__ __forceinline__ void wg_tile_ss(const TmaDesc* tmw, const TmaDesc* tmx, int N, int K, int ntile,
                                           float* __restrict__ y, int ldy, const float* __restrict__ row_scale,
                                           int M, int m0, int mode) {
    constexpr int S = SS_STAGES;
    extern __shared__ __align__(16) uint8_t smem[];
    require_dynamic_smem(SS_SMEM);
    const uint32_t s0 = smem_addr(smem);
    uint8_t* stages = smem + (((s0 + ALIGN - 1) & ~(uint32_t)(ALIGN - 1)) - s0);
    uint64_t* bars = reinterpret_cast<uint64_t*>(stages + S * SS_STAGE);
    long long* xoff = reinterpret_cast<long long*>(stages + S * SS_STAGE + BAR_BYTES);
    int* rid = reinterpret_cast<int*>(xoff + WBM);
    const int tid = threadIdx.x, n0 = ntile * WBN, KT = (K + 63) / 64;

    tile_rows(rid, xoff, nullptr, M, m0, 1, 0, WBM);
    if (tid == 0) {
        for (int s = 0; s < S; ++s) mbar_init(smem_addr(bars + s), 1);
        mbar_init_fence();
    }
    __syncthreads();
    // stage kt into slot s (thread 0); k beyond K reads as zero in both operands
    auto load = [&](int kt, int s) {
        const uint32_t bar = smem_addr(bars + s), st = smem_addr(stages + s * SS_STAGE);
        mbar_expect_tx(bar, SS_STAGE);
        tma_load_2d(st, tmx, kt * 64, m0, bar);
        tma_load_2d(st + SS_X, tmw, kt * 64, n0, bar);
    };
    if (tid == 0)
        for (int s = 0; s < S - 1 && s < KT; ++s) load(s, s);

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    const uint32_t a_off = SS_X + (tid >> 7) * 64 * 128;  // this warpgroup's 64 weight rows
    for (int kt = 0; kt < KT; ++kt) {
        const int s = kt % S;
        const uint32_t xs = smem_addr(stages + s * SS_STAGE);
        mbar_wait(smem_addr(bars + s), (kt / S) & 1);
        wg_fence();
#pragma unroll
        for (int h = 0; h < 4; ++h) wgmma_ss_n128(d, wg_desc(xs + a_off, h), wg_desc(xs, h));
        wg_commit();
        wg_wait<1>();     // this warpgroup's wgmmas of stage kt - 1 are done ...
        __syncthreads();  // ... and every warpgroup's: its slot takes stage kt + S - 1
        if (tid == 0 && kt + S - 1 < KT) load(kt + S - 1, (kt + S - 1) % S);
    }
    wg_wait<0>();
    wg_pin(d, 64);
    wg_store(d, rid, n0, N, y, ldy, row_scale, 1, mode);
}

// out row p (bf16 [rows, K], rows a multiple of 32) = RN(q · s) of weight row dq_row(p), zero past N: one thread per
// row and 8 consecutive k, decoded as the mma.sync tiles decode (gemm.cuh) and scaled as wg_decode scales, so the
// values are the ones the register path's MMAs take.
template <int BITS, int GROUP>
__device__ __forceinline__ void dequant_rows(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                             const __half* __restrict__ sc, int kp, int N, int K, int rows,
                                             uint16_t* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // (p, c, t): chunk c's k 8t..8t+7
    const int KC = K / 32, t = (int)(i & 3), c = (int)((i >> 2) % KC);
    const int p = (int)((i >> 2) / KC);
    if (p >= rows) return;
    const int r = dq_row(p);
    uint32_t a[4] = {0u, 0u, 0u, 0u};
    if (r < N) {
        constexpr int QS = WT<BITS>::QS, QH = WT<BITS>::QH;  // bytes of a row's 32-wide chunk in qs, qh
        const uint8_t* wq = qs + (size_t)r * ((size_t)kp * QS / 32) + (size_t)c * QS;
        const float s = __half2float(sc[(size_t)r * (kp / GROUP) + (c * 32) / GROUP]);
        if constexpr (BITS == 8) {
            decode_row_q8_scaled(wq, 0, t, s, a);
        } else {
            decode_row<BITS>(wq, QH ? qh + (size_t)r * ((size_t)kp * QH / 32) + (size_t)c * QH : nullptr, 0, t, a);
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] = scale_pair(a[j], s);
        }
    }
    *reinterpret_cast<uint4*>(out + (size_t)p * K + c * 32 + 8 * t) = make_uint4(a[0], a[1], a[2], a[3]);
}

}  // namespace

// Dense: grid (ceil(N / 256), ceil(M / 128)), block 512, dynamic smem WT<BITS>::SMEM; arguments as gemm_<fmt>
// (qs is read through tmw), then the two descriptors.
#define NINFER_GEMM_WG_DENSE(name, BITS, GROUP)                                                                   \
    extern "C" __global__ void __launch_bounds__(WNT, 1) gemm_wgmma_##name(                                      \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K, const uint16_t* x, int ldx, \
        float* y, int ldy, const float* row_scale, int M, int mode, const __grid_constant__ TmaDesc tmw,          \
        const __grid_constant__ TmaDesc tmx) {                                                                   \
        ninfer_pdl_begin();                                                                                       \
        wg_tile<BITS, GROUP, true>(&tmw, &tmx, qh, sc, kp, 0, N, K, blockIdx.x, x, ldx, y, ldy, row_scale, nullptr, \
                                   M, blockIdx.y * WBM, 1, 1, mode);                                              \
    }

// Grouped (moe_gemm_<fmt>'s arguments and grid with 256-row N tiles), then tmw over the whole bank [E·N rows].
#define NINFER_GEMM_WG_MOE(name, BITS, GROUP)                                                                     \
    extern "C" __global__ void __launch_bounds__(WNT, 1) moe_gemm_wgmma_##name(                                  \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K, const uint16_t* x, int ldx, \
        float* y, int ldy, const float* row_scale, const int* order, const int* offsets, const int* tile_start,   \
        int E, int xdiv, int ydiv, int mode, const __grid_constant__ TmaDesc tmw) {                              \
        ninfer_pdl_begin();                                                                                       \
        GroupTile gt;                                                                                             \
        if (!group_tile(offsets, tile_start, E, blockIdx.y, WBM, gt)) return;                                     \
        wg_tile<BITS, GROUP, false>(&tmw, nullptr, qh, sc, kp, (long long)gt.e * N, N, K, blockIdx.x, x, ldx, y,   \
                                    ldy, row_scale, order + gt.first, gt.count, gt.m0, xdiv, ydiv, mode);        \
    }

NINFER_QFORMATS(NINFER_GEMM_WG_DENSE)
NINFER_GEMM_WG_DENSE(bf16, 16, 32)
NINFER_QFORMATS(NINFER_GEMM_WG_MOE)
NINFER_GEMM_WG_MOE(bf16, 16, 32)
// Dequantized path: gemm_wgmma_dequant_<fmt>(qs, qh, sc, kp, N, K, rows, out), grid ceil(rows · K/8 / 256), block
// 256; then gemm_wgmma_ss(N, K, y, ldy, row_scale, M, mode, tmw, tmx): grid (ceil(N / 256), ceil(M / 128)),
// block 512, dynamic smem SS_SMEM; tmw over out as bf16 [rows, K], box 256 rows × 64 k, 128-byte swizzle.
#define NINFER_GEMM_WG_DEQUANT(name, BITS, GROUP)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gemm_wgmma_dequant_##name(                                 \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K, int rows, uint16_t* out) {  \
        ninfer_pdl_begin();                                                                                       \
        dequant_rows<BITS, GROUP>(qs, qh, sc, kp, N, K, rows, out);                                               \
    }
NINFER_QFORMATS(NINFER_GEMM_WG_DEQUANT)

extern "C" __global__ void __launch_bounds__(WNT, 1) gemm_wgmma_ss(int N, int K, float* y, int ldy,
                                                                   const float* row_scale, int M, int mode,
                                                                   const __grid_constant__ TmaDesc tmw,
                                                                   const __grid_constant__ TmaDesc tmx) {
    ninfer_pdl_begin();
    wg_tile_ss(&tmw, &tmx, N, K, blockIdx.x, y, ldy, row_scale, M, blockIdx.y * WBM, mode);
}
#endif
