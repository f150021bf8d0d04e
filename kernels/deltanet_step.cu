// deltanet_step.cu: a decode step of the Gated DeltaNet mixer in one launch, B sequences × T = 1..8 tokens,
// from the layer input x to the gated-norm output y (ninfer_rt/reference/model.py GatedDeltaNet.__call__, the
// input norm and b|a projection included, out_proj not; deltanet.cu computes the same from b|a in three launches):
//   x̂ = rms_norm_zc(x, in_norm_w);  b_h = W_ba[h] · x̂,  a_h = W_ba[nv + h] · x̂       W_ba bf16 [2·nv, H]
//   (the input norm folded into the dot: b = r · Σ_k W_b[k] (1 + n_k) x[k], r = rsqrt(mean x² + eps_in)),
//   c = SiLU(causal conv) through the ring, q̂/k̂ L2-normalised, the gated delta rule on S, y = w·o/rms(o)·SiLU(z).
// Reference ops: rms_norm_zc + x @ W.T, causal_conv1d(_step), gated_delta_rule_recurrent, gated_rms_norm.
// Layouts as in the header of deltanet.cu, plus x fp32 [B·T, H] (row b·T + t) and in_norm_w fp32 [H] (gain 1 + w).
//
// Work split: each (value head h, sequence b) is C blocks: a thread-block cluster of C = DN_STEP_CLUSTER on
// sm_90+ (deltanet_step_dk*_c4; of 2, _c2, where B > 1 sequences fit one wave that way, v89), or one block
// (C = 1, deltanet_step_dk*, any GPU). Block c of the C does
//   b|a     1/C of the H-long dots (element k by thread k mod (C·threads) of the cluster);
//   conv    q and k channels [c·dk/C, (c+1)·dk/C) of key head h / (nv/nk), and the v channels of its columns;
//   delta   columns [c·dv/C, (c+1)·dv/C) of S (the columns are independent, deltanet.cu), P threads per column;
//   norm    y of its columns.
// The blocks exchange through distributed shared memory by st.async, each block waiting on its own mbarrier for
// what it receives: first its b|a partial sums (into every block, itself included) and its q/k channels (into the
// others), then its Σ o² partials. No cluster barrier: its release would wait for the state loads and the ring and
// state stores in flight. Every block sums the C partials in rank order, so all get the same b, a and rms(o); a
// block receives everything it reads before it goes on, so it may exit at once.
// Before waiting on its predecessor (ninfer_pdl_begin) a block loads what earlier kernels wrote and the weights:
// its state slice and b|a weights into registers, conv ring rows, A_log, dt_bias, norm weights into shared
// memory (cp.async), its first channel's conv taps, and the x its first b|a products need (x is the in_proj's
// input, two kernels back), then, where the planner asks (ba_early), the b|a dots themselves; after the wait,
// the step's own inputs (mixed, z).
// Conv ring: each of the nv/nk value heads of key head hk convolves hk's q/k channels; only the first writes
// them to the ring, each channel from one block, at positions no block of the step reads.
// xrec (where a block holds whole 32-column chunks: dv / C % 32 == 0): y also as out_proj's x̂, one int16 record
// of all B·T rows per 32 columns (xcodes.cuh qchunk_bytes(B·T), in out_proj's XQ order xq), record
// (h·dv + col0 + j) / 32, row b·T + t, so out_proj copies them instead of coding y itself (reference:
// act_records16 of the rows).
// fold (T = 1, dv = 128: 1, 2 or 4 fold blocks of 32 columns a block): also the next MoE router's raw logits
// G·x + M·y of each sequence into its row of an int64 accumulator (router_fold.py; reference: the router's
// rms_norm_zc(x_new) @ W_routerᵀ before its positive rsqrt, test_deltanet_fold.py's oracle).
// trail (a verification's, speculative decoding): also S after each token t < T - 1 into trail fp32
// [T - 1, B, nv, dk, dv], row (t, b), so that a partial acceptance keeps the state of any prefix (GpuModel.rewind
// copies the row into the slot); with a trail the step writes every new position into the conv ring, not only the
// last Kc - 1, so that the rows before any kept prefix's end hold its inputs (the ring has room: Kc - 1 + T rows).
// Reference: gated_delta_rule_recurrent(..., trail=True).
#include "common.cuh"
#include "deltanet.cuh"
#include "xcodes.cuh"  // the chunk records of y for out_proj (xrec)
#include "cluster.cuh"  // cluster_begin / cluster_wait, store_all, copy4_to_others_async

#define DN_STEP_T 8        // most tokens per sequence in one step (the ring must hold Kc - 1 + T rows)
#define DN_STEP_COLS 128   // largest dv
#define DN_STEP_CLUSTER 4  // blocks per (value head, sequence) on sm_90+ (deltanet.py STEP_CLUSTER)
#define DN_STEP_PAIR 2     // v89: clusters of 2, 4 lanes a column (deltanet.py STEP_PAIR)

// ------------------------------------------------------------------------------------------------ the step

// grid (C·nv, B) with clusters (C, 1, 1): block x = h·C + c. Block of P·dv/C threads: lane = jj + (32/P)·p,
// a warp owns 32/P adjacent columns (jj) of S and the P lanes of a column split its DK rows (delta_step).
// P = 4 at C = 1 (512 threads at dv = 128, as many registers as one block may use); P = 8 at C = 4 (256 threads
// at dv = 128: half the rows per lane and two blocks per SM, so the 27B's 192 blocks are one wave); P = 4 at C = 2
// (v89: 256 threads at dv = 128, C = 1's rows per lane at two blocks an SM, for B > 1's waves). At C = 4, with
// 32 columns a block, "row lanes" instead: lane = column, warp = p, so that every load and store of S is one
// 128-byte line, and the column sums cross the warps through shared memory (perf-history.md v56: the 35B -0.4%).
template <int DK, int C, bool TRAIL>
__device__ __forceinline__ void step_impl(const float* __restrict__ x, int H, const float* __restrict__ in_norm_w,
                                          float eps_in, const uint16_t* __restrict__ w_ba,
                                          const float* __restrict__ mixed, int ld_mixed,
                                          const float* __restrict__ conv_w, float* __restrict__ conv_state, int ring,
                                          const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                          const float* __restrict__ norm_w, float eps,
                                          float* __restrict__ ssm_state, const int* __restrict__ slot,
                                          const int* __restrict__ pos, float* __restrict__ out,
                                          uint8_t* __restrict__ xrec, int xq, int T, int nk, int nv, int dv, int Kc,
                                          int ba_early, const __half* __restrict__ fold_mt,
                                          const float* __restrict__ fold_ms,
                                          const uint16_t* __restrict__ fold_wt, const float* __restrict__ fold_gain,
                                          long long* __restrict__ fold_acc, int fold_ld, int fold_n,
                                          float* __restrict__ trail) {
    constexpr int P = C == DN_STEP_CLUSTER ? 8 : 4;  // lanes per column of S
    constexpr int R = DK / P;                  // rows of S per lane
    constexpr int L = 32 / P;                  // columns per warp
    constexpr int QK = DK / C;                 // q (and k) channels each block convolves
    constexpr int MAXC = DN_STEP_COLS / C;     // most columns per block
    constexpr int MAXCH = 2 * QK + MAXC;       // most conv channels per block
    // b|a elements per thread whose weights are loaded before the wait (any more: after it); at C = 4 and
    // dv = 128 the cluster's 1024 threads cover H <= 6144 so (the family: 2048 to 5120)
    constexpr int PRE = C == DN_STEP_CLUSTER ? 6 : 4;
    constexpr int TP = 2;                      // tokens per b|a pass: 3·TP accumulators
    // the router fold's 32-column blocks a block holds at dv = 128, and threads a logit, each summing FNB / FTL of
    // them (v88: the one-block step, 512 threads over its 4 blocks; C = 2: 256 threads over 2; C = 4: one block)
    constexpr int FNB = DN_STEP_COLS / 32 / C, FTL = C == 1 ? 2 : 1, FQ = FNB / FTL;
    // q, k of the key head (all DK) and v of this block's columns
    constexpr int QKV = (2 * DK + MAXC) * DN_STEP_T;
    __shared__ __align__(16) float sqkv[QKV];
    float(*sq)[DK] = reinterpret_cast<float(*)[DK]>(sqkv);
    float(*sk)[DK] = reinterpret_cast<float(*)[DK]>(sqkv + DN_STEP_T * DK);
    float(*sv)[MAXC] = reinterpret_cast<float(*)[MAXC]>(sqkv + 2 * DN_STEP_T * DK);
    __shared__ float so[DN_STEP_T][MAXC];                       // o of this block's columns
    __shared__ float seq[DN_KMAX - 1 + DN_STEP_T][MAXCH];       // conv inputs: row i is position p0 - DN_KMAX + 1 + i
    __shared__ float red[MAXC / L][3 * DN_STEP_T];              // per warp: Σ x², Σ b, Σ a of each token
    __shared__ float part[C][3 * DN_STEP_T];                    // the same per block of the cluster
    __shared__ float opart[C][DN_STEP_T];                       // per block: Σ o² over its columns
    __shared__ uint64_t obar;                                   // C > 1: opart's C·T stores arrived
    __shared__ uint64_t xbar;                                   // C > 1: the b|a sums and q/k channels arrived
    __shared__ float sba[DN_STEP_T][2];                         // β, e^g of each token
    __shared__ float sz[DN_STEP_T][MAXC], snw[MAXC], sAdt[2];   // z and norm_w of its columns; A_log, dt_bias
    __shared__ __align__(16) float sfx[16 * FNB], sfg[16 * FNB];  // v73: the fold's elements of x and of 1 + w_post
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    const int c = blockIdx.x % C, h = blockIdx.x / C, b = blockIdx.y;
    const int cols = dv / C, col0 = c * cols;  // this block's columns of S
    // row lanes (C > 1, 32 columns, P warps): lane = column, warp = the row phase p, so that each load and store of
    // S is one 128-byte line; the column sums cross the warps through shared memory (dred) instead of shuffles
    const bool rl = C > 1 && cols == 32 && nw == P;
    const int jj = lane % L, p = rl ? warp : lane / L, jc = rl ? lane : warp * L + jj;
    // row lanes' sums over each warp's rows, by token parity: Σ S k̂, Σ S q̂, Σ q̂ k̂
    __shared__ float dred[2][P][3][32];
    const int hk = h / (nv / nk);
    const int conv_dim = 2 * nk * DK + nv * dv;
    const int sl = slot[b], p0 = pos[b];  // uploaded before the graph ran: safe to read before the wait
    // p0's ring row now, pinned by an empty asm: with the fold's pre-wait loads ptxas put pos on the state's
    // scoreboard, and the rest of the pre-wait section waited for the whole state slice (v73 review)
    const int rp0 = p0 % ring;  // ring row of position p0; p0 + d (|d| <= 8 < ring) is one wrap away
    asm volatile("" ::"r"(rp0) : "memory");
#if DN_CLUSTERS
    if (C > 1 && tid == 0) {  // ready before this block's arrival (cluster_begin): senders wait for it (cluster_wait)
        mbar_init(smem_addr(&obar), 1);
        mbar_init(smem_addr(&xbar), 1);
        mbar_init_fence();
        mbar_expect_tx(smem_addr(&obar), 4u * C * T);
        mbar_expect_tx(smem_addr(&xbar), 4u * (3 * C * T + (C - 1) * 2 * T * QK));
    }
#endif
    cluster_begin<C>();

    // Before the wait. The state slice and the ring rows before p0 were written by this layer's previous step,
    // long finished; the rest are weights. The state loads go first: they are the most.
    float* const Sb = ssm_state + ((size_t)sl * nv + h) * DK * dv + col0;  // this block's columns of S
    float* S = Sb + jc;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = S[(size_t)(P * r + p) * dv];

    const int g0 = c * nt + tid, G = C * nt;  // this thread's b|a elements: k = g0 + n·G
    const uint16_t* wb = w_ba + (size_t)h * H;
    const uint16_t* wa = w_ba + (size_t)(nv + h) * H;
    float fb[PRE], fa[PRE];  // W_b[k]·(1 + n_k), W_a[k]·(1 + n_k)
#pragma unroll
    for (int n = 0; n < PRE; ++n) {
        const int k = g0 + n * G;
        const float gk = k < H ? 1.f + in_norm_w[k] : 0.f;
        fb[n] = k < H ? bf16_to_f32(wb[k]) * gk : 0.f;
        fa[n] = k < H ? bf16_to_f32(wa[k]) * gk : 0.f;
    }

    // conv channels of this block: ci < QK q, < 2·QK k, then v of its columns; thread tid's first is tid
    const int nch = 2 * QK + cols;
    auto channel = [&](int ci) {
        return ci < QK ? hk * DK + c * QK + ci
                       : ci < 2 * QK ? nk * DK + hk * DK + c * QK + ci - QK : 2 * nk * DK + h * dv + col0 + ci - 2 * QK;
    };
    float* ring0 = conv_state + (size_t)sl * ring * conv_dim;
    auto row_of = [&](int d) { const int r = rp0 + d; return r < 0 ? r + ring : r >= ring ? r - ring : r; };
    // The Kc - 1 positions before p0 from the ring into seq (cp.async; positions < 0 as zeros); each thread
    // copies and later reads only its own channels. Token t meets tap i - w0 at row t + i (i >= w0), the
    // taps in registers, cw[i] (thread tid's first channel: loaded here).
    const int w0 = DN_KMAX - Kc;
    for (int ci = tid; ci < nch; ci += nt) {
        const int ch = channel(ci);
        for (int i = w0; i < DN_KMAX - 1; ++i) {
            const int d = i - (DN_KMAX - 1);  // position p0 + d
            cp_async_small<4>(smem_addr(&seq[i][ci]), ring0 + (size_t)row_of(d) * conv_dim + ch, p0 + d >= 0);
        }
    }
    float cw[DN_KMAX];
    auto load_taps = [&](int ch) {
#pragma unroll
        for (int i = 0; i < DN_KMAX; ++i) cw[i] = i >= w0 ? conv_w[(size_t)(i - w0) * conv_dim + ch] : 0.f;
    };
    if (tid < nch) load_taps(channel(tid));
    // the gated norm's weights and the head's A_log, dt_bias into shared memory (read after a barrier)
    for (int j = tid; j < cols; j += nt) cp_async_small<4>(smem_addr(&snw[j]), norm_w + col0 + j, true);
    if (tid < 2) cp_async_small<4>(smem_addr(&sAdt[tid]), (tid == 0 ? A_log : dt_bias) + h, true);

    // x, the layer input, was written by the kernel before the in_proj GEMV that precedes this one (whose
    // blocks all passed their own wait before this launch began): its first TP tokens' PRE elements load now
    // (C = 4: at C = 1, 512 threads a block, holding them spilled; C = 2 holds C = 1's state registers)
    constexpr bool XPRE = C == DN_STEP_CLUSTER;
    const float* xb = x + (size_t)b * T * H;
    float xv0[XPRE ? TP : 1][XPRE ? PRE : 1];
#pragma unroll
    for (int t = 0; t < (XPRE ? TP : 0); ++t)
#pragma unroll
        for (int n = 0; n < PRE; ++n) xv0[t][n] = t < T && g0 + n * G < H ? xb[(size_t)t * H + g0 + n * G] : 0.f;

    // v73: the router fold (router_fold.py). One token a sequence, 32 columns a fold block: this block's fold
    // blocks f = (h·C + c)·FNB + q, q < FNB, sum rows 32f.. of fold_mt [nb, ld, 32] against their y and rows 16f..
    // of fold_wt [nb, ld, 16] against (1 + w_post)·x. C = 2, 4: thread e logit e (the last warp also logit nt, a
    // lane a row); one block (v88): threads 2e, 2e + 1 logit e, two fold blocks each (the last warp also logit
    // nt / 2). x (readable now, see above) and the gain go to shared memory by cp.async with the ring rows.
    // Sequence b's sums go to row b of fold_acc [B, fold_ld] (v87).
    const bool fold = fold_acc != nullptr && T == 1 && cols == 32 * FNB;
    long long* const facc = fold_acc + (size_t)b * fold_ld;
    // deltanet.step refuses these: never skip or drop a term silently
    if (fold_acc != nullptr &&
        (!fold || fold_n > nt / FTL + 1 || fold_ld < fold_n || H > 16 * FNB * (int)gridDim.x)) __trap();
    const int fb_ = (h * C + c) * FNB, fk0 = min(H, fb_ * 16), fkn = min(H, fk0 + 16 * FNB) - fk0;
    const __half* fmt = fold_mt + (size_t)fb_ * fold_ld * 32;     // fold block fb_ + q: q·fold_ld·32 on
    const uint16_t* fwt = fold_wt + (size_t)fb_ * fold_ld * 16;   // and q·fold_ld·16 on
    if (fold && tid < 8 * FNB) {  // chunks of x, then of the gain; past fkn zero-filled (fk0 = 16f: 64-byte aligned)
        const int cq = tid & (4 * FNB - 1), n = min(4, fkn - 4 * cq);
        float* dst = (tid < 4 * FNB ? sfx : sfg) + 4 * cq;
        if (n > 0)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                         "l"((tid < 4 * FNB ? xb : fold_gain) + fk0 + 4 * cq), "r"(4 * n) : "memory");
        else
            *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // its W_router rows (thread e: 16 bf16, 32 contiguous bytes; weights), summed once the cluster's sums are in: by
    // then long landed, so that no wait on their scoreboard holds the step. At C = 1 and 2 (several fold blocks
    // a thread) they are read on the tail instead, where the state's 32 registers a thread are free
    uint4 fw[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    if (FNB == 1 && fold && tid < fold_n) {
        const uint4* w4 = reinterpret_cast<const uint4*>(fwt + (size_t)tid * 16);
        fw[0] = w4[0], fw[1] = w4[1];
    }

    // b|a of every token: this thread's share of the dots, then per warp (red). Before the wait where the planner
    // asks (ba_early: x is readable then, see above), else after the step's own loads are issued. The C = 1
    // kernels always compute after (one copy of the loop: two spilled at dk = 32 on sm_120a; they run where
    // clusters are not, mostly GPUs without the programmatic launch, whose wait is nothing).
    auto ba_partials = [&]() {
        for (int t0 = 0; t0 < T; t0 += TP) {
            float acc[3 * TP];
#pragma unroll
            for (int i = 0; i < 3 * TP; ++i) acc[i] = 0.f;
            auto dot_x = [&](int t, float xv, float fbk, float fak) {
                acc[3 * t] = fmaf(xv, xv, acc[3 * t]);
                acc[3 * t + 1] = fmaf(fbk, xv, acc[3 * t + 1]);
                acc[3 * t + 2] = fmaf(fak, xv, acc[3 * t + 2]);
            };
            auto dot = [&](int k, float fbk, float fak) {
#pragma unroll
                for (int t = 0; t < TP; ++t)
                    if (t0 + t < T) dot_x(t, xb[(size_t)(t0 + t) * H + k], fbk, fak);
            };
#pragma unroll
            for (int n = 0; n < PRE; ++n) {
                if (g0 + n * G >= H) continue;
                if (XPRE && t0 == 0) {  // x loaded before the wait
#pragma unroll
                    for (int t = 0; t < TP; ++t)
                        if (t < T) dot_x(t, xv0[XPRE ? t : 0][XPRE ? n : 0], fb[n], fa[n]);
                } else {
                    dot(g0 + n * G, fb[n], fa[n]);
                }
            }
#pragma unroll(C == 1 ? 2 : 1)  // the family's H needs no more at C = 4
            for (int k = g0 + PRE * G; k < H; k += G) {
                const float gk = 1.f + in_norm_w[k];
                dot(k, bf16_to_f32(wb[k]) * gk, bf16_to_f32(wa[k]) * gk);
            }
#pragma unroll
            for (int i = 0; i < 3 * TP; ++i) {
                if (3 * t0 + i < 3 * T) {
                    const float v = warp_sum(acc[i]);
                    if (lane == 0) red[warp][3 * t0 + i] = v;
                }
            }
        }
    };
    const bool early = C > 1 && ba_early;
    if constexpr (C > 1) {
        if (early) ba_partials();
    }

    // out_proj's GEMV after it reads only weights before its wait: it may start launching now (perf-history.md v53)
    ninfer_pdl_begin_early();

    // The predecessor's outputs: the step's conv inputs into seq, and z of this block's columns into sz
    // (cp.async, issued before any b|a loads so that they overlap)
    const size_t row0 = (size_t)b * T;  // first row of sequence b
    const float* xm = mixed + row0 * ld_mixed;
    for (int ci = tid; ci < nch; ci += nt) {
        const int ch = channel(ci);
        for (int t = 0; t < T; ++t)
            cp_async_small<4>(smem_addr(&seq[DN_KMAX - 1 + t][ci]), xm + (size_t)t * ld_mixed + ch, true);
    }
    for (int it = tid; it < T * cols; it += nt) {
        const int t = it / cols, j = it - t * cols;
        cp_async_small<4>(smem_addr(&sz[t][j]), xm + (size_t)t * ld_mixed + conv_dim + (size_t)h * dv + col0 + j, true);
    }
    cp_async_commit();
    if (!early) ba_partials();

    // conv of this block's channels into sq/sk/sv (this block's copies); taps summed in order as deltanet_conv
    NINFER_TL_MARK(0);  // b|a partial dots done
    cp_async_wait<0>();
    for (int ci = tid; ci < nch; ci += nt) {
        if (ci != tid) load_taps(channel(ci));  // more channels than threads (small dv at C = 1)
        float* dst = ci < QK ? &sq[0][c * QK + ci] : ci < 2 * QK ? &sk[0][c * QK + ci - QK] : &sv[0][ci - 2 * QK];
        const int ld = ci < 2 * QK ? DK : MAXC;
        for (int t = 0; t < T; ++t) {
            float a = 0.f;
#pragma unroll
            for (int i = 0; i < DN_KMAX; ++i)
                if (i >= w0) a = fmaf(cw[i], seq[t + i][ci], a);
            dst[t * ld] = siluf_(a);
        }
    }
    __syncthreads();
    NINFER_TL_MARK(1);  // conv done
    cluster_wait<C>();  // every block of the cluster has started: stores into its shared memory may begin
    if (tid < 3 * T) {  // this block's b|a sums into every block
        float v = 0.f;
        for (int w = 0; w < nw; ++w) v += red[w][tid];
        store_all<C>(&part[c][tid], v, &xbar);
    }
    // C > 1: the exchange completes on xbar, not on a cluster barrier, whose release would wait for this thread's
    // loads and stores in flight (the state's, the ring's below); each block waits only for what it receives
    if constexpr (C > 1) {  // this block's q, k channels into the other blocks, 4 floats a store
        for (int i = tid; i < 2 * T * (QK / 4); i += nt) {
            const int t = i / (2 * (QK / 4)), e = i - t * 2 * (QK / 4);
            copy4_to_others_async<C>((e < QK / 4 ? sq[t] : sk[t]) + c * QK + 4 * (e % (QK / 4)), c, &xbar);
        }
    } else {
        __syncthreads();
    }
    // the new positions among the last Kc - 1 into the ring (with a trail all T: a rewind may keep any prefix),
    // each channel by its block; only the first value head of a key head writes the q/k channels
    const bool own_qk = h % (nv / nk) == 0;
    for (int ci = tid; ci < nch; ci += nt) {
        if (ci < 2 * QK && !own_qk) continue;
        const int ch = channel(ci);
        for (int t = TRAIL ? 0 : max(0, T - (Kc - 1)); t < T; ++t)
            ring0[(size_t)row_of(t) * conv_dim + ch] = seq[DN_KMAX - 1 + t][ci];
    }

#if DN_CLUSTERS
    if constexpr (C > 1) mbar_wait(smem_addr(&xbar), 0);  // the other blocks' b|a sums and q/k channels are in
#endif
    NINFER_TL_MARK(2);  // the cluster's b|a sums and q/k channels are in
    float fxs = 0.f;  // v73: this block's x term of logit tid (sfx, sfg: in since the conv's barrier)
    if (FNB == 1 && fold) {
        const uint32_t ww[8] = {fw[0].x, fw[0].y, fw[0].z, fw[0].w, fw[1].x, fw[1].y, fw[1].z, fw[1].w};
#pragma unroll
        for (int u = 0; u < 8; ++u)  // rows fk0 + 2u, + 1 (bf16 pairs, the low half first; zero past fkn)
            fxs = fmaf(__uint_as_float(ww[u] & 0xffff0000u), sfg[2 * u + 1] * sfx[2 * u + 1],
                       fmaf(__uint_as_float(ww[u] << 16), sfg[2 * u] * sfx[2 * u], fxs));
    }
    // q̂ = q·rsqrt(Σq² + eps)·dk^-0.5, k̂ = k·rsqrt(Σk² + eps): one warp per vector, in place; β and e^g
    const float q_scale = rsqrtf((float)DK);
    for (int vi = warp; vi < 2 * T; vi += nw) {
        const bool is_k = vi & 1;
        float* v = is_k ? sk[vi >> 1] : sq[vi >> 1];
        float ss = 0.f;
        for (int i = lane; i < DK; i += 32) ss = fmaf(v[i], v[i], ss);
        ss = warp_sum(ss);
        const float scale = rsqrtf(ss + DN_L2_EPS) * (is_k ? 1.f : q_scale);
        for (int i = lane; i < DK; i += 32) v[i] *= scale;
    }
    if (tid < T) {
        float ss = 0.f, sb = 0.f, sa = 0.f;
#pragma unroll
        for (int r = 0; r < C; ++r) {
            ss += part[r][3 * tid];
            sb += part[r][3 * tid + 1];
            sa += part[r][3 * tid + 2];
        }
        const float rn = __frsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)H), eps_in));
        sba[tid][0] = sigmoidf_(rn * sb);
        sba[tid][1] = __expf(-__expf(sAdt[0]) * softplusf_(rn * sa + sAdt[1]));
    }
    __syncthreads();
    NINFER_TL_MARK(5);  // q̂, k̂, β and e^g ready
    // v71/v73: the router fold's M rows this block reads on its tail, asked of L2 now, behind the step's
    // own loads (served in issue order: perf-history.md v66), so that they land while the delta rule runs
    if (fold) {  // and the scales, and the last warp's W_router value (read before the Σ o² wait); at C = 1 and
        // 2 all the block's W_router rows
        prefetch_l2_span(fmt, (size_t)fold_ld * 64 * FNB, tid, nt);
        prefetch_l2_span(fold_ms, (size_t)fold_ld * 4, tid, nt);
        if (FNB == 1 && tid == 0) prefetch_l2(fwt + (size_t)nt * 16);
        if (FNB > 1) prefetch_l2_span(fwt, (size_t)fold_ld * 32 * FNB, tid, nt);
    }

    for (int t = 0; t < T; ++t) {
        float ov;
        if (rl) {
            ov = delta_step_rows<DK, P>(s, sk[t], sq[t], sba[t], &sv[t][jc], p, lane, dred, t);
        } else {
            ov = delta_step<DK, P>(s, sk[t], sq[t], sba[t][0], sba[t][1], sv[t][jc], p);
        }
        if (p == 0) so[t][jc] = ov;
        if (TRAIL && t + 1 < T) {  // a verification's trail: S after token t, row (t, b)
            float* St = trail + (((size_t)t * gridDim.y + b) * nv + h) * DK * dv + col0 + jc;
#pragma unroll
            for (int r = 0; r < R; ++r) St[(size_t)(P * r + p) * dv] = s[r];
        }
    }
    // The new state, now: its stores drain while o is normalised (row lanes: a 128-byte line a warp instruction).
    // Through an opaque copy of S, so that the compiler recomputes the R addresses here rather than holding them
    // from the loads (which spilled).
    {
        float* S2;
        asm("mov.b64 %0, %1;" : "=l"(S2) : "l"(S));
#pragma unroll
        for (int r = 0; r < R; ++r) S2[(size_t)(P * r + p) * dv] = s[r];
    }
    __syncthreads();  // so is complete

    // Σ o² over this block's columns, one warp per token, into every block
    for (int t = warp; t < T; t += nw) {
        float ss = 0.f;
        for (int j = lane; j < cols; j += 32) ss = fmaf(so[t][j], so[t][j], ss);
        ss = warp_sum(ss);
        if (lane == 0) {
            store_all<C>(&opart[c][t], ss, &obar);
        }
    }
    NINFER_TL_MARK(3);  // the delta rule done, Σ o² sent, the state's stores issued
    // v71/v73: the fold's M loads while the cluster's Σ o² arrive (logit e: column e's 32 fp16 values of a fold
    // block, 64 contiguous bytes), read on the tail; the last warp's values for logit nt / FTL kept raw till then
    // (sass_waits.py). Thread tid: logit e of fold blocks fb_ + q, q = (tid % FTL)·FQ + qq.
    const int fe = tid / FTL, fq0 = (tid % FTL) * FQ, fne = nt / FTL;
    const bool fmine = fold && fe < min(fold_n, fne);
    uint4 fm[FQ][4], fwq[FNB > 1 ? FQ : 1][2];
    float fms = 0.f, fms2 = 0.f;
    uint16_t fm2[FNB], fw2[FNB];
    const bool extra = fold && fold_n > fne && warp == nw - 1;
    if (fold) {
#pragma unroll
        for (int qq = 0; qq < FQ; ++qq) {
            const size_t at = (size_t)(fq0 + qq) * fold_ld + fe;  // logit fe's row of fold block fb_ + fq0 + qq
            const uint4* m4 = reinterpret_cast<const uint4*>(fmt + at * 32);
#pragma unroll
            for (int i = 0; i < 4; ++i) fm[qq][i] = fmine ? m4[i] : make_uint4(0u, 0u, 0u, 0u);
            if constexpr (FNB > 1) {
                const uint4* w4 = reinterpret_cast<const uint4*>(fwt + at * 16);
                fwq[qq][0] = fmine ? w4[0] : make_uint4(0u, 0u, 0u, 0u);
                fwq[qq][1] = fmine ? w4[1] : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        if (fmine) fms = fold_ms[fe];
        if (extra) {
#pragma unroll
            for (int q = 0; q < FNB; ++q) {
                const size_t at = (size_t)q * fold_ld + fne;
                fm2[q] = reinterpret_cast<const uint16_t*>(fmt)[at * 32 + lane];
                fw2[q] = lane < 16 ? fwt[at * 16 + lane] : 0;
            }
            fms2 = fold_ms[fne];
        }
    }
    // then wait for all C blocks' sums
    if constexpr (C == 1) __syncthreads();
#if DN_CLUSTERS
    else mbar_wait(smem_addr(&obar), 0);
#endif
    NINFER_TL_MARK(4);

    // y = (w · o·rsqrt(mean(o²) + eps)) · SiLU(z) for this block's columns
    for (int it = tid; it < T * cols; it += nt) {
        const int t = it / cols, j = it - t * cols;
        float ss = 0.f;
#pragma unroll
        for (int r = 0; r < C; ++r) ss += opart[r][t];
        const float inv = rsqrtf(ss / (float)dv + eps);
        const size_t at = (row0 + t) * nv * dv + (size_t)h * dv + col0 + j;
        const float yv = (snw[j] * (so[t][j] * inv)) * siluf_(sz[t][j]);
        out[at] = yv;
        so[t][j] = yv;  // for the fold below (each element written and read by this thread first)
        if (xrec) {  // cols % 32 == 0: the warp is a chunk, lane j % 32 its element (whole warps: T·cols % 32 == 0)
            const int rows = (int)gridDim.y * T;
            uint8_t* rec = xrec + (size_t)(((size_t)h * dv + col0 + j) >> 5) * qchunk_bytes(rows);
            store_code1_rows_xq(xq, rec, rows, (int)row0 + t, j & 31, yv);
        }
    }
    // v71/v73: this block's share of the next router's raw logits, G·x_new = G·x + (G·Ŵ_out)·y with
    // G = W_router·diag(1 + w_post) (router_fold.py: fp16 M with a power of two a logit that fold_ms undoes),
    // added as fixed-point int64 (2^-32): exact in any order, so that every block of the fused MoE routes the same.
    // Each fold block's sum is rounded once, as on clusters, so both kernels add the same integers for the same y.
    if (fold) {
        __syncthreads();
        long long v = 0;
        if (fmine) {
#pragma unroll
            for (int qq = 0; qq < FQ; ++qq) {
                const int q = fq0 + qq;
                const uint4* m = fm[qq];
                const uint32_t mw[16] = {m[0].x, m[0].y, m[0].z, m[0].w, m[1].x, m[1].y, m[1].z, m[1].w,
                                         m[2].x, m[2].y, m[2].z, m[2].w, m[3].x, m[3].y, m[3].z, m[3].w};
                float a = 0.f;
#pragma unroll
                for (int j = 0; j < 16; ++j) {  // rows 2j, 2j + 1 of M (fp16 pairs, the low half first)
                    const float2 m2 = __half22float2(*reinterpret_cast<const __half2*>(&mw[j]));
                    a = fmaf(m2.y, so[0][32 * q + 2 * j + 1], fmaf(m2.x, so[0][32 * q + 2 * j], a));
                }
                float fx = fxs;
                if constexpr (FNB > 1) {  // the x term as C = 4's (after the cluster wait there)
                    const uint4* w = fwq[qq];
                    const uint32_t ww[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
                    const float* gq = sfg + 16 * q;
                    const float* xq_ = sfx + 16 * q;
                    fx = 0.f;
#pragma unroll
                    for (int u = 0; u < 8; ++u)
                        fx = fmaf(__uint_as_float(ww[u] & 0xffff0000u), gq[2 * u + 1] * xq_[2 * u + 1],
                                  fmaf(__uint_as_float(ww[u] << 16), gq[2 * u] * xq_[2 * u], fx));
                }
                v += __float2ll_rn(fmaf(a, fms, fx) * 0x1p32f);
            }
        }
        if constexpr (FTL == 2) v += __shfl_xor_sync(0xffffffffu, v, 1);  // the pair's other fold blocks
        if (fmine && tid % FTL == 0) atomicAdd(reinterpret_cast<unsigned long long*>(facc + fe), (unsigned long long)v);
        if (extra) {
            long long ve = 0;
#pragma unroll
            for (int q = 0; q < FNB; ++q) {
                const float m2 = __half2float(__ushort_as_half(fm2[q])) * fms2;
                const float gx = lane < 16 ? sfg[16 * q + (lane & 15)] * sfx[16 * q + (lane & 15)] : 0.f;
                const float a = warp_sum(fmaf(m2, so[0][32 * q + lane], bf16_to_f32(fw2[q]) * gx));
                ve += __float2ll_rn(a * 0x1p32f);
            }
            if (lane == 0) atomicAdd(reinterpret_cast<unsigned long long*>(facc + fne), (unsigned long long)ve);
        }
    }
}

#define DN_CAT_(a, b) a##b
#define DN_CAT(a, b) DN_CAT_(a, b)
// The entry points' parameters; trail only in the _trail entries (the decode kernels are the same code without it)
#define DN_STEP_PARAMS                                                                                            \
    const float *x, int H, const float *in_norm_w, float eps_in, const uint16_t *w_ba, const float *mixed,        \
        int ld_mixed, const float *conv_w, float *conv_state, int ring, const float *A_log, const float *dt_bias, \
        const float *norm_w, float eps, float *ssm_state, const int *slot, const int *pos, float *out,            \
        uint8_t *xrec, int xq, int T, int nk, int nv, int dv, int Kc, int ba_early, const __half *fold_mt,        \
        const float *fold_ms, const uint16_t *fold_wt, const float *fold_gain, long long *fold_acc, int fold_ld,  \
        int fold_n
#define DN_STEP_ARGS                                                                                              \
    x, H, in_norm_w, eps_in, w_ba, mixed, ld_mixed, conv_w, conv_state, ring, A_log, dt_bias, norm_w, eps,        \
        ssm_state, slot, pos, out, xrec, xq, T, nk, nv, dv, Kc, ba_early, fold_mt, fold_ms, fold_wt, fold_gain,   \
        fold_acc, fold_ld, fold_n
#define DN_STEP_BOUNDS(C) __launch_bounds__((C == DN_STEP_CLUSTER ? 8 : 4) * DN_STEP_COLS / C, C == 1 ? 1 : 2)
#define DN_STEP_ENTRY(NAME, DK, C)                                                                                \
    extern "C" __global__ void DN_STEP_BOUNDS(C) NAME(DN_STEP_PARAMS) {                                          \
        step_impl<DK, C, false>(DN_STEP_ARGS, nullptr);                                                           \
    }
#define DN_STEP_TRAIL_ENTRY(NAME, DK, C)                                                                          \
    extern "C" __global__ void DN_STEP_BOUNDS(C) NAME(DN_STEP_PARAMS, float* trail) {                            \
        step_impl<DK, C, true>(DN_STEP_ARGS, trail);                                                              \
    }
// deltanet_step_dk{DK} (one block per head), deltanet_step_dk{DK}_c{DN_STEP_PAIR} and _c{DN_STEP_CLUSTER} (a
// cluster per head); deltanet_step_trail_dk{DK}[_c{DN_STEP_CLUSTER}], the shapes one sequence's verification takes
#define DN_STEP(DK)                                                                           \
    DN_STEP_ENTRY(deltanet_step_dk##DK, DK, 1)                                                \
    DN_STEP_ENTRY(DN_CAT(deltanet_step_dk##DK##_c, DN_STEP_PAIR), DK, DN_STEP_PAIR)           \
    DN_STEP_ENTRY(DN_CAT(deltanet_step_dk##DK##_c, DN_STEP_CLUSTER), DK, DN_STEP_CLUSTER)     \
    DN_STEP_TRAIL_ENTRY(deltanet_step_trail_dk##DK, DK, 1)                                    \
    DN_STEP_TRAIL_ENTRY(DN_CAT(deltanet_step_trail_dk##DK##_c, DN_STEP_CLUSTER), DK, DN_STEP_CLUSTER)
DN_STEP(16)
DN_STEP(32)
DN_STEP(64)
DN_STEP(128)
