// gemv_stream.cuh: the M = 1..4 stream GEMV body (gemv_stream_body), shared by gemv_stream.cu's entry points
// and chain.cu's chain of them in one resident grid. Semantics and layouts: gemv.cu's header comment.
#pragma once
#include "gemv.cuh"
#include "gemv_stage.cuh"  // x̂ of one row staged into the slab

// ------------------------------------------------------------------------------------------------ M = 1 stream
//
// The M = 1 kernel (gemv_<code>_s1): a warp reads 4 weight rows at a time (a "row group", as gemv_body; swiglu
// groups hold 2 gate and the 2 matching up rows), a lane one 16-byte unit of each row per load, but blocks are
// persistent and stream their weights through registers. A row group is S steps of D units per lane and row,
//   u = (t · D + d) · 32 + lane,   t < S = ceil(nu / (32 D)), d < D, u < nu = K / EU,
// so each warp load instruction still reads 512 contiguous bytes of a row.
// Work split, balanced to one step: block b takes the contiguous row groups [b G / nb, (b + 1) G / nb), and its
// ng · S steps are cut into 8 contiguous near-equal ranges, one per warp. Every warp streams the same number of
// steps ±1 whatever N, K and the SM count are (dealing whole 8-group tiles left the busiest SM up to 1.6x the
// average work: perf-history.md v13). A group wholly inside one warp's range is reduced and written by that warp; a
// group cut by range boundaries is summed after the loop by the warp holding its first step, from the partials
// the warps sharing it left in shared memory, in warp order (deterministic).
// Two register tiles ping-pong: a tile's 4·D 16-byte units (and scales) are issued a whole step ahead of their
// use, the first two before the kernel waits on its predecessor and stages x̂ (all of K, once per block), so a
// warp keeps 4·D to 8·D units in flight from its first instruction to its last. "add" mode adds each output to y
// in L2 (red.global.add). Launches whose steps are all whole (not swiglu) run a copy of the loop without the
// per-unit range test. Same semantics as gemv_body at M = 1 (the caller guarantees
// K <= the x̂ smem capacity and 1 <= D <= StreamDepth; blocks without a row group return at once); sums differ
// from gemv_body's only in order.

namespace {

// Steps past the two register tiles that a warp asks L2 for after the wait, on the bulk-copy path (perf-history.md v39)
constexpr int kL2Steps = 2;

// Units per lane and row in one register tile: 2 where a unit is 4-5 registers, 1 for q5/q6 (6-7 registers); at
// M > 1 rows the accumulators and x̂ reads take the registers of a second unit.
template <int BITS, int M = 1>
struct StreamDepth {
    static constexpr int value = (BITS == 5 || BITS == 6 || M > 1) ? 1 : 2;
};

// A loop copy's tag: true where every unit of every step is in range (D == DM, nu % (32 DM) == 0), so no unit
// is tested. At 128 registers, the test's branch made ptxas wait on the tile just refilled (perf-history.md v59).
template <bool B>
struct StepsFull {
    static constexpr bool value = B;
};

template <int DM>
struct Tile {
    Unit u[DM][kRows];
};

// y's (value, 1) pairs for the chunk records (WREC): 64-bit relaxed accesses at gpu scope, so a pair is written and
// read whole (PTX memory model: morally strong, single-copy atomic)
__device__ __forceinline__ unsigned long long ld_pair(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
// no "memory" clobber: the pairs are stored in the stream loop, where one would pin the weight loads around it;
// the block barrier before the pairs are read orders them
__device__ __forceinline__ void st_pair(unsigned long long* p, unsigned long long v) {
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v));
}
__device__ __forceinline__ bool pair_set(unsigned long long p) { return (unsigned)(p >> 32) == 1u; }

// How a stream GEMV waits for its predecessor before it reads x, row_scale or y: a kernel of its own waits by
// programmatic dependent launch (ninfer_pdl_begin, inline so timeline stamps keep their line); chain.cu's ops wait
// on the previous op's arrivals with a Wait whose kChain is true.
struct PdlWait {
    static constexpr bool kChain = false;
    __device__ __forceinline__ void operator()() const {}
};

template <int BITS, bool BULK, bool REC = false, bool WREC = false, bool SW = false, int M = 1, class Wait = PdlWait>
__device__ __forceinline__ void gemv_stream_body(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                                 const uint8_t* __restrict__ sc, const float* __restrict__ x,
                                                 float* y, const float* __restrict__ norm_w,
                                                 const float* __restrict__ row_scale, int N, int K, int kp,
                                                 int gshift, int ldx, int ldy, int mode, float eps, int xvec,
                                                 int D,
                                                 uint8_t* yrec = nullptr, unsigned long long* ybox = nullptr,
                                                 unsigned* ycnt = nullptr, int yq = 0, Wait wait = Wait{}) {
    using F = Fmt<BITS>;
    constexpr int EU = F::EU;
    constexpr int DM = StreamDepth<BITS, M>::value;
    static_assert(M == 1 || (!WREC && !SW && (REC || !BULK)),
                  "M > 1 rows: x staged from registers or copied as records, modes at run time");
    // bytes of x̂ per 32-element chunk of the slab: M rows of fp32 (bf16 weights) or one M-row int16 chunk record
    constexpr int CB = F::XQ != 0 ? qchunk_bytes(M) : 4 * chunk_stride(M);
    constexpr int NV = next_pow2(kRows * M);  // values a warp sums per row group (ReduceScatter)
    constexpr int SH = 5 - log2i(NV);         // ... after which lane l holds value l >> SH
    // [K / 32 chunks] of CB bytes; xvec == 2 (M = 1): then x [K] and norm_w [K]
    extern __shared__ float4 smem4[];
    __shared__ float ssred[kWarps][8];
    __shared__ float part[kWarps][2][kRows * M];  // a warp's partial sums of its first / last group, when cut

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // WREC, SW: swiglu only; _s1 / _s1b: store and add only (linear.py sends their swiglu to _s1s / _s1bs); _s1r
    // and M > 1: all
    const bool swiglu = WREC || SW || ((REC || M > 1) && mode == 2);
    if (mode == 2 && !swiglu) __trap();  // a swiglu launch of a kernel without its code (_s1, _s1b)
    const int G = (N + kRows - 1) / kRows;  // row groups (swiglu: N % 32 == 0, so every group is whole)
    const int g0 = (int)((long long)blockIdx.x * G / gridDim.x);
    const int g1 = (int)((long long)(blockIdx.x + 1) * G / gridDim.x);
    if (g0 >= g1) return;  // whole block: before any barrier
    const int nu = K / EU;                       // units of a row holding the K valid elements
    const int S = (nu + 32 * D - 1) / (32 * D);  // steps per row group
    const int L = (g1 - g0) * S;                 // steps of this block
    auto range_begin = [&](int w) { return (int)((long long)w * L / kWarps); };
    const int sb = range_begin(warp), se = range_begin(warp + 1);  // this warp's steps [sb, se)
    const int fg = sb / S;                                         // its first (local) row group
    const bool head_cut = sb != fg * S;                            // ... which began in an earlier warp's range
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
    auto advance = [&](int& g, int& t) {
        if (++t == S) {
            t = 0;
            ++g;
        }
    };
    // Issue the loads of step t of local row group gl into T (full: a StepsFull tag).
    auto issue = [&](Tile<DM>& T, int gl, int t, auto full) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) rows.oq[r] = (unsigned)row_of(g0 + gl, r) * nuq;
        const int ub = t * D * 32 + lane;
#pragma unroll
        for (int d = 0; d < DM; ++d) {
            const int u = ub + 32 * d;
            if (decltype(full)::value || (d < D && u < nu)) rows.load(T.u[d], u);
        }
    };

    // Ask L2 for step t of local row group gl (no registers held): lane l takes 128-byte line l & 7 of row l >> 3's
    // units, and lanes 5-7 also its scales and high bits (D <= 2, so a row's step is at most 8 lines of units).
    auto prefetch_step = [&](int gl, int t) {
        const int r = lane >> 3, j = lane & 7;
        const unsigned iq = (unsigned)row_of(g0 + gl, r) * nuq + (unsigned)(t * D * 32);
        if (j < 4 * D && t * D * 32 + 8 * j < nu) prefetch_l2(rows.q + iq + 8 * j);
        if constexpr (BITS != 16) {
            if (j == 5) prefetch_l2(rows.s + (iq >> rows.sshift));
        }
        if constexpr (BITS == 5 || BITS == 6) {  // 4 or 8 bytes per unit: 1 or 2 lines
            if (j == 7) prefetch_l2(rows.h + (size_t)iq * (BITS == 5 ? 4 : 8));
            if (BITS == 6 && j == 6) prefetch_l2(rows.h + (size_t)iq * 8 + 128);
        }
    };

    // Ask L2 for x̂'s records and norm_w first, so their lines are not queued behind the weights (norm_w is rarely
    // in L2); then issue the first two steps, then stage x̂ while they are in flight. A raw x is not asked for: it
    // is in L2 already, and asking before the wait for lines the predecessor still adds to delayed the release
    // (the 27B's norm GEMVs 0.3-0.6 µs, -1.2% a step: perf-history.md v60).
    if (REC) prefetch_l2_span(x, (size_t)(K >> 5) * qchunk_bytes(M), threadIdx.x, kWarps * 32);
    if (!REC && norm_w) prefetch_l2_span(norm_w, (size_t)K * 4, threadIdx.x, kWarps * 32);
    Tile<DM> A, B;
    int ig = fg, it = sb - fg * S;  // the next step to issue
    auto issue_next = [&](Tile<DM>& T, auto full) {
        issue(T, ig, it, full);
        advance(ig, it);
    };
    if (se - sb >= 1) issue_next(A, StepsFull<false>{});
    if (se - sb >= 2) issue_next(B, StepsFull<false>{});
    float* xf = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(smem4) + (K >> 5) * CB);
    float* gf = !REC && norm_w ? xf + K : nullptr;
    // REC (xvec 2, no norm): x is x̂ already, the K/32 M-row chunk records its producer wrote, copied straight into
    // the slab (its mbarrier where xf would start)
    constexpr int XC = REC ? qchunk_bytes(M) : 0;
    // BULK (sm_90+, xvec 2): the copies by the copy engine, one bulk copy each, completing on an mbarrier after
    // them (16 bytes more); their requests do not wait for free miss slots in the SM's load path as cp.async's do
    [[maybe_unused]] const uint32_t bar = smem_addr(REC ? xf : xf + K * (gf ? 2 : 1));
    if constexpr (BULK) {
        if (REC || xvec == 2) {
            if (threadIdx.x == 0) {
                mbar_init(bar, 1);
                mbar_init_fence();
                mbar_expect_tx(bar, REC ? (K >> 5) * XC : 4u * K * (gf ? 2u : 1u));
                if (gf) bulk_copy_g2s(smem_addr(gf), norm_w, 4u * K, bar);
            }
            __syncthreads();  // the barrier initialised before any thread waits on it
        }
    } else if (xvec == 2 && gf) copy_f32_async(gf, norm_w, K);
    // Weights (and norm_w) are never written by earlier kernels, so their first steps are already in flight;
    // only now wait for the previous kernel (programmatic dependent launch), before reading x, row_scale or y.
    // (one statement, so that a timeline build's stamp is in this scope, where the marks below read it)
    NINFER_TL_WAIT(if constexpr (Wait::kChain) wait(); else (ninfer_pdl_begin)());
    if constexpr (WREC) {
        // the other parity's counters of this block's chunks back to zero: the launch before this one (that
        // parity) has finished, the one after it starts after this one does
        const int c0 = g0 >> 4, nc = ((g1 - 1) >> 4) - c0 + 1;
        if ((int)threadIdx.x < nc) ycnt[(1 - ((yq >> 2) & 1)) * (N >> 6) + c0 + threadIdx.x] = 0u;
    }

    if constexpr (M > 1 && !REC) stage_slab<M, F::XQ>(smem4, x, ldx, norm_w, 0, K, xvec != 0, ssred);
    else if (REC || xvec == 2) {
        if constexpr (BULK) {
            if (threadIdx.x == 0)
                bulk_copy_g2s(REC ? smem_addr(smem4) : smem_addr(xf), x, REC ? (K >> 5) * XC : 4u * K, bar);
            // while x̂ is staged, DRAM streams this warp's next steps into L2 (not more: 4 steps lost 1.4%)
            int pg = ig, pt = it;
            for (int p = 0; p < min(kL2Steps, se - sb - 2); ++p) {
                prefetch_step(pg, pt);
                advance(pg, pt);
            }
            mbar_wait(bar, 0);
            NINFER_TL_MARK(3);  // x (and norm_w) copied in
        } else {
            copy_f32_async(REC ? reinterpret_cast<float*>(smem4) : xf, x, REC ? (K >> 5) * XC / 4 : K);
            cp_async_wait<0>();
            __syncthreads();
        }
        if constexpr (!REC) stage_m1_smem<F::XQ>(smem4, xf, gf, K, ssred);
    } else if (xvec) stage_m1_vec<F::XQ>(smem4, x, norm_w, K, ssred);
    else stage_slab<1, F::XQ>(smem4, x, ldx, norm_w, 0, K, false, ssred);
    __syncthreads();
    NINFER_TL_MARK(0);  // x̂ staged
    float inv[M];  // each row's norm factor
#pragma unroll
    for (int m = 0; m < M; ++m) {
        inv[m] = 1.f;
        if (!REC && norm_w) {
            float t = 0.f;
            for (int w = 0; w < kWarps; ++w) t += ssred[w][m];
            inv[m] = rsqrtf(t / (float)K + eps);
        }
    }
    // A lane's output of a row group: row lane & 3 of x̂ row lane >> 2 (lane < 4M), or with swiglu gate/up pair
    // lane & 1 of x̂ row lane >> 1 (lane < 2M); va / vb: which of the warp's kRows · M totals (r · M + m) it writes.
    // Computed where used: values held across the loop cost the M = 1 kernels registers they do not have.
    auto om = [&] { return M == 1 ? 0 : min(swiglu ? lane >> 1 : lane >> 2, M - 1); };
    auto va = [&] { return M == 1 ? lane & 3 : (swiglu ? lane & 1 : lane & 3) * M + om(); };
    auto vb = [&] { return ((lane & 1) + 2) * M + om(); };

    // Outputs of row group g from its row totals: lane q < 4 holds a = row q (swiglu: lane q < 2 also b = its
    // up row q + 2). "add" mode adds to y in L2 (one lane owns each element: the same rounding as a load, an add
    // and a store, ftz both ways). A loaded old y took a register on the tiles' scoreboard: its reuse in the other
    // half of the ping-pong waited for the tile just issued, every step (perf-history.md v58).
    auto write = [&](int g, float a, float b) {
        const int m = om();
        float* yo = M == 1 ? y : y + (size_t)m * ldy;
        float im = inv[0];  // inv[m] without a dynamic index into registers
#pragma unroll
        for (int j = 1; j < M; ++j)
            if (m == j) im = inv[j];
        if (!swiglu) {
            const int n = kRows * g + (M == 1 ? lane : lane & 3);
            if (lane < kRows * M && n < N) {
                float val = a * im;
                if (row_scale) val *= __ldg(row_scale + m);  // read here, not held across the loop (q8 spilled)
                if (mode == 1) atomicAdd(yo + n, val);
                else yo[n] = val;
            }
        } else {
            const int j = 16 * (g >> 3) + 2 * (g & 7) + (M == 1 ? lane : lane & 1);
            if (lane < 2 * M && j < N / 2) {
                const float v = siluf_(a * im) * (b * im);
                // WREC: y only as the records' pairs (with y stored too and the mode read at run time, the 27B
                // ran 1.3% slower: perf-history.md v49)
                if constexpr (WREC) st_pair(ybox + j, 1ull << 32 | __float_as_uint(v));
                else yo[j] = v;
            }
        }
    };

    float acc[kRows][M];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    int cg = fg, ct = sb - fg * S, left = se - sb;  // the next step to consume, and how many are left
    int own = -1;  // a cut row group whose first step is this warp's: summed after the loop

#ifdef NINFER_TIMELINE
    bool tl_first = true;  // mark 5: the first consume's dots summed
#endif
    auto consume = [&](const Tile<DM>& T, auto full) {
        const bool last = ct == S - 1 || left == 1;  // the group's last step in this warp's range
        const bool starts_here = cg != fg || !head_cut;  // the group's first step is in this warp's range
        const bool whole = starts_here && ct == S - 1;
        const int ub = ct * D * 32 + lane;
#pragma unroll
        for (int d = 0; d < DM; ++d) {
            const int u = ub + 32 * d;
            if (decltype(full)::value || (d < D && u < nu)) {
                const int le = u * EU;
                const uint8_t* xb = reinterpret_cast<const uint8_t*>(smem4);
                if constexpr (F::XQ != 0)
                    compute_unit_q<BITS, M, kRows>(T.u[d], xb + (le >> 5) * CB, (le >> 4) & 1, acc);
                else
                    compute_unit_bf16<M>(T.u[d], reinterpret_cast<const float*>(xb) + (le >> 5) * chunk_stride(M) +
                                                     (le & 31), acc);
            }
        }
#ifdef NINFER_TIMELINE
        if (!WREC && tl_first) {
            NINFER_TL_USE(acc[0][0] + acc[kRows - 1][0]);
            NINFER_TL_MARK(5);
            tl_first = false;
        }
#endif
        if (last) {
            float v[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) v[i] = i < kRows * M ? acc[i / M][i % M] : 0.f;
            ReduceScatter<NV, 16>::run(v, lane);  // lane l: the warp's total of value l >> SH (row r, x̂ row m: rM+m)
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
                for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
            if (whole) {
                const float a = __shfl_sync(kFull, v[0], va() << SH);
                const float b = __shfl_sync(kFull, v[0], vb() << SH);
                write(g0 + cg, a, b);
            } else {
                if ((lane & ((1 << SH) - 1)) == 0 && (lane >> SH) < kRows * M)
                    part[warp][cg == fg ? 0 : 1][lane >> SH] = v[0];
                if (starts_here) own = cg;
            }
        }
        advance(cg, ct);
        --left;
    };

    // Ping-pong: consume one register tile, refill it with the step two ahead (if the range has one: the other
    // tile holds the step after this one), then the same with the other.
    auto run = [&](auto full) {
        while (left > 0) {
            consume(A, full);
            if (left >= 2) issue_next(A, full);
            if (left <= 0) break;
            consume(B, full);
            if (left >= 2) issue_next(B, full);
        }
    };
#ifdef NINFER_TIMELINE
    if (!WREC && se - sb >= 1) {  // mark 4: tile A's codes in registers (NINFER_TL_USE waits for their loads)
        unsigned s = 0;
#pragma unroll
        for (int d = 0; d < DM * kRows; ++d) {
            const Unit& u = A.u[d / kRows][d % kRows];
            s ^= (unsigned)u.q.x ^ u.sc;
        }
        NINFER_TL_USE(s);
        NINFER_TL_MARK(4);
    }
#endif
    // swiglu keeps the tested loop: its whole-steps copy made the 27B's q4 gate|up slower (perf-history.md v59)
    if (!swiglu && D == DM && nu % (32 * DM) == 0) run(StepsFull<true>{});
    else run(StepsFull<false>{});

    NINFER_TL_MARK(1);  // this warp's steps done
    __syncthreads();  // every warp's partials are in part
    NINFER_TL_MARK(2);  // the block's steps done
    if (own >= 0) {
        // the warps sharing the group: this one (the group is its last) and the next ones whose ranges begin
        // inside it (for them it is the first group); warps with empty ranges hold nothing
        const int ge = (own + 1) * S;
        const int ia = va(), ib = vb();
        float a = part[warp][own == fg ? 0 : 1][ia], b = part[warp][own == fg ? 0 : 1][ib];
        for (int w = warp + 1; w < kWarps; ++w) {
            const int wb = range_begin(w);
            if (wb >= ge) break;
            if (wb == range_begin(w + 1)) continue;
            a += part[w][0][ia];
            b += part[w][0][ib];
        }
        write(g0 + own, a, b);
    }
    if constexpr (WREC) {
        // swiglu: y's 32-element chunks as the down projection's x̂ records. A chunk's 16 row groups may span
        // blocks; every block published its y as (value, 1) pairs in ybox, and a block that reads all 32 pairs of
        // a chunk set codes it and clears them. The block finishing a chunk last usually sees the others' pairs at
        // its first load: one round trip, where a count and a reload were three (perf-history.md v48). Blocks that
        // do not see them all count in on one counter, whose order no two blocks can both miss (one address), so
        // every chunk is coded; blocks that both code it write the same bytes. A block that waits for others'
        // pairs needs them resident: the stream plan launches at most the blocks an SM holds at once.
        unsigned* cnt = ycnt + ((yq >> 2) & 1) * (N >> 6);  // this launch's parity's counters
        yq &= 3;
        __syncthreads();  // every pair of this block stored (bar.sync orders them before these loads)
        NINFER_TL_MARK(4);
        for (int c = (g0 >> 4) + warp; c <= (g1 - 1) >> 4; c += kWarps) {
            unsigned long long* box = ybox + 32 * c + lane;
            unsigned long long p = ld_pair(box);
            if (!__all_sync(kFull, pair_set(p))) {
                // not all published yet: the blocks that find so count in (one atomic); the first is done, a
                // later one waits for the pairs of those counted before it (stored before their count), or
                // until its own pairs are cleared (a block that found them all coded the chunk)
                unsigned old = 0;
                if (lane == 0) old = atomicAdd(cnt + c, 1u);
                if (__shfl_sync(kFull, old, 0) == 0u) continue;
                const int gl = 16 * c + (lane >> 1);
                const bool mine = gl >= g0 && gl < g1;
                while (!__all_sync(kFull, pair_set(p = ld_pair(box))) && __all_sync(kFull, !mine || pair_set(p)))
                    __nanosleep(64);
            }
            if (__all_sync(kFull, pair_set(p))) {
                store_code1_xq(yq, yrec + (size_t)c * qchunk_bytes(1), lane, __uint_as_float((unsigned)p), true);
                st_pair(box, 0ull);
            }
        }
        NINFER_TL_MARK(5);  // the records this block completed are written
    }
}

}  // namespace
