// deltanet.cu: the Gated DeltaNet mixer between its projections (ninfer_rt/reference/model.py
// GatedDeltaNet.__call__ from mixed/z/b/a to the gated-norm output y, before out_proj).
//
// Decode steps of T = 1..8 tokens are one launch from the layer input x to y (deltanet_step_dk* in
// deltanet_step.cu: b|a with the input RMSNorm folded in, conv, delta rule, gated norm).
// Any T (prefill, other shapes) is three launches:
//   deltanet_conv            c = SiLU(causal depthwise conv(mixed[:, :conv_dim]))      ops.causal_conv1d(_step)
//                            and the conv state updated once per channel
//   deltanet_recurrent_dk*   o = gated delta rule over T tokens, one block per          ops.gated_delta_rule_recurrent
//   (dk = 16, 32, 64, 128)   (sequence, value head, slice of dv columns); the state slice lives in registers,
//                            read once and written once per launch; token inputs staged by cp.async (sm_80+)
//   deltanet_gated_norm      y = w · o / rms(o) · SiLU(z), in place on o                ops.gated_rms_norm
// A prompt (prefill) runs the delta rule in chunks instead: deltanet_chunked_dk* in deltanet_chunked.cu.
//
// Layouts (all fp32, row-major; M = B·T rows, row m = b·T + t):
//   mixed      [M, ld_mixed]  columns [q (nk·dk) | k (nk·dk) | v (nv·dv) | z (nv·dv)]; conv_dim = 2·nk·dk + nv·dv
//   ba         [M, 2·nv]      [b | a]: beta = sigmoid(b), g = -exp(A_log)·softplus(a + dt_bias)
//   conv_w     [Kc, conv_dim] tap-major, tap Kc-1 multiplies the current token
//   conv_state [slots, ring, conv_dim]  a ring of pre-conv inputs: position p of a sequence in row p % ring;
//                            positions < 0 read as 0; ring >= Kc - 1 + T, so a step's writes (its new positions)
//                            never land on rows another block still reads (the Kc - 1 before pos)
//   ssm_state  [slots, nv, dk, dv]      S[h][i][j]: key index i, value index j
//   slot, pos  int32 [B]      sequence b owns slot[b] of both states; its first new token is at position pos[b]
//   c          [M, conv_dim]  conv output (scratch)
//   o / out    [M, nv·dv]
// Value head h reads key head h / (nv/nk). The columns j of S are independent in the delta rule
// (Δ_j = β (v_j − Σ_i S_ij k̂_i), S_ij += k̂_i Δ_j, o_j = Σ_i S_ij q̂_i), which is why dv can be split over blocks.
// One token of the delta rule on a column of S (delta_step) lives in deltanet.cuh, shared with deltanet_step.cu.
#include "common.cuh"
#include "deltanet.cuh"

#define DN_CONV_TOKENS 8 // tokens per conv thread; must be >= DN_KMAX (see deltanet_conv)
#define DN_MAX_COLS 32   // columns of S per recurrent block: up to 4 warps × 8 columns
static_assert(DN_CONV_TOKENS >= DN_KMAX, "conv chunks z > 0 must not reach back into the conv state");

// ------------------------------------------------------------------------------------------------ conv ring

// Pre-conv input of position p (one channel; st points at the channel in row 0 of the slot's ring).
__device__ __forceinline__ float ring_read(const float* st, int p, int ring, int conv_dim) {
    return p < 0 ? 0.f : st[(size_t)(p % ring) * conv_dim];
}

// After a step of T tokens from position p0: the last Kc - 1 positions that are new (>= p0) go into the ring;
// x points at the channel in the step's first mixed row. Older positions in the window are there already.
__device__ __forceinline__ void ring_store_last(float* st, const float* x, int ld_mixed, int p0, int T, int Kc,
                                                int ring, int conv_dim) {
    for (int t = max(0, T - (Kc - 1)); t < T; ++t) st[(size_t)((p0 + t) % ring) * conv_dim] = x[(size_t)t * ld_mixed];
}

// ------------------------------------------------------------------------------------------------ conv

// One thread per (channel, sequence, chunk of DN_CONV_TOKENS tokens), so a long T spreads over many threads.
// The last DN_KMAX elements of the input sequence [ring rows, mixed rows] sit in registers, newest at
// win[DN_KMAX-1]; all register indices are compile-time (no local memory). Position i of the window meets tap
// i - (KMAX - Kc); positions <= KMAX - Kc are never used. Chunk z > 0 starts at token >= KMAX, so it reads only
// mixed rows: chunk 0 alone reads the ring and writes the new positions into it, each channel by the thread
// that read it (no race between blocks). grid (ceil(conv_dim / blockDim.x), B, ceil(T / DN_CONV_TOKENS)).
extern "C" __global__ void deltanet_conv(const float* __restrict__ mixed, int ld_mixed,
                                         const float* __restrict__ conv_w, float* __restrict__ conv_state,
                                         const int* __restrict__ slot, const int* __restrict__ pos, int ring,
                                         float* __restrict__ c, int T, int conv_dim, int Kc) { ninfer_pdl_begin();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    const int t0 = blockIdx.z * DN_CONV_TOKENS;
    if (ch >= conv_dim) return;
    const int n = min(DN_CONV_TOKENS, T - t0);
    const int p0 = pos[b];
    float* st = conv_state + (size_t)slot[b] * ring * conv_dim + ch;
    const float* x = mixed + (size_t)b * T * ld_mixed + ch;
    float* y = c + (size_t)b * T * conv_dim + ch;

    const int w0 = DN_KMAX - Kc;
    float w[DN_KMAX], win[DN_KMAX], xin[DN_CONV_TOKENS];
#pragma unroll
    for (int i = 0; i < DN_KMAX; ++i) {
        w[i] = i >= w0 ? conv_w[(size_t)(i - w0) * conv_dim + ch] : 0.f;
        // win[i] holds token tau = t0 - KMAX + i; a token tau < 0 is ring position p0 + tau
        const int tau = t0 - DN_KMAX + i;
        win[i] = i <= w0 ? 0.f : (tau >= 0 ? x[(size_t)tau * ld_mixed] : ring_read(st, p0 + tau, ring, conv_dim));
    }
#pragma unroll
    for (int u = 0; u < DN_CONV_TOKENS; ++u) xin[u] = u < n ? x[(size_t)(t0 + u) * ld_mixed] : 0.f;
#pragma unroll
    for (int u = 0; u < DN_CONV_TOKENS; ++u) {
        if (u < n) {
#pragma unroll
            for (int i = 0; i < DN_KMAX - 1; ++i) win[i] = win[i + 1];
            win[DN_KMAX - 1] = xin[u];
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < DN_KMAX; ++i)
                if (i >= w0) acc = fmaf(w[i], win[i], acc);
            y[(size_t)(t0 + u) * conv_dim] = siluf_(acc);
        }
    }
    if (blockIdx.z == 0) ring_store_last(st, x, ld_mixed, p0, T, Kc, ring, conv_dim);
}

// ------------------------------------------------------------------------------------------------ recurrent

// One pass of up to TT tokens staged in shared memory: q and k of the block's key head (raw, then
// L2-normalised in place), v of the block's columns, and [b, a] (then turned into [beta, e^g] in place).
template <int DK, int TT>
struct Stage {
    float q[TT][DK], k[TT][DK], v[TT][DN_MAX_COLS], ba[TT][2];
};

// Thread layout: lane = jj + 8·p. A warp owns 8 adjacent columns (jj) of S; the 4 lanes p of one column split
// its DK rows as i = 4·r + p (r < DK/4), so a column's dot products are a partial sum plus two shuffles, and
// smem reads of k̂/q̂ hit 4 consecutive words (no bank conflict).
// grid (dv / (8·warps), nv, B), block 32·warps with warps in {1, 2, 4}.
template <int DK>
__device__ __forceinline__ void recurrent_impl(const float* __restrict__ c, const float* __restrict__ ba,
                                               const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                               float* __restrict__ ssm_state, const int* __restrict__ slot,
                                               float* __restrict__ o, int T, int nk, int nv, int dv) {
    constexpr int R = DK / 4;
    constexpr int TT = 16;                        // tokens per pass: two stages of DK=128 take 37 KB of static smem
    __shared__ Stage<DK, TT> stage[2];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int jj = lane & 7, p = lane >> 3;
    const int cols = nw * 8;                      // columns of this block
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (nv / nk);                 // key head of value head h
    const int jc = warp * 8 + jj;                 // this thread's column within the block
    const int col0 = blockIdx.x * cols;           // first column of the block in [0, dv)
    const int conv_dim = 2 * nk * DK + nv * dv;
    const int v_off = 2 * nk * DK + h * dv + col0;

    // the state slice: rows 4r+p of column col0+jc, loaded first so the loads overlap the staging below
    float* S = ssm_state + ((size_t)slot[b] * nv + h) * DK * dv + col0 + jc;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = S[(size_t)(4 * r + p) * dv];

    // copy the n tokens from row m0 on into sg (one commit group per pass)
    auto issue = [&](Stage<DK, TT>& sg, size_t m0, int n) {
        for (int idx = threadIdx.x; idx < n * DK; idx += blockDim.x) {
            const int tt = idx / DK, i = idx % DK;
            const float* q_src = c + (m0 + tt) * conv_dim + hk * DK + i;
            cp_async_small<4>(smem_addr(&sg.q[tt][i]), q_src, true);
            cp_async_small<4>(smem_addr(&sg.k[tt][i]), q_src + nk * DK, true);
        }
        for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
            const int tt = idx / cols, j = idx - tt * cols;
            cp_async_small<4>(smem_addr(&sg.v[tt][j]), c + (m0 + tt) * conv_dim + v_off + j, true);
        }
        if (threadIdx.x < n) {  // n <= TT <= 16 < blockDim.x
            const float* row = ba + (m0 + threadIdx.x) * 2 * nv;
            cp_async_small<4>(smem_addr(&sg.ba[threadIdx.x][0]), row + h, true);
            cp_async_small<4>(smem_addr(&sg.ba[threadIdx.x][1]), row + nv + h, true);
        }
        cp_async_commit();
    };

    const float neg_A = -__expf(A_log[h]);
    const float dtb = dt_bias[h];
    const float q_scale = rsqrtf((float)DK);
    const size_t row0 = (size_t)b * T;            // first row of sequence b
    const int npass = (T + TT - 1) / TT;

    issue(stage[0], row0, min(TT, T));
    for (int ip = 0; ip < npass; ++ip) {
        Stage<DK, TT>& sg = stage[ip & 1];
        const int t0 = ip * TT;
        const int n = min(TT, T - t0);
        const size_t m0 = row0 + t0;
        // prefetch the next pass into the other stage (its readers passed the barrier ending the last pass)
        if (ip + 1 < npass) {
            issue(stage[(ip + 1) & 1], m0 + TT, min(TT, T - t0 - TT));
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        // q̂ = q·rsqrt(Σq² + eps)·dk^-0.5, k̂ = k·rsqrt(Σk² + eps): one warp per vector, in place
        for (int vi = warp; vi < 2 * n; vi += nw) {
            const bool is_k = vi & 1;
            float* x = is_k ? sg.k[vi >> 1] : sg.q[vi >> 1];
            float ss = 0.f;
            for (int i = lane; i < DK; i += 32) ss = fmaf(x[i], x[i], ss);
            ss = warp_sum(ss);
            const float scale = rsqrtf(ss + DN_L2_EPS) * (is_k ? 1.f : q_scale);
            for (int i = lane; i < DK; i += 32) x[i] *= scale;  // the same elements this lane summed
        }
        if (threadIdx.x < n) {
            float* gb = sg.ba[threadIdx.x];
            const float bb = gb[0], aa = gb[1];
            gb[0] = sigmoidf_(bb);                               // beta
            gb[1] = __expf(neg_A * softplusf_(aa + dtb));        // e^g
        }
        __syncthreads();

        for (int tt = 0; tt < n; ++tt) {
            const float ov = delta_step<DK, 4>(s, sg.k[tt], sg.q[tt], sg.ba[tt][0], sg.ba[tt][1], sg.v[tt][jc], p);
            if (p == 0) o[(m0 + tt) * nv * dv + (size_t)h * dv + col0 + jc] = ov;
        }
        __syncthreads();  // this stage is refilled by the prefetch two passes on
    }

#pragma unroll
    for (int r = 0; r < R; ++r) S[(size_t)(4 * r + p) * dv] = s[r];
}

#define DN_RECURRENT(DK)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) deltanet_recurrent_dk##DK(                                  \
        const float* __restrict__ c, const float* __restrict__ ba, const float* __restrict__ A_log,               \
        const float* __restrict__ dt_bias, float* __restrict__ ssm_state, const int* __restrict__ slot,           \
        float* __restrict__ o, int T, int nk, int nv, int dv) { ninfer_pdl_begin();                                                   \
        recurrent_impl<DK>(c, ba, A_log, dt_bias, ssm_state, slot, o, T, nk, nv, dv);                            \
    }
DN_RECURRENT(16)
DN_RECURRENT(32)
DN_RECURRENT(64)
DN_RECURRENT(128)

// ------------------------------------------------------------------------------------------------ gated norm

// One warp per (row m, value head h), in place on o: o ← (w · o·rsqrt(mean(o²) + eps)) · SiLU(z),
// z = mixed[m, z_off + h·dv + j]. grid ceil(M·nv / warps per block).
extern "C" __global__ void deltanet_gated_norm(float* __restrict__ o, const float* __restrict__ mixed, int ld_mixed,
                                               int z_off, const float* __restrict__ norm_w, int M, int nv, int dv,
                                               float eps) { ninfer_pdl_begin();
    const int lane = threadIdx.x & 31;
    const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (gw >= (long long)M * nv) return;  // uniform per warp
    const long long m = gw / nv;
    const int h = (int)(gw - m * nv);
    float* orow = o + m * nv * dv + (long long)h * dv;
    const float* z = mixed + m * ld_mixed + z_off + (long long)h * dv;
    float ss = 0.f;
    for (int j = lane; j < dv; j += 32) ss = fmaf(orow[j], orow[j], ss);
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)dv + eps);
    for (int j = lane; j < dv; j += 32) orow[j] = (norm_w[j] * (orow[j] * inv)) * siluf_(z[j]);
}
