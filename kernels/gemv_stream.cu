// gemv_stream.cu: the persistent, register-pipelined decode GEMV for M = 1 (gemv_<code>_s1), used when all of
// x̂ fits one shared-memory slab (K <= 10240 / 18688). Semantics, layouts and reference ops: as gemv.cu (y = W x̂
// with the fused RMSNorm, store / add / SwiGLU epilogues); tested with it in tests/gpu/test_linear.py.
#include "gemv.cuh"

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

// Units per lane and row in one register tile: 2 where a unit is 4-5 registers, 1 for q5/q6 (6-7 registers).
template <int BITS>
struct StreamDepth {
    static constexpr int value = (BITS == 5 || BITS == 6) ? 1 : 2;
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

// x̂ elements e..e+3 = v · g into the slab xs (int16 chunk records by XQ, or fp32 chunks); ss += Σ v². on: e < K
// (K % 32 == 0: the 8 lanes of a chunk agree).
template <int XQ>
__device__ __forceinline__ void code_x4(void* xs, int e, bool on, float4 v, float4 g, float& ss) {
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    const float4 h = make_float4(v.x * g.x, v.y * g.y, v.z * g.z, v.w * g.w);
    if constexpr (XQ != 0)
        store_codes4<1, XQ>(reinterpret_cast<uint8_t*>(xs) + (e >> 5) * qchunk_bytes(1), 0, e & 31, h, on);
    else if (on)
        *reinterpret_cast<float4*>(reinterpret_cast<float*>(xs) + (e >> 5) * 36 + (e & 31)) = h;
}

// ssred[warp][0] = the warp's Σ x² (the norm's partials)
__device__ __forceinline__ void store_ss(float ss, float (*ssred)[8], int lane, int warp) {
    const float t = warp_sum(ss);
    if (lane == 0) ssred[warp][0] = t;
}

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
            if (norm_w && e < K) g[j] = norm_gain4(__ldg(reinterpret_cast<const float4*>(norm_w + e)));
        }
#pragma unroll
        for (int j = 0; j < XB; ++j) {
            const int e = e0 + 4 * (tid + kWarps * 32 * j);
            code_x4<XQ>(xs, e, e < K, v[j], g[j], ss);
        }
    }
    if (norm_w) store_ss(ss, ssred, lane, warp);
}

// x̂ h = x · g of one 32-element chunk from shared memory (xc, and the norm's gc: g = 1 + gc; none: g = 1), float4 q;
// v: its x, already loaded.
__device__ __forceinline__ float4 chunk_h4(float4 v, const float* gc, int q) {
    if (gc) {
        const float4 g = norm_gain4(*reinterpret_cast<const float4*>(gc + 4 * q));
        v = make_float4(v.x * g.x, v.y * g.y, v.z * g.z, v.w * g.w);
    }
    return v;
}
__device__ __forceinline__ float4 chunk_h4(const float* xc, const float* gc, int q) {
    return chunk_h4(*reinterpret_cast<const float4*>(xc + 4 * q), gc, q);
}

// One chunk record (int16 codes by XQ, as store_codes4 writes them) of a 32-element chunk coded by one thread:
// a first sweep finds its largest |h| (and ss += Σ x²), a second codes its 8-blocks, both starting at rot (the
// lane), so lanes on consecutive chunks (128 bytes apart) spread over the banks. No shuffles: coding the 27B's
// K = 6144 after its copy was in took 1.6-1.9 µs with 8 lanes a chunk (code_x4), 0.8 with this (perf-history.md v35).
// With the norm, the first sweep writes h over x in place (the chunk is this thread's alone), so the second reads h
// without the gain.
template <int XQ>
__device__ __forceinline__ void code_chunk(uint8_t* rec, float* xc, const float* gc, int rot, float& ss) {
    float am = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int q = (j + rot) & 7;
        const float4 v = *reinterpret_cast<const float4*>(xc + 4 * q);
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        const float4 h = chunk_h4(v, gc, q);
        if (gc) *reinterpret_cast<float4*>(xc + 4 * q) = h;
        am = fmax_nan(am, fmax_nan(fmax_nan(fabsf(h.x), fabsf(h.y)), fmax_nan(fabsf(h.z), fabsf(h.w))));
    }
    gc = nullptr;  // xc holds h now
    const QScale qs = chunk_scale(am);
    int sq = 0;
    // lanes l and l + 4 share each b below: the one with bit 2 set reads the 8-block's halves the other way round,
    // so the 8 lanes of a load hit 8 distinct bank groups
    const int o = (rot >> 2) & 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // 8-block b: elements 8b..8b+7 -> 16 code bytes at 16b
        const int b = (j + rot) & 3;
        float4 h0 = chunk_h4(xc, gc, 2 * b + o), h1 = chunk_h4(xc, gc, 2 * b + 1 - o);
        if (o) {
            const float4 t = h0;
            h0 = h1;
            h1 = t;
        }
        const uint32_t f0 = q16_bits(h0.x, qs.inv), f1 = q16_bits(h0.y, qs.inv), f2 = q16_bits(h0.z, qs.inv),
                       f3 = q16_bits(h0.w, qs.inv), f4 = q16_bits(h1.x, qs.inv), f5 = q16_bits(h1.y, qs.inv),
                       f6 = q16_bits(h1.z, qs.inv), f7 = q16_bits(h1.w, qs.inv);
        uint4 w;
        if constexpr (XQ == 1) {  // natural order
            w = make_uint4(__byte_perm(f0, f1, 0x5410), __byte_perm(f2, f3, 0x5410), __byte_perm(f4, f5, 0x5410),
                           __byte_perm(f6, f7, 0x5410));
        } else {  // the nibble formats' order: even elements, then odd
            w = make_uint4(__byte_perm(f0, f2, 0x5410), __byte_perm(f4, f6, 0x5410), __byte_perm(f1, f3, 0x5410),
                           __byte_perm(f5, f7, 0x5410));
        }
        sq = __dp2a_lo((int)w.x, 0x0101, __dp2a_lo((int)w.y, 0x0101, sq));
        sq = __dp2a_lo((int)w.z, 0x0101, __dp2a_lo((int)w.w, 0x0101, sq));
        *reinterpret_cast<uint4*>(rec + 16 * b) = w;
    }
    *reinterpret_cast<float2*>(rec + 64) = make_float2(qs.d, __int_as_float(sq));
}

// K past which stage_m1_smem codes a chunk per thread: at K = 2048 (2 warps of 8 have a chunk) the 35B's q8 GEMVs
// with the norm lost 0.6-0.8 µs each, and at 4096 the 35B gained nothing (perf-history.md v35)
constexpr int kChunkCoderMinK = 4097;

// The same staging from shared memory: x (and norm_w) were copied to xf (and gf) by cp.async or bulk copies, every
// byte in flight at once and no register held (the weight tiles hold them): one L2 round trip instead of one per
// 4096 elements. Int16 codes from K = kChunkCoderMinK: one thread per chunk (code_chunk); else 4 elements a thread.
template <int XQ>
__device__ __forceinline__ void stage_m1_smem(void* xs, float* xf, const float* gf, int K, float (*ssred)[8]) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss = 0.f;
    if (XQ != 0 && K >= kChunkCoderMinK) {
        uint8_t* rec = reinterpret_cast<uint8_t*>(xs);
        for (int c = tid; c < (K >> 5); c += kWarps * 32)
            code_chunk<XQ>(rec + c * qchunk_bytes(1), xf + 32 * c, gf ? gf + 32 * c : nullptr, lane, ss);
    } else {
        for (int e0 = 0; e0 < K; e0 += 4 * kWarps * 32) {
            const int e = e0 + 4 * tid;
            const bool on = e < K;
            const float4 v = on ? *reinterpret_cast<const float4*>(xf + e) : make_float4(0.f, 0.f, 0.f, 0.f);
            float4 g = make_float4(1.f, 1.f, 1.f, 1.f);
            if (gf && on) g = norm_gain4(*reinterpret_cast<const float4*>(gf + e));
            code_x4<XQ>(xs, e, on, v, g, ss);
        }
    }
    if (gf) store_ss(ss, ssred, lane, warp);
}

// K fp32 values global -> shared by cp.async, 16 bytes per thread and step (16-byte aligned, K % 4 == 0)
__device__ __forceinline__ void copy_f32_async(float* dst, const float* __restrict__ src, int K) {
    for (int e = 4 * threadIdx.x; e < K; e += 4 * kWarps * 32) cp_async16(smem_addr(dst + e), src + e, true);
    cp_async_commit();
}

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

template <int BITS, bool BULK, bool REC = false, bool WREC = false, bool SW = false>
__device__ __forceinline__ void gemv_stream_body(const uint8_t* __restrict__ qs, const uint8_t* __restrict__ qh,
                                                 const uint8_t* __restrict__ sc, const float* __restrict__ x,
                                                 float* y, const float* __restrict__ norm_w,
                                                 const float* __restrict__ row_scale, int N, int K, int kp,
                                                 int gshift, int ldx, int mode, float eps, int xvec, int D,
                                                 uint8_t* yrec = nullptr, unsigned long long* ybox = nullptr,
                                                 unsigned* ycnt = nullptr, int yq = 0) {
    using F = Fmt<BITS>;
    constexpr int EU = F::EU;
    constexpr int DM = StreamDepth<BITS>::value;
    // [K / 32 chunks]: 36 floats (bf16 weights) or qchunk_bytes(1) bytes; xvec == 2: then x [K] and norm_w [K]
    extern __shared__ float4 smem4[];
    __shared__ float ssred[kWarps][8];
    __shared__ float part[kWarps][2][kRows];  // a warp's partial sums of its first / last group, when cut

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // WREC, SW: swiglu only; _s1 / _s1b: store and add only (linear.py sends their swiglu to _s1s / _s1bs); _s1r: all
    const bool swiglu = WREC || SW || (REC && mode == 2);
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
    if (REC) prefetch_l2_span(x, (size_t)(K >> 5) * qchunk_bytes(1), threadIdx.x, kWarps * 32);
    if (!REC && norm_w) prefetch_l2_span(norm_w, (size_t)K * 4, threadIdx.x, kWarps * 32);
    Tile<DM> A, B;
    int ig = fg, it = sb - fg * S;  // the next step to issue
    auto issue_next = [&](Tile<DM>& T, auto full) {
        issue(T, ig, it, full);
        advance(ig, it);
    };
    if (se - sb >= 1) issue_next(A, StepsFull<false>{});
    if (se - sb >= 2) issue_next(B, StepsFull<false>{});
    float* xf = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(smem4) +
                                         (K >> 5) * (F::XQ != 0 ? qchunk_bytes(1) : 36 * 4));
    float* gf = !REC && norm_w ? xf + K : nullptr;
    // REC (xvec 2, no norm): x is x̂ already, the K/32 chunk records its producer wrote, copied straight into the
    // slab (its mbarrier where xf would start)
    constexpr int XC = REC ? qchunk_bytes(1) : 0;
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
    ninfer_pdl_begin();
    if constexpr (WREC) {
        // the other parity's counters of this block's chunks back to zero: the launch before this one (that
        // parity) has finished, the one after it starts after this one does
        const int c0 = g0 >> 4, nc = ((g1 - 1) >> 4) - c0 + 1;
        if ((int)threadIdx.x < nc) ycnt[(1 - ((yq >> 2) & 1)) * (N >> 6) + c0 + threadIdx.x] = 0u;
    }

    if (REC || xvec == 2) {
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
    float inv = 1.f;
    if (!REC && norm_w) {
        float t = 0.f;
        for (int w = 0; w < kWarps; ++w) t += ssred[w][0];
        inv = rsqrtf(t / (float)K + eps);
    }

    // Outputs of row group g from its row totals: lane q < 4 holds a = row q (swiglu: lane q < 2 also b = its
    // up row q + 2). "add" mode adds to y in L2 (one lane owns each element: the same rounding as a load, an add
    // and a store, ftz both ways). A loaded old y took a register on the tiles' scoreboard: its reuse in the other
    // half of the ping-pong waited for the tile just issued, every step (perf-history.md v58).
    auto write = [&](int g, float a, float b) {
        if (!swiglu) {
            const int n = kRows * g + lane;
            if (lane < kRows && n < N) {
                float val = a * inv;
                if (row_scale) val *= __ldg(row_scale);  // read here, not held across the loop (q8 spilled)
                if (mode == 1) atomicAdd(y + n, val);
                else y[n] = val;
            }
        } else {
            const int j = 16 * (g >> 3) + 2 * (g & 7) + lane;
            if (lane < 2 && j < N / 2) {
                const float v = siluf_(a * inv) * (b * inv);
                // WREC: y only as the records' pairs (with y stored too and the mode read at run time, the 27B
                // ran 1.3% slower: perf-history.md v49)
                if constexpr (WREC) st_pair(ybox + j, 1ull << 32 | __float_as_uint(v));
                else y[j] = v;
            }
        }
    };

    float acc[kRows][1];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r][0] = 0.f;
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
                    compute_unit_q<BITS, 1, kRows>(T.u[d], xb + (le >> 5) * qchunk_bytes(1), (le >> 4) & 1, acc);
                else
                    compute_unit_bf16<1>(T.u[d], reinterpret_cast<const float*>(xb) + (le >> 5) * 36 + (le & 31), acc);
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
            for (int i = 0; i < 32; ++i) v[i] = i < kRows ? acc[i][0] : 0.f;
            ReduceScatter<kRows, 16>::run(v, lane);  // lane l: the warp's total of row l >> 3
#pragma unroll
            for (int r = 0; r < kRows; ++r) acc[r][0] = 0.f;
            if (whole) {
                const float a = __shfl_sync(kFull, v[0], 8 * (lane & 3));
                const float b = __shfl_sync(kFull, v[0], 8 * (lane & 1) + 16);
                write(g0 + cg, a, b);
            } else {
                if ((lane & 7) == 0) part[warp][cg == fg ? 0 : 1][lane >> 3] = v[0];
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
        float a = part[warp][own == fg ? 0 : 1][lane & 3], b = part[warp][own == fg ? 0 : 1][(lane & 1) + 2];
        for (int w = warp + 1; w < kWarps; ++w) {
            const int wb = range_begin(w);
            if (wb >= ge) break;
            if (wb == range_begin(w + 1)) continue;
            a += part[w][0][lane & 3];
            b += part[w][0][(lane & 1) + 2];
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

// The M = 1 stream kernels gemv_{q4,q5,q6,q8,bf16}_s1: the same arguments (ldy, kw_log2 and ks unused), then d,
// the units per lane and row of one register tile (1..StreamDepth). 2 blocks per SM: 128 registers hold two
// tiles. xvec: 0 scalar x loads, 1 float4 loads, 2 cp.async through K (+ K with norm_w) floats of shared memory
// after the slab (x, norm_w and that memory 16-byte aligned; linear.py takes it past one 4096-element pass before
// sm_90, up to it on sm_90+).
// gemv_<code>_s1b (sm_90+; linear.py's default past K = 4096): the same with xvec 2's copies made by bulk copies
// (16 bytes more shared memory).
// gemv_<code>_s1s / _s1bs: _s1 / _s1b for swiglu only (linear.py launches them for every M = 1 stream swiglu): a
// second loop in the kernel that also serves store/add made its swiglu loop 5% slower (perf-history.md v59). _s1 / _s1b
// then carry no swiglu code (they trap on mode 2): 6% fewer instructions, both models' steps -0.4 to -0.5% (v60).
// gemv_<code>_s1r (quantized codes): x is x̂ itself, K/32 chunk records (qchunk_bytes(1) each, in the weights' XQ
// order, as act_records16 lays them out) written by x's producer, copied into the slab as _s1b copies x (xvec 2;
// no norm, 16 bytes of shared memory after the slab), without coding (linear.gemv x_records, which launches it on
// sm_90+ only: the cp.async copy older GPUs' builds compile is not reached by any test).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define NINFER_GEMV_BULK false  // no copy engine: _s1b is _s1 (linear.py launches it on sm_90+ only)
#else
#define NINFER_GEMV_BULK true
#endif
#define NINFER_GEMV_S1(name, BITS)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1(NINFER_GEMV_ARGS, int d) {                                                        \
        gemv_stream_body<BITS, false>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift, ldx, mode,    \
                                      eps, xvec, d);                                                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1b(NINFER_GEMV_ARGS, int d) {                                                       \
        gemv_stream_body<BITS, NINFER_GEMV_BULK>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift,    \
                                                 ldx, mode, eps, xvec, d);                                 \
    }

#define NINFER_GEMV_S1S(name, BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1s(NINFER_GEMV_ARGS, int d) {                                                       \
        gemv_stream_body<BITS, false, false, false, true>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp,   \
                                                          gshift, ldx, mode, eps, xvec, d);                \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1bs(NINFER_GEMV_ARGS, int d) {                                                      \
        gemv_stream_body<BITS, NINFER_GEMV_BULK, false, false, true>(qs, qh, sc, x, y, norm_w, row_scale,  \
                                                                     N, K, kp, gshift, ldx, mode, eps,     \
                                                                     xvec, d);                             \
    }

#define NINFER_GEMV_S1R(name, BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1r(NINFER_GEMV_ARGS, int d) {                                                       \
        gemv_stream_body<BITS, NINFER_GEMV_BULK, true>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp,      \
                                                       gshift, ldx, mode, eps, xvec, d);                   \
    }

// gemv_<code>_s1bw: _s1b in swiglu mode (mode and y unused) that writes y as its N/64 chunk records instead (yrec,
// in the down projection's XQ order yq), each by a block that sees the chunk's 32 (value, 1) pairs in ybox[N/2]
// (uint64, zero before the launch, zero after it), with counters ycnt[2][N/64]: linear.gemv y_records; N % 64 == 0.
#define NINFER_GEMV_S1W(name, BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1bw(NINFER_GEMV_ARGS, int d, uint8_t* __restrict__ yrec, unsigned long long* ybox,   \
                           unsigned* ycnt, int yq) {                                                       \
        gemv_stream_body<BITS, NINFER_GEMV_BULK, false, true>(qs, qh, sc, x, y, norm_w, row_scale, N, K,   \
                                                              kp, gshift, ldx, mode, eps, xvec, d, yrec,   \
                                                              ybox, ycnt, yq);                             \
    }

NINFER_GEMV_S1(q4, 4)
NINFER_GEMV_S1(q5, 5)
NINFER_GEMV_S1(q6, 6)
NINFER_GEMV_S1(q8, 8)
NINFER_GEMV_S1(bf16, 16)
NINFER_GEMV_S1S(q4, 4)
NINFER_GEMV_S1S(q5, 5)
NINFER_GEMV_S1S(q6, 6)
NINFER_GEMV_S1S(q8, 8)
NINFER_GEMV_S1S(bf16, 16)
NINFER_GEMV_S1R(q4, 4)
NINFER_GEMV_S1R(q5, 5)
NINFER_GEMV_S1R(q6, 6)
NINFER_GEMV_S1R(q8, 8)
NINFER_GEMV_S1W(q4, 4)
NINFER_GEMV_S1W(q5, 5)
NINFER_GEMV_S1W(q6, 6)
NINFER_GEMV_S1W(q8, 8)
