// gemm.cu: the prefill GEMM on tensor cores, for every weight format (q{4,5,6,8}g{32,64,128} and bf16).
//
//   dense (gemm_<fmt>):  y[m, n] (=, +=) s_m · Σ_k W[n, k] x[m, k]                       reference: x @ W.T
//                        or, mode swiglu, y[m, j] = silu(gate_j · x_m) · (up_j · x_m)    (ops.swiglu_mlp)
//   grouped MoE (moe_sort, moe_gemm_<fmt>): the same tile over expert banks, rows gathered by routed slot
//                            (reference ops.moe: gate_up + SwiGLU, then down weighted by the routing weight)
//
// Layouts: x bf16 [rows, ldx] (K valid columns, never read beyond; ldx a multiple of 8), y fp32 [rows, ldy],
// except swiglu: y bf16 [rows, ldy] (the down projection's input); W in the artifact layout (quant.cuh): integer
// planes qs / qh / scales with rows of Kp = round_up(K, 128), or bf16 [N, K] unpadded.
// Interleaved gate/up (docs/format.md): rows 32t..32t+15 are gate rows 16t.., rows 32t+16..32t+31 up rows 16t...
//
// Method: block tile 128 (N) × 128 (M) × 32 (K), 8 warps of 32 (N) × 64 (M), mma.sync m16n8k16 with A = W
// (16 rows of n) and B = xᵀ (8 columns of m), fp32 accumulators. A cp.async pipeline (as many stages as fit
// 96 KB, up to 8; a q8 stage holds two k-tiles) copies the raw planes and the bf16 x tile into shared memory; each
// warp decodes its weight fragments straight from the packed bytes, paired as x's bf16 elements lie (gemm.cuh
// "Pairing").
//   * q8 weights meet the MMA as w = q · s rounded once to bf16 (gemm.cuh "scaled weights"), as a dequantizing
//     GEMM would store them: relative error <= 2^-8 per weight (half an ulp), for 24% fewer instructions per MMA than
//     splitting the byte into exact nibbles and scaling 32-wide partial sums (perf-history.md v16). Nibble codes are
//     exact in bf16 and their fp16 group scale is applied in fp32 to each 32-wide partial sum (acc += s · Σ_32
//     q·x): nothing rounds there besides fp32 accumulation. x arrives in bf16; swiglu rounds its output.
//   * Each thread owns 8 consecutive k of a row per 32-wide chunk, in bf16x2 registers of consecutive pairs: its B
//     fragment is x as staged (gemm.cuh "Pairing"), and the weight decoder builds A in the same order.
#include "gemm.cuh"

namespace {

constexpr int BN = 128, BM = 128, BK = 32, THREADS = 256;
constexpr int WARPS_N = 4;                   // warps along N; 2 along M; warp tile 32 (N) × 64 (M)
constexpr int XS_STRIDE = BK * 2;            // bytes per staged x row: a fragment load's 8-lane phase reads 2
                                             // whole rows (128 contiguous bytes), so no pad is needed
constexpr int RID_BYTES = BM * 12;           // per block row: x element offset (int64) and row id (int32)

// Two blocks per SM where shared memory holds two (H100/H200: 228 KB), so registers are capped at 128.
// Elsewhere (A100 164 KB, sm_86/89/120 ~100 KB) one block fits anyway: let the compiler use more registers.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define GEMM_MIN_BLOCKS 2
#else
#define GEMM_MIN_BLOCKS 1
#endif

// Per format (BITS 4, 5, 6, 8; 16 = raw bf16): bytes of one row's 32-wide chunk in each plane, CH chunks per
// pipeline stage, and the stages: as many as fit 96 KB (up to 8), within sm_86/89/120's 99 KB per block and two
// blocks on an H100/H200 SM.
// gemm.py mirrors SMEM (smem_bytes); the kernel traps if it is given less.
template <int BITS>
struct Traits {
    static constexpr bool SCALED = BITS != 16;
    static constexpr int QS = BITS == 16 ? 64 : (BITS == 8 ? 32 : 16);  // qs (or bf16 data) bytes per row chunk
    static constexpr int QH = BITS == 5 ? 4 : (BITS == 6 ? 8 : 0);      // qh bytes per row chunk
    static constexpr int XS_BYTES = BM * XS_STRIDE;
    static constexpr int QS_BYTES = BN * QS;
    static constexpr int QH_BYTES = BN * QH;
    static constexpr int SC_BYTES = SCALED ? BN * 4 : 0;  // fp32 scale of each row for this chunk
    static constexpr int CHUNK_BYTES = XS_BYTES + QS_BYTES + QH_BYTES + SC_BYTES;  // one 32-wide chunk's planes
    // chunks per pipeline stage: q8 waits and syncs once per 64 k (+6-7%, perf-history.md v16); the nibble formats
    // measured 4-5% slower so (spills), bf16 would keep too few stages
    static constexpr int CH = BITS == 8 ? 2 : 1;
    static constexpr int STAGE_BYTES = CH * CHUNK_BYTES;
    static constexpr int FIT = (96 * 1024 - RID_BYTES) / STAGE_BYTES;
    static constexpr int STAGES = FIT < 8 ? FIT : 8;
    static constexpr int SMEM = RID_BYTES + STAGES * STAGE_BYTES;
};

// ------------------------------------------------------------------------------------------------ the tile

// One 128 × 128 output tile. W is rows w0 .. w0+N-1 of the planes (rows of kp elements); rows of the tile are
// rid = rows[m0 + r] (or m0 + r when rows is null) for m0 + r < count; x row = rid / xdiv, y row = rid / ydiv,
// row scale row_scale[rid]. Mode store/add/atomic-add write y[.., n] for n < N; swiglu writes y[.., j < N/2].
template <int BITS, int GROUP>
__device__ __forceinline__ void gemm_tile(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                          const __half* __restrict__ sc, int kp, long long w0, int N, int K,
                                          int n0,
                                          const uint16_t* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
                                          const float* __restrict__ row_scale, const int* __restrict__ rows,
                                          int count, int m0, int xdiv, int ydiv, int mode) {
    using T = Traits<BITS>;
    extern __shared__ __align__(16) uint8_t smem[];
    require_dynamic_smem(T::SMEM);  // gemm.py smem_bytes mirrors Traits
    long long* xoff = reinterpret_cast<long long*>(smem);  // x row offset in elements, -1: no row
    int* rid = reinterpret_cast<int*>(smem + BM * 8);      // row id, -1: no row
    uint8_t* stages = smem + RID_BYTES;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int KC = K / BK;                        // 32-wide chunks
    const int KT = (KC + T::CH - 1) / T::CH;      // pipeline stages of CH chunks (the last may hold fewer)

    tile_rows(rid, xoff, rows, count, m0, xdiv, ldx, BM);
    __syncthreads();

    // ---- what this thread copies each k-tile
    // x: 2 chunks of 16 B: row (tid >> 2) + 64 i, bytes 16 (tid & 3) of the row's 64 (row offsets read from
    // shared memory each time: fewer live registers)
    // qs (or bf16 data): BN rows × QS bytes = QS/16 chunks per row
    constexpr int CPR = T::QS / 16, QS_CHUNKS = BN * CPR, QS_PER_THREAD = (QS_CHUNKS + THREADS - 1) / THREADS;
    const size_t qs_row_bytes = (size_t)kp * (BITS == 16 ? 16 : (BITS == 8 ? 8 : 4)) / 8;
    // qh (5, 6 bits): threads 128.. copy one row's QH bytes each; scales: threads < 128 load one row's fp16.
    // Source addresses are recomputed from the kernel parameters each time, to keep registers for the tile.
    const int hrow = tid - (THREADS - BN);
    auto scale_of = [&](int kt) -> float {  // kt: a chunk
        if (!T::SCALED || tid >= BN || n0 + tid >= N) return 0.f;
        const unsigned short* p = reinterpret_cast<const unsigned short*>(sc) + (size_t)(w0 + n0 + tid) * (kp / GROUP);
        return __half2float(__ushort_as_half(__ldg(p + (kt * BK) / GROUP)));
    };

    auto load_chunk = [&](int kt, uint8_t* st) {  // chunk kt's planes into st
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = (tid >> 2) + 64 * i;
            const long long off = xoff[r];
            cp_async16(smem_addr(st + r * XS_STRIDE + 16 * (tid & 3)),
                       x + (off >= 0 ? off + kt * BK + 8 * (tid & 3) : 0), off >= 0);
        }
#pragma unroll
        for (int i = 0; i < QS_PER_THREAD; ++i) {
            const int c = tid + THREADS * i, r = c / CPR;
            const bool ok = n0 + r < N;
            if (c < QS_CHUNKS)
                cp_async16(smem_addr(st + T::XS_BYTES + r * T::QS + 16 * (c % CPR)),
                           qs + (ok ? (size_t)(w0 + n0 + r) * qs_row_bytes + (size_t)kt * T::QS + 16 * (c % CPR) : 0),
                           ok);
        }
        if constexpr (T::QH > 0) {
            const bool ok = n0 + hrow < N;
            if (hrow >= 0)
                cp_async_small<T::QH>(
                    smem_addr(st + T::XS_BYTES + T::QS_BYTES + hrow * T::QH),
                    qh + (ok ? (size_t)(w0 + n0 + hrow) * ((size_t)kp * (BITS - 4) / 8) + (size_t)kt * T::QH : 0), ok);
        }
    };
    auto chunk_at = [&](int stage, int c) { return stages + stage * T::STAGE_BYTES + c * T::CHUNK_BYTES; };
    auto load_tile = [&](int kt, int stage) {  // stage kt: chunks CH kt .. CH kt + CH - 1 below KC
#pragma unroll
        for (int c = 0; c < T::CH; ++c)
            if (kt * T::CH + c < KC) load_chunk(kt * T::CH + c, chunk_at(stage, c));
    };
    auto store_scale = [&](int stage, int c, float s) {
        if (T::SCALED && tid < BN)
            reinterpret_cast<float*>(chunk_at(stage, c) + T::XS_BYTES + T::QS_BYTES + T::QH_BYTES)[tid] = s;
    };

    // ---- pipeline: stages 0..STAGES-2 in flight before the loop; the scales of the stage copied in iteration kt
    // are loaded into registers one iteration earlier and stored to shared memory with its planes.
    constexpr int S = T::STAGES;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < KT) {
            load_tile(s, s);
            if constexpr (T::SCALED)
#pragma unroll
                for (int c = 0; c < T::CH; ++c) store_scale(s, c, scale_of(s * T::CH + c));
        }
        cp_async_commit();
    }
    float sc_next[T::CH];
#pragma unroll
    for (int c = 0; c < T::CH; ++c)
        sc_next[c] = T::SCALED && (S - 1) * T::CH + c < KC ? scale_of((S - 1) * T::CH + c) : 0.f;

    const int g = lane >> 2, t = lane & 3;
    const int wrow = (warp % WARPS_N) * 32, wcol = (warp / WARPS_N) * 64;
    // 8-row blocks of this warp's 64 columns that hold a row: a grouped tile's last rows are often empty (an
    // expert with 130 slots fills 2 rows of its second tile), and their mma work is skipped (warp-uniform)
    const int jn = min(8, max(0, (min(BM, count - m0) - wcol + 7) >> 3));
    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 2>();  // this thread's copies of tile kt have landed
        __syncthreads();         // everyone's have; and everyone is done with tile kt-1's stage
        const int nt = kt + S - 1;
        if (nt < KT) {
            if constexpr (T::SCALED)
#pragma unroll
                for (int c = 0; c < T::CH; ++c) store_scale(nt % S, c, sc_next[c]);
            load_tile(nt, nt % S);
        }
        cp_async_commit();
        if constexpr (T::SCALED) {
#pragma unroll
            for (int c = 0; c < T::CH; ++c)
                if ((nt + 1) * T::CH + c < KC) sc_next[c] = scale_of((nt + 1) * T::CH + c);
        }

        // one chunk of mma work (staged at st) on this warp's first jmax 8-row blocks
        auto mma_tile = [&](const uint8_t* st, int jmax) {
            const uint8_t* wq = st + T::XS_BYTES;
            const uint8_t* wh = wq + T::QS_BYTES;
            const float* scs = reinterpret_cast<const float*>(wh + T::QH_BYTES);
            // q8: scaled weights in bf16 (gemm.cuh), straight into the accumulators; nibble formats: exact codes,
            // the scale applied in fp32 to each 32-wide partial sum (folding it into bf16 weights measured slower
            // there, perf-history.md v16)
            constexpr bool PARTIAL = T::SCALED && BITS != 8;
            uint32_t a[2][2][4];  // [16-row tile i][rows g, g+8][pair]
            float s[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = wrow + 16 * i + 8 * h + g;
                    if constexpr (BITS == 8) decode_row_q8_scaled(wq, row, t, scs[row], a[i][h]);
                    else decode_row<BITS>(wq, wh, row, t, a[i][h]);
                    if constexpr (PARTIAL) s[i][h] = scs[row];
                }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (j >= jmax) break;  // folds away when jmax is the constant 8
                uint32_t b[4];
                x_frag(st + (wcol + 8 * j + g) * XS_STRIDE + 16 * t, b);  // x[m][8t .. 8t+7]
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    // A regs: (row g, pair 2q), (row g+8, pair 2q), (row g, pair 2q+1), (row g+8, pair 2q+1);
                    // B regs: pairs 2q, 2q+1 — logical k 2t,2t+1 <-> pair 2q, k 2t+8,2t+9 <-> pair 2q+1
                    if constexpr (PARTIAL) {
                        float p[4] = {0.f, 0.f, 0.f, 0.f};
                        mma_bf16(p, a[i][0][0], a[i][1][0], a[i][0][1], a[i][1][1], b[0], b[1]);
                        mma_bf16(p, a[i][0][2], a[i][1][2], a[i][0][3], a[i][1][3], b[2], b[3]);
                        acc[i][j][0] = fmaf(s[i][0], p[0], acc[i][j][0]);
                        acc[i][j][1] = fmaf(s[i][0], p[1], acc[i][j][1]);
                        acc[i][j][2] = fmaf(s[i][1], p[2], acc[i][j][2]);
                        acc[i][j][3] = fmaf(s[i][1], p[3], acc[i][j][3]);
                    } else {
                        mma_bf16(acc[i][j], a[i][0][0], a[i][1][0], a[i][0][1], a[i][1][1], b[0], b[1]);
                        mma_bf16(acc[i][j], a[i][0][2], a[i][1][2], a[i][0][3], a[i][1][3], b[2], b[3]);
                    }
                }
            }
        };
#pragma unroll
        for (int c = 0; c < T::CH; ++c) {
            if (kt * T::CH + c >= KC) break;  // the last stage's missing chunk (K % 64 == 32)
            const uint8_t* st = chunk_at(kt % S, c);
            if (jn == 8) mma_tile(st, 8);  // full tiles: the branch-free copy
            else if (jn > 0) mma_tile(st, jn);  // jn = 0: no row in this warp's columns, it only copies
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: acc[i][j][c] is (n = n0 + wrow + 16i + g + 8(c>>1), local m = wcol + 8j + 2t + (c&1))
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int cm = 0; cm < 2; ++cm) {
            const int id = rid[wcol + 8 * j + 2 * t + cm];
            if (id < 0) continue;
            const size_t yo = (size_t)(id / ydiv) * ldy;  // this row's start in y
            float* yr = y + yo;
            if (mode == MODE_SWIGLU) {
                const int nb = n0 + wrow;  // 32-row block: gate tile i = 0, up tile i = 1
                if (nb >= N) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    store_act(y, yo + nb / 2 + g + 8 * h, acc[0][j][2 * h + cm], acc[1][j][2 * h + cm]);
                continue;
            }
            const float rs = row_scale ? row_scale[id] : 1.f;
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int n = n0 + wrow + 16 * i + 8 * h + g;
                    if (n >= N) continue;
                    store_out(mode, yr, n, rs * acc[i][j][2 * h + cm]);
                }
        }
}

}  // namespace

// ------------------------------------------------------------------------------------------------ entry points

// Dense: grid (ceil(N / 128), ceil(M / 128)), block 256, dynamic smem Traits<BITS>::SMEM.
// mode 0 store, 1 add, 2 swiglu (N % 32 == 0, writes N/2 bf16 columns); row_scale may be null.
#define NINFER_GEMM_DENSE(name, BITS, GROUP)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)                                     \
        gemm_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K,              \
                    const uint16_t* x, int ldx, float* y, int ldy, const float* row_scale, int M, int mode) {  \
        ninfer_pdl_begin();                                                                                     \
        gemm_tile<BITS, GROUP>(qs, qh, sc, kp, 0, N, K, blockIdx.x * BN, x, ldx, y, ldy, row_scale, nullptr, M,  \
                               blockIdx.y * BM, 1, 1, mode);                                                    \
    }

// Grouped over an expert bank of E matrices of N rows (bank rows e·N ..): grid (ceil(N / 128),
// ceil(slots / 128) + E); block row ty belongs to expert e with tile_start[e] <= ty < tile_start[e+1] (blocks past
// tile_start[E] exit). The expert's rows are the slots order[offsets[e] .. offsets[e+1]); a slot reads x row
// slot / xdiv, writes y row slot / ydiv, and is scaled by row_scale[slot].
#define NINFER_GEMM_MOE(name, BITS, GROUP)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, GEMM_MIN_BLOCKS)                                     \
        moe_gemm_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K,          \
                        const uint16_t* x, int ldx, float* y, int ldy, const float* row_scale, const int* order, \
                        const int* offsets, const int* tile_start, int E, int xdiv, int ydiv, int mode) {       \
        ninfer_pdl_begin();                                                                                     \
        GroupTile gt;                                                                                           \
        if (!group_tile(offsets, tile_start, E, blockIdx.y, BM, gt)) return;                                    \
        gemm_tile<BITS, GROUP>(qs, qh, sc, kp, (long long)gt.e * N, N, K, blockIdx.x * BN, x, ldx, y, ldy,     \
                               row_scale, order + gt.first, gt.count, gt.m0, xdiv, ydiv, mode);                 \
    }

NINFER_QFORMATS(NINFER_GEMM_DENSE)
NINFER_GEMM_DENSE(bf16, 16, 32)
NINFER_QFORMATS(NINFER_GEMM_MOE)
NINFER_GEMM_MOE(bf16, 16, 32)

// Slots s = m·top_k + j (ids int32 [M, top_k] flattened, `slots` = M·top_k) grouped by expert: counts, then
// offsets [E+1] (exclusive prefix), tile_start [E+1] (prefix of ceil(count / bm)), order [slots] (each expert's
// slots contiguous; their order inside an expert is arbitrary, which no result depends on). Ids outside
// [0, E) are dropped. One block of 1024 threads; dynamic smem 2·E ints.
__device__ __forceinline__ void moe_sort_body(const int* __restrict__ ids, int slots, int E, int* __restrict__ order,
                                              int* __restrict__ offsets, int* __restrict__ tile_start, int bm) {
    extern __shared__ int cnt[];  // [E] counts, then [E] cursors
    int* cur = cnt + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const int e = ids[s];
        if (e >= 0 && e < E) atomicAdd(cnt + e, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // E is a few hundred: a serial scan is cheaper than a sync-heavy parallel one
        int off = 0, tiles = 0;
        for (int e = 0; e < E; ++e) {
            offsets[e] = off, tile_start[e] = tiles, cur[e] = off;
            off += cnt[e], tiles += (cnt[e] + bm - 1) / bm;
        }
        offsets[E] = off, tile_start[E] = tiles;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        const int e = ids[s];
        if (e >= 0 && e < E) order[atomicAdd(cur + e, 1)] = s;
    }
}

// tile_start in tiles of BM = 128 rows (moe_gemm_<fmt>)
extern "C" __global__ void __launch_bounds__(1024) moe_sort(const int* __restrict__ ids, int slots, int E,
                                                            int* __restrict__ order, int* __restrict__ offsets,
                                                            int* __restrict__ tile_start) { ninfer_pdl_begin();
    moe_sort_body(ids, slots, E, order, offsets, tile_start, BM);
}

// tile_start in tiles of bm >= 1 rows (moe_small_<fmt> in moe_gemm.cu: bm = its token tile)
extern "C" __global__ void __launch_bounds__(1024) moe_sort_bm(const int* __restrict__ ids, int slots, int E,
                                                               int* __restrict__ order, int* __restrict__ offsets,
                                                               int* __restrict__ tile_start, int bm) { ninfer_pdl_begin();
    moe_sort_body(ids, slots, E, order, offsets, tile_start, bm);
}
