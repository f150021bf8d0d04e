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
//   * Persistent grid (one block per SM, gemm.py wg_grid) where a tile has at least S stages: a block takes every
//     gridDim-th tile, and its stage sequence runs on across tiles, so the next tile's copies are in flight during a
//     tile's last stages and its epilogue. Tile info and row ids sit in a ring of 3 (copying, computing, draining).
//   * Warp q's MMA rows g and g + 8 are weight rows 32(q>>1) + 8(q&1) + g and that + 16 of the tile: a gate row and
//     its up row (interleave of 16 in 32, docs/format.md), so SwiGLU pairs them in registers.
// Numerics: every quantized format as RN(q · s) in bf16 (relative error <= 2^-9 per weight; gemm.cu keeps nibble
// codes exact), x in bf16, fp32 sums; swiglu rounds its output to bf16.
#include "wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace {

constexpr int WBN = 256, WBM = 128, WNT = 512;    // weight rows, x rows, threads per tile
constexpr int ALIGN = 1024;                        // the swizzled x tile's alignment
constexpr int RING = 3;                            // tiles whose row ids are held: copying, computing, draining
constexpr int BAR_BYTES = 64, ROW_BYTES = RING * (16 + WBM * 4);

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

// n / d for n < 2^31 by one high multiply and a correction, d >= 1 fixed per launch (x and y row of a slot).
struct Div {
    uint32_t d, m;  // m = ceil(2^32 / d) for d >= 2
    __device__ explicit Div(int dv) : d((uint32_t)dv), m(dv > 1 ? 0xFFFFFFFFu / (uint32_t)dv + 1u : 0u) {}
    __device__ __forceinline__ int operator()(int n) const {
        if (d == 1) return n;
        uint32_t q = __umulhi((uint32_t)n, m);  // floor(n / d) or one more
        return (int)(q * d > (uint32_t)n ? q - 1 : q);
    }
};

// A launch's tiles: q = ntile + ntn · row tile (weight-row tiles fastest, so the blocks running together share x
// rows), over ntn · row_tiles tiles; block b takes tiles b, b + gridDim.x, ... (its tile j: q = b + j · gridDim.x).
// Tile info (int4): weight-row tile, expert, first slot (grouped: index into order; dense: x row), rows left from it.
struct Tiles {
    const int* order;    // grouped: slots by expert; null: dense (row r of a tile is x row first + r)
    const int4* table;   // grouped: per row tile {expert, first slot, rows left, 0} (moe_sort); null: dense
    int row_tiles, M;    // row tiles in the launch; dense: x rows
};

template <int BITS, int GROUP, bool XTMA>
__device__ __forceinline__ void wg_gemm(const TmaDesc* tmw, const TmaDesc* tmx, const uint8_t* __restrict__ qh,
                                        const __half* __restrict__ sc, int kp, int N, int K,
                                        const uint16_t* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
                                        const float* __restrict__ row_scale, Tiles tl, int xdiv, int ydiv, int mode) {
    using T = WT<BITS>;
    constexpr int S = T::STAGES;
    extern __shared__ __align__(16) uint8_t smem[];
    require_dynamic_smem(T::SMEM);
    const int ntn = (N + WBN - 1) / WBN, total = ntn * tl.row_tiles;
    if ((int)blockIdx.x >= total) return;
    const int J = (total - 1 - (int)blockIdx.x) / (int)gridDim.x + 1;  // this block's tiles
    const int KC = K / 32, KT = (KC + 1) / 2, G = J * KT;               // chunks, stages per tile, stages in all
    if (J > 1 && KT < S) __trap();  // the ring holds one tile ahead: gemm.py wg_grid gives such a tile a block
    const uint32_t s0 = smem_addr(smem);
    uint8_t* stages = smem + (((s0 + ALIGN - 1) & ~(uint32_t)(ALIGN - 1)) - s0);
    uint64_t* bars = reinterpret_cast<uint64_t*>(stages + S * T::STAGE);
    int4* tinfo = reinterpret_cast<int4*>(stages + S * T::STAGE + BAR_BYTES);  // [RING] tile info
    int* ids = reinterpret_cast<int*>(tinfo + RING);                            // [RING][128] row ids, -1: none
    const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3;

    // Tile j's info and row ids into ring slot j % RING (threads 0..127). Tile j's copies start in tile j - 1
    // (the launch is persistent only when KT >= S) and its epilogue ends before tile j + 3's prep.
    auto prep = [&](int j) {
        if (j >= J || tid >= WBM) return;
        const int q = blockIdx.x + j * gridDim.x, ty = q / ntn;
        int4 ti;
        if (tl.table) {
            const int4 v = __ldg(tl.table + ty);
            ti = make_int4(q - ty * ntn, v.x, v.y, v.z);
        } else {
            ti = make_int4(q - ty * ntn, 0, ty * WBM, tl.M - ty * WBM);
        }
        ids[(j % RING) * WBM + tid] = tid < ti.w ? (tl.order ? __ldg(tl.order + ti.z + tid) : ti.z + tid) : -1;
        if (tid == 0) tinfo[j % RING] = ti;
    };
    prep(0);
    prep(1);
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
    // Stage cursors (no divisions per stage): the next stage to copy, (tile lj, stage lkt, slot ls, global lg).
    int lj = 0, lkt = 0, ls = 0, lg = 0;
    const Div xd(xdiv), yd(ydiv);
    // this thread's row's scale of chunk c of the next stage to copy (threads < 256)
    auto scale_next = [&](int c) -> float {
        if (!T::SCALED || tid >= WBN || lg >= G) return 0.f;
        const int4 ti = tinfo[lj % RING];
        const int n = ti.x * WBN + tid, kc = 2 * lkt + c;
        if (n >= N || kc >= KC) return 0.f;
        const unsigned short* p =
            reinterpret_cast<const unsigned short*>(sc) + ((size_t)ti.y * N + n) * (size_t)(kp / GROUP);
        return __half2float(__ushort_as_half(__ldg(p + (kc * 32) / GROUP)));
    };
    // the next stage into its slot (TMA for qs and dense x, cp.async for qh and gathered x rows); cursors advance
    auto load = [&]() {
        const int nc = min(2, KC - 2 * lkt), s = ls;
        const int4 ti = tinfo[lj % RING];
        const int n0 = ti.x * WBN;
        const long long w0 = (long long)ti.y * N;
        const uint32_t bar = smem_addr(bars + s);
        if (tid == 0) {
            mbar_expect_tx(bar, T::QS_BYTES + (XTMA ? T::X_BYTES : 0));
            tma_load_2d(smem_addr(stage(s) + T::X_BYTES), tmw, lkt * 2 * T::QS, (int)(w0 + n0), bar);
            if constexpr (XTMA) tma_load_2d(smem_addr(stage(s)), tmx, lkt * 64, ti.z, bar);
        }
        if constexpr (!XTMA) {
            const int* rid = ids + (lj % RING) * WBM;
#pragma unroll
            for (int i = 0; i < WBM * 8 / WNT; ++i) {  // 16-byte unit u of row r; k beyond the last chunk read as 0
                const int p = tid + WNT * i, r = p >> 3, u = p & 7, id = rid[r];
                const bool ok = id >= 0 && 2 * lkt + (u >> 2) < KC;
                cp_async16(smem_addr(stage(s) + wg_x_offset(r, u)),
                           x + (ok ? (long long)xd(id) * ldx + lkt * 64 + 8 * u : 0), ok);
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
                                                         (size_t)(2 * lkt + c) * T::QH : 0), ok);
        }
    };
    auto next_load = [&]() {
        ++lg;
        if (++ls == S) ls = 0;
        if (++lkt == KT) lkt = 0, ++lj;
    };
    float sc_next[2];
    auto put_scales = [&](const float (&v)[2]) {
        if (T::SCALED && tid < WBN) sc_at(ls, 0)[tid] = v[0], sc_at(ls, 1)[tid] = v[1];
    };

    // ---- prologue: stages 0..S-2 in flight; the scales of the stage copied next wait in registers
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
        if (lg < G) {
            const float v[2] = {scale_next(0), scale_next(1)};
            put_scales(v);
            load();
        }
        cp_async_commit();
        next_load();
    }
    sc_next[0] = scale_next(0), sc_next[1] = scale_next(1);

    // Refill the slot read two steps ago with the next stage (which may belong to the next tile).
    auto refill = [&]() {
        if (lg < G) {
            put_scales(sc_next);
            load();
        }
        cp_async_commit();
        next_load();
        sc_next[0] = scale_next(0), sc_next[1] = scale_next(1);
    };

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    const int ra = 32 * (warp >> 1) + 8 * (warp & 1) + g;  // the weight row of MMA row g (tile-local)
    bool n64 = tinfo[0].w <= 64;                            // the tile's rows fit m64n64 (a grouped tile's tail)
    using Frag = uint32_t[4][4];                            // [16-wide k slice][A register]
    Frag fa, fb;
    // Compute cursors: the stage decoded next (tile dj, stage dkt, slot ds, mbarrier phase dph) and the stage
    // issued next (stage ikt, slot is).
    int dkt = 0, ds = 0, dph = 0, ikt = 0, is = 0;
    auto decode = [&](Frag& af) {
        mbar_wait(smem_addr(bars + ds), dph);  // the stage's TMA copies have landed
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            if (2 * dkt + c >= KC) break;
            const uint8_t* wq = stage(ds) + T::X_BYTES + c * T::QS;
            const float* scs = sc_at(ds, c);
            uint32_t pa[4], pb[4];
            wg_decode<BITS>(wq, 2 * T::QS, qh_at(ds, c), ra, t, T::SCALED ? scs[ra] : 1.f, pa);
            wg_decode<BITS>(wq, 2 * T::QS, qh_at(ds, c), ra + 16, t, T::SCALED ? scs[ra + 16] : 1.f, pb);
#pragma unroll
            for (int h = 0; h < 2; ++h)
                af[2 * c + h][0] = pa[2 * h], af[2 * c + h][1] = pb[2 * h], af[2 * c + h][2] = pa[2 * h + 1],
                af[2 * c + h][3] = pb[2 * h + 1];
        }
        if (++ds == S) ds = 0, dph ^= 1;
        if (++dkt == KT) dkt = 0;
    };
    // one straight run of wgmmas per case: a register write or branch between them makes ptxas fence each
    auto issue = [&](const Frag& af) {
        const uint32_t x0 = smem_addr(stage(is));
        const int ns = 2 * min(2, KC - 2 * ikt);
        wg_fence();
        if (n64) wg_issue<64>(d, af, x0, ns, ikt != 0);
        else wg_issue<128>(d, af, x0, ns, ikt != 0);
        wg_commit();
        if (++is == S) is = 0;
        if (++ikt == KT) ikt = 0;
    };
    // after issuing a stage: the next has landed and the one before's wgmmas are done (every warpgroup's, past
    // the barrier), so its slot takes the next stage to copy and its register set the next stage
    auto advance = [&]() {
        wg_wait<1>();
        cp_async_wait<S - 3>();
        fence_proxy_async();  // this thread's cp.async copies are visible to wgmma's reads
        __syncthreads();
        refill();
    };
    // ---- epilogue of tile j: d[4i + c] is (n = n0 + ra + 16(c>>1), local m = 8i + 2t + (c&1))
    auto epilogue = [&](int j) {
        const int n0 = tinfo[j % RING].x * WBN;
        const int* rid = ids + (j % RING) * WBM;
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
            for (int cm = 0; cm < 2; ++cm) {
                const int id = rid[8 * i + 2 * t + cm];
                if (id < 0) continue;
                const size_t yo = (size_t)yd(id) * ldy;
                if (mode == MODE_SWIGLU) {
                    const int nb = n0 + 32 * (warp >> 1);  // the 32-row block of ra: gate rows, then up rows
                    if (nb < N) store_act(y, yo + nb / 2 + 8 * (warp & 1) + g, d[4 * i + cm], d[4 * i + 2 + cm]);
                    continue;
                }
                const float rs = row_scale ? row_scale[id] : 1.f;
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (n0 + ra + 16 * h < N) store_out(mode, y + yo, n0 + ra + 16 * h, rs * d[4 * i + 2 * h + cm]);
            }
    };
    // After a stage of tile j: at the tile's last stage, the next tile's first stage is decoded while the last
    // wgmmas run, then the epilogue drains the accumulators (the next tile's copies are in flight meanwhile).
    int j = 0;
    auto finish = [&]() {
        if (ikt != 0) return;  // issue wrapped: the stage just issued was the tile's last
        wg_wait<0>();
        wg_pin(d, 64);
        epilogue(j);  // the next tile's first wgmma overwrites d
        if (j + 1 < J) n64 = tinfo[(j + 1) % RING].w <= 64;
        prep(j + 2);
        ++j;
    };

    cp_async_wait<S - 2>();
    fence_proxy_async();
    __syncthreads();
    decode(fa);
    for (int gs = 0; gs < G; gs += 2) {  // two stages a turn: the register sets are named, not indexed
        issue(fa);
        advance();
        if (gs + 1 < G) decode(fb);
        finish();
        if (gs + 1 >= G) break;
        issue(fb);
        advance();
        if (gs + 2 < G) decode(fa);
        finish();
    }
    wg_wait<0>();  // done already (the last stage ends a tile): said here so that ptxas need not add a wait
    cp_async_wait<0>();
}

}  // namespace

// Dense: 1-D grid of min(tiles, SMs) blocks when each tile has at least WT<BITS>::STAGES stages of 64 k (a block
// takes tiles b, b + gridDim.x, ..., its copies running into the next tile), else one block per tile; block 512,
// dynamic smem WT<BITS>::SMEM; arguments as gemm_<fmt> (qs is read through tmw), then the two descriptors.
#define NINFER_GEMM_WG_DENSE(name, BITS, GROUP)                                                                   \
    extern "C" __global__ void __launch_bounds__(WNT, 1) gemm_wgmma_##name(                                      \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K, const uint16_t* x, int ldx, \
        float* y, int ldy, const float* row_scale, int M, int mode, const __grid_constant__ TmaDesc tmw,          \
        const __grid_constant__ TmaDesc tmx) {                                                                   \
        ninfer_pdl_begin();                                                                                       \
        const Tiles tl{nullptr, nullptr, (M + WBM - 1) / WBM, M};                                                \
        wg_gemm<BITS, GROUP, true>(&tmw, &tmx, qh, sc, kp, N, K, x, ldx, y, ldy, row_scale, tl, 1, 1, mode);     \
    }

// Grouped, over the row tiles moe_sort lists in `tiles` (tile_start[E] of them, each {expert, first slot, rows
// left}); grid as dense, over ceil(N / 256) · tile_start[E] tiles (blocks past them exit); then tmw over the whole
// bank [E·N rows]. Otherwise moe_gemm_<fmt>'s arguments.
#define NINFER_GEMM_WG_MOE(name, BITS, GROUP)                                                                     \
    extern "C" __global__ void __launch_bounds__(WNT, 1) moe_gemm_wgmma_##name(                                  \
        const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K, const uint16_t* x, int ldx, \
        float* y, int ldy, const float* row_scale, const int* order, const int4* tiles, const int* tile_start,    \
        int E, int xdiv, int ydiv, int mode, const __grid_constant__ TmaDesc tmw) {                              \
        ninfer_pdl_begin();                                                                                       \
        const Tiles tl{order, tiles, __ldg(tile_start + E), 0};                                                  \
        wg_gemm<BITS, GROUP, false>(&tmw, nullptr, qh, sc, kp, N, K, x, ldx, y, ldy, row_scale, tl, xdiv, ydiv,  \
                                    mode);                                                                        \
    }

NINFER_QFORMATS(NINFER_GEMM_WG_DENSE)
NINFER_GEMM_WG_DENSE(bf16, 16, 32)
NINFER_QFORMATS(NINFER_GEMM_WG_MOE)
NINFER_GEMM_WG_MOE(bf16, 16, 32)
#endif
