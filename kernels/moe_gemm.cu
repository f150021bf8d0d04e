// moe_gemm.cu: the grouped MoE GEMM for few tokens per expert (prefill chunks: ~16 routed tokens per expert).
//
//   moe_small_<fmt>: the same result as gemm.cu's moe_gemm_<fmt> (modes swiglu / atomic add / store / add), on
//   token tiles of TM = 32 routed slots instead of 128, so a block wastes little on experts with few tokens.
//   Integer formats only (bf16 banks keep moe_gemm_<fmt>). Slots are grouped by moe_sort_bm(.., bm = TM).
//
// Method: block tile SN = 128 weight rows × TM = 32 tokens, k in stages of SK = 128 (4 chunks of 32); mma.sync
// m16n8k16 with A = W (16 rows of n) and B = xᵀ (8 tokens), as in gemm.cu (same decoders, same pairing, q8 weights
// scaled in bf16, nibble codes exact with the fp16 scale applied in fp32 to each 32-wide partial sum). The 8 warps
// split K inside the block: warp w takes chunk w & 3 of every stage and weight rows 64 (w >> 2) .. +63, so each
// staged x element is read by 2 warps only (not 4 as with an N split), the weights by one. At the end the 4 K groups' partial tiles are summed through shared memory in a
// fixed order (deterministic for a given tiling), and the epilogue writes from there (coalesced along n).
// Blocks: grid (token tiles, ceil(N / SN)); blockIdx.x (fastest) walks the token tiles, so the tiles of one
// expert and N tile run side by side and share the weight tile through L2.
//
//   moe_sum_slots: y[m, n] += Σ_j ys[m·k + j, n] over j = 0..k-1 in order, skipping slots whose id is outside
//   [0, E): the routed experts' outputs of a prompt chunk, stored one row a slot by the down (mode store, ydiv 1),
//   summed without atomics, so a prompt gives the same bits every run (reference: ops.moe's sum over the top k).
#include "gemm.cuh"

namespace {

constexpr int SN = 128, TM = 32, SK = 128, S_THREADS = 256, S_STAGES = 3;
constexpr int S_XSTRIDE = 32 * 2;        // bytes per staged bf16 x row of one chunk (no pad: see gemm.cu XS_STRIDE)
constexpr int S_RID = TM * 12;           // per token: x element offset (int64) and slot id (int32)
constexpr int RED_STRIDE = SN + 4;       // floats per token row of the reduction buffer (conflict-free writes)
constexpr int RED_BYTES = 4 * TM * RED_STRIDE * 4;

// Two blocks per SM on H100/H200 where the registers allow it without spilling (4-bit: 128 suffice); the 5, 6
// and 8-bit decoders need a few more, so those run one block per SM rather than spill.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define SMALL_MIN_BLOCKS(BITS) ((BITS) == 4 ? 2 : 1)
#else
#define SMALL_MIN_BLOCKS(BITS) 1
#endif

// Stage layout, each plane [chunk 0..3][...]: x [token][S_XSTRIDE], qs [row][QS], qh [row][QH], scale [row] fp32.
// gemm.py mirrors SMEM (small_smem_bytes); the kernel traps if it is given less.
template <int BITS>
struct STraits {
    static_assert(BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8, "integer formats only");
    static constexpr int QS = BITS == 8 ? 32 : 16;                  // qs bytes per row chunk
    static constexpr int QH = BITS == 5 ? 4 : (BITS == 6 ? 8 : 0);  // qh bytes per row chunk
    static constexpr int X_BYTES = 4 * TM * S_XSTRIDE;
    static constexpr int QS_BYTES = 4 * SN * QS;
    static constexpr int QH_BYTES = 4 * SN * QH;
    static constexpr int SC_BYTES = 4 * SN * 4;
    static constexpr int STAGE_BYTES = X_BYTES + QS_BYTES + QH_BYTES + SC_BYTES;
    static constexpr int BODY = S_STAGES * STAGE_BYTES > RED_BYTES ? S_STAGES * STAGE_BYTES : RED_BYTES;
    static constexpr int SMEM = S_RID + BODY;
};

// One SN × TM tile: weight rows w0 + n0 .. (< w0 + N) of the planes (rows of kp elements); token r of the tile
// is slot rid = rows[m0 + r] for m0 + r < count: x row rid / xdiv, y row rid / ydiv, row scale row_scale[rid].
template <int BITS, int GROUP>
__device__ __forceinline__ void small_tile(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                           const __half* __restrict__ sc, int kp, long long w0, int N, int K,
                                           int n0, const uint16_t* __restrict__ x, int ldx, float* __restrict__ y,
                                           int ldy, const float* __restrict__ row_scale,
                                           const int* __restrict__ rows, int count, int m0, int xdiv, int ydiv,
                                           int mode) {
    using T = STraits<BITS>;
    extern __shared__ __align__(16) uint8_t smem[];
    require_dynamic_smem(T::SMEM);  // gemm.py small_smem_bytes mirrors STraits
    long long* xoff = reinterpret_cast<long long*>(smem);  // x row offset in elements, -1: no token
    int* rid = reinterpret_cast<int*>(smem + TM * 8);      // slot id, -1: no token
    uint8_t* stages = smem + S_RID;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int KC = K / 32, KT = (KC + 3) / 4;  // valid 32-chunks; stages (chunks >= KC are never read)

    if (tid < TM) {
        const int m = m0 + tid, id = m < count ? rows[m] : -1;
        rid[tid] = id;
        xoff[tid] = id >= 0 ? (long long)(id / xdiv) * ldx : -1;
    }
    __syncthreads();

    const size_t qs_row_bytes = (size_t)kp * (BITS == 8 ? 8 : 4) / 8;
    const size_t qh_row_bytes = (size_t)kp * (BITS - 4) / 8;
    constexpr int CPR = T::QS / 16;                              // 16-byte pieces per row chunk
    constexpr int QS_PER_THREAD = 4 * SN * CPR / S_THREADS;      // 2 (4, 5, 6 bits) or 4 (8 bits)
    static_assert(4 * SN * CPR % S_THREADS == 0 && 4 * SN == 2 * S_THREADS && TM * 16 == 2 * S_THREADS, "tiling");

    // scale and qh items: v = tid + 256 i (i < 2) is chunk v & 3 of row v >> 2
    auto scale_of = [&](int kt, int i) -> float {
        const int v = tid + S_THREADS * i, r = v >> 2, ch = kt * 4 + (v & 3);
        if (n0 + r >= N || ch >= KC) return 0.f;
        const unsigned short* p = reinterpret_cast<const unsigned short*>(sc) + (size_t)(w0 + n0 + r) * (kp / GROUP);
        return __half2float(__ushort_as_half(__ldg(p + (ch * 32) / GROUP)));
    };
    auto store_scale = [&](int stage, int i, float s) {
        const int v = tid + S_THREADS * i;
        reinterpret_cast<float*>(stages + stage * T::STAGE_BYTES + T::X_BYTES + T::QS_BYTES +
                                 T::QH_BYTES)[(v & 3) * SN + (v >> 2)] = s;
    };
    auto load_tile = [&](int kt, int stage) {
        uint8_t* st = stages + stage * T::STAGE_BYTES;
        // x: TM tokens × 4 chunks × 4 pieces of 16 B; v = tid + 256 i: token v >> 4, piece p = v & 15
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int v = tid + S_THREADS * i, r = v >> 4, p = v & 15, c = p >> 2;
            const long long off = xoff[r];
            const bool ok = off >= 0 && kt * 4 + c < KC;
            cp_async16(smem_addr(st + c * (TM * S_XSTRIDE) + r * S_XSTRIDE + 16 * (p & 3)),
                       x + (ok ? off + (long long)kt * SK + 8 * p : 0), ok);
        }
        // qs: SN rows × 4 chunks × CPR pieces; v: row v / (4 CPR), chunk (v % (4 CPR)) / CPR, piece v % CPR
#pragma unroll
        for (int i = 0; i < QS_PER_THREAD; ++i) {
            const int v = tid + S_THREADS * i, r = v / (4 * CPR), q = v % (4 * CPR), c = q / CPR, part = q % CPR;
            const int ch = kt * 4 + c;
            const bool ok = n0 + r < N && ch < KC;
            cp_async16(smem_addr(st + T::X_BYTES + c * (SN * T::QS) + r * T::QS + 16 * part),
                       qs + (ok ? (size_t)(w0 + n0 + r) * qs_row_bytes + (size_t)ch * T::QS + 16 * part : 0), ok);
        }
        if constexpr (T::QH > 0) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int v = tid + S_THREADS * i, r = v >> 2, c = v & 3, ch = kt * 4 + c;
                const bool ok = n0 + r < N && ch < KC;
                cp_async_small<T::QH>(smem_addr(st + T::X_BYTES + T::QS_BYTES + c * (SN * T::QH) + r * T::QH),
                                      qh + (ok ? (size_t)(w0 + n0 + r) * qh_row_bytes + (size_t)ch * T::QH : 0), ok);
            }
        }
    };

    // ---- pipeline (as gemm.cu): stages 0..S-2 in flight before the loop; the scales of the stage copied in
    // iteration kt are loaded into registers one iteration earlier and stored to shared memory with its planes.
    constexpr int S = S_STAGES;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < KT) {
            load_tile(s, s);
            store_scale(s, 0, scale_of(s, 0));
            store_scale(s, 1, scale_of(s, 1));
        }
        cp_async_commit();
    }
    float scn[2] = {0.f, 0.f};
    if (S - 1 < KT) scn[0] = scale_of(S - 1, 0), scn[1] = scale_of(S - 1, 1);

    const int g = lane >> 2, t = lane & 3;
    const int kg = warp & 3, wrow = (warp >> 2) * 64;  // this warp's chunk of each stage, first weight row
    const int jn = min(4, (min(TM, count - m0) + 7) >> 3);  // 8-token blocks holding a token: the rest is skipped
    float acc[4][4][4];                                  // [16-row tile i][8-token block j][fragment c]
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 2>();  // this thread's copies of stage kt have landed
        __syncthreads();         // everyone's have; and everyone is done with stage kt-1's buffer
        const int nt = kt + S - 1;
        if (nt < KT) {
            store_scale(nt % S, 0, scn[0]);
            store_scale(nt % S, 1, scn[1]);
            load_tile(nt, nt % S);
        }
        cp_async_commit();
        if (nt + 1 < KT) scn[0] = scale_of(nt + 1, 0), scn[1] = scale_of(nt + 1, 1);

        if (kt * 4 + kg < KC) {  // warp-uniform: chunks past K are skipped (zero-filled, never read)
            const uint8_t* st = stages + (kt % S) * T::STAGE_BYTES;
            const uint8_t* xs = st + kg * (TM * S_XSTRIDE);
            const uint8_t* wq = st + T::X_BYTES + kg * (SN * T::QS);
            const uint8_t* wh = st + T::X_BYTES + T::QS_BYTES + kg * (SN * T::QH);
            const float* scs = reinterpret_cast<const float*>(st + T::X_BYTES + T::QS_BYTES + T::QH_BYTES) + kg * SN;
            uint32_t b[4][4];  // [token block j][pair]: token 8j + g, k 8t .. 8t+7 of the chunk
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (j < jn) x_frag(xs + (8 * j + g) * S_XSTRIDE + 16 * t, b[j]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint32_t a[2][4];  // rows g, g+8 of 16-row tile i (q8: scaled weights in bf16, gemm.cuh)
                float s[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = wrow + 16 * i + 8 * h + g;
                    if constexpr (BITS == 8) decode_row_q8_scaled(wq, row, t, scs[row], a[h]);
                    else decode_row<BITS>(wq, wh, row, t, a[h]);
                    if constexpr (BITS != 8) s[h] = scs[row];  // q8: the scale is in the weights
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (j >= jn) break;
                    if constexpr (BITS == 8) {
                        mma_bf16(acc[i][j], a[0][0], a[1][0], a[0][1], a[1][1], b[j][0], b[j][1]);
                        mma_bf16(acc[i][j], a[0][2], a[1][2], a[0][3], a[1][3], b[j][2], b[j][3]);
                    } else {
                        float p[4] = {0.f, 0.f, 0.f, 0.f};
                        mma_bf16(p, a[0][0], a[1][0], a[0][1], a[1][1], b[j][0], b[j][1]);
                        mma_bf16(p, a[0][2], a[1][2], a[0][3], a[1][3], b[j][2], b[j][3]);
                        acc[i][j][0] = fmaf(s[0], p[0], acc[i][j][0]);
                        acc[i][j][1] = fmaf(s[0], p[1], acc[i][j][1]);
                        acc[i][j][2] = fmaf(s[1], p[2], acc[i][j][2]);
                        acc[i][j][3] = fmaf(s[1], p[3], acc[i][j][3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: they become the reduction buffer

    // ---- K groups -> red[kg][token][n]: acc[i][j][c] is (n = wrow + 16i + g + 8(c>>1), token = 8j + 2t + (c&1))
    float* red = reinterpret_cast<float*>(stages);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                red[(kg * TM + 8 * j + 2 * t + (c & 1)) * RED_STRIDE + wrow + 16 * i + g + 8 * (c >> 1)] = acc[i][j][c];
    __syncthreads();
    auto sum4 = [&](int tok, int n) {
        const float* p = red + tok * RED_STRIDE + n;
        return ((p[0] + p[TM * RED_STRIDE]) + p[2 * TM * RED_STRIDE]) + p[3 * TM * RED_STRIDE];
    };

    if (mode == MODE_SWIGLU) {
        // output column n0/2 + jo (jo < SN/2): gate row 32 (jo >> 4) + (jo & 15), up row that + 16
#pragma unroll 4
        for (int q = 0; q < TM * SN / 2 / S_THREADS; ++q) {
            const int o = tid + S_THREADS * q, tok = o / (SN / 2), jo = o % (SN / 2);
            const int id = rid[tok], nb = 32 * (jo >> 4) + (jo & 15);
            if (id < 0 || n0 + 32 * (jo >> 4) >= N) continue;
            store_act(y, (size_t)(id / ydiv) * ldy + n0 / 2 + jo, sum4(tok, nb), sum4(tok, nb + 16));
        }
        return;
    }
#pragma unroll 4
    for (int q = 0; q < TM * SN / S_THREADS; ++q) {
        const int o = tid + S_THREADS * q, tok = o / SN, nl = o % SN, n = n0 + nl;
        const int id = rid[tok];
        if (id < 0 || n >= N) continue;
        const float v = (row_scale ? row_scale[id] : 1.f) * sum4(tok, nl);
        float* yr = y + (size_t)(id / ydiv) * ldy + n;
        if (mode == MODE_STORE) *yr = v;
        else if (mode == MODE_ADD) *yr += v;
        else atomicAdd(yr, v);
    }
}

}  // namespace

// Grouped over an expert bank of E matrices of N rows (bank rows e·N ..): grid (token tiles >= tile_start[E],
// ceil(N / SN)), block 256, dynamic smem STraits<BITS>::SMEM. Token tile tx belongs to expert e with
// tile_start[e] <= tx < tile_start[e+1] (tiles of TM slots, from moe_sort_bm(.., TM); blocks past tile_start[E]
// exit). The expert's slots are order[offsets[e] .. offsets[e+1]); a slot reads x row slot / xdiv, writes y row
// slot / ydiv, scaled by row_scale[slot] (null: 1; not in swiglu). Modes as gemm.cu (swiglu needs N % 32 == 0).
#define NINFER_MOE_SMALL(name, BITS, GROUP)                                                                     \
    extern "C" __global__ void __launch_bounds__(S_THREADS, SMALL_MIN_BLOCKS(BITS))                                  \
        moe_small_##name(const uint8_t* qs, const uint8_t* qh, const __half* sc, int kp, int N, int K,         \
                         const uint16_t* x, int ldx, float* y, int ldy, const float* row_scale, const int* order, \
                         const int* offsets, const int* tile_start, int E, int xdiv, int ydiv, int mode) { ninfer_pdl_begin();      \
        const int tx = blockIdx.x;                                                                              \
        if (tx >= __ldg(tile_start + E)) return;                                                                \
        const int e = expert_of_tile(tile_start, E, tx), first = __ldg(offsets + e);                           \
        small_tile<BITS, GROUP>(qs, qh, sc, kp, (long long)e * N, N, K, blockIdx.y * SN, x, ldx, y, ldy,       \
                                row_scale, order + first, __ldg(offsets + e + 1) - first,                      \
                                (tx - __ldg(tile_start + e)) * TM, xdiv, ydiv, mode);                           \
    }

NINFER_QFORMATS(NINFER_MOE_SMALL)

// grid (ceil(H / 256), M), block 256: thread t of block (bx, m) sums column 256·bx + t of row m; ys fp32
// [M·k, H] (row stride H), ids int32 [M·k], y fp32 [M, ldy]. Sequential fp32 adds in j order (one rounding each,
// no FMA): bit-exact against the same loop on the host.
extern "C" __global__ void __launch_bounds__(256) moe_sum_slots(const float* __restrict__ ys,
                                                               const int* __restrict__ ids, int k, int H, int E,
                                                               float* __restrict__ y, int ldy) {
    ninfer_pdl_begin();
    const int m = blockIdx.y, n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= H) return;
    float* yr = y + (size_t)m * ldy + n;
    float acc = *yr;
    for (int j = 0; j < k; ++j) {
        const int e = __ldg(ids + (size_t)m * k + j);
        if (e >= 0 && e < E) acc = __fadd_rn(acc, __ldg(ys + ((size_t)m * k + j) * H + n));
    }
    *yr = acc;
}
