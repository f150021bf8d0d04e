// attention_combine.cu: attn_combine_fast, the merge of attention_decode.cu's split partials (its decode and its
// combine share split_keys, so both see each sequence's own split length), gated, and optionally also written as
// o_proj's x̂ chunk records. Same contract as attn_combine of attention.cu (ops.gated_attention per sequence; the
// scratch layout is in that file's header); tested with the decode in tests/gpu/test_attention.py and, for the
// records, test_attention_records.py.
#include "attention.cuh"
#include "xcodes.cuh"  // store_codes4: o_proj's x̂ records (xrec)

// grid (M, nH, D/32), block 8*SJ with SJ in {4, 8, 16, 32}: thread (j, c4) folds the splits j, j+SJ, ... of its
// float4 column with an online max (4 splits' loads in flight before their folds), then one block max, a shuffle +
// shared-memory sum over j. Same result as attn_combine (attention.cu):
// out[m, h*D + i] = (sum_sp acc_sp * w_sp) / (sum_sp l_sp * w_sp) * sigmoid(gate), w_sp = 2^(m_sp - max m), over
// the splits sp < ceil(n / cs) that row m's n keys reach; no keys -> 0. rt: the decode's runtime split
// (split_keys), so cs is the sequence's own. xrec (if set): the block's 32 columns also as o_proj's x̂ chunk
// record (row·D + 32·z) / 32 in XQ order xq (store_codes4; reference act_records16).
extern "C" __global__ void __launch_bounds__(256)
    attn_combine_fast(const float* __restrict__ acc, const float2* __restrict__ ml, const float* __restrict__ gate,
                      int ld_gate, const int* __restrict__ pos, const int* __restrict__ slot, float* __restrict__ out,
                      int T, int M, int nH, int D, int slots, int max_ctx, int cs, int n_splits, int rt,
                      uint8_t* __restrict__ xrec, int xq) {
    __shared__ float red_m[8];
    __shared__ float4 part_o[8][8];
    __shared__ float part_l[8];
    const int m = blockIdx.x, h = blockIdx.y, b = m / T, t = m - b * T;
    const int tid = threadIdx.x, c4 = tid & 7, j = tid >> 3, SJ = blockDim.x >> 3;
    const int lane = tid & 31, wp = tid >> 5, nw = blockDim.x >> 5;
    const int col = 32 * blockIdx.z + 4 * c4;
    const size_t row = (size_t)m * nH + h, per_split = (size_t)M * nH;
    // Before the wait: the gate (qkvg, written by a kernel the decode waited on) and the positions
    // (uploaded before the graph ran); only acc and ml are the decode's.
    float g[4] = {0.f, 0.f, 0.f, 0.f};
    if (tid < 8) {  // the finishing threads hold their gate values
        const float* gp = gate + (size_t)m * ld_gate + (size_t)h * D + col;
#pragma unroll
        for (int z = 0; z < 4; ++z) g[z] = gp[z];
    }
    const int p0 = pos[b], sl = slot[b];
    cs = split_keys(cs, n_splits, p0 + T, rt);
    const int keys = (sl >= 0 && sl < slots && p0 >= 0) ? min(p0 + t + 1, min(max_ctx, n_splits * cs)) : 0;
    const int ns = (keys + cs - 1) / cs;
    // o_proj's GEMV after it reads only weights before its wait: it may start launching now (perf-history.md v53)
    ninfer_pdl_begin_early();

    float mloc = kMasked, L = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    // 4 splits a thread per batch (for_each_split; 8 took 99 registers, too many for a block to become resident
    // beside two decode blocks, where it waits on them)
    for_each_split<4>(acc, ml, per_split, row, D, col, j, SJ, ns, [&](float2 e, float4 a) {
        const float nm = fmaxf(mloc, e.x);
        const float f = exp2f(mloc - nm), wt = exp2f(e.x - nm);
        o.x = o.x * f + a.x * wt, o.y = o.y * f + a.y * wt, o.z = o.z * f + a.z * wt, o.w = o.w * f + a.w * wt;
        L = L * f + e.y * wt;
        mloc = nm;
    });
    NINFER_TL_MARK(0);  // this thread's splits folded
    float mx = warp_max(mloc);
    if (lane == 0) red_m[wp] = mx;
    __syncthreads();
    NINFER_TL_MARK(1);  // the block's max
    mx = red_m[0];
    for (int u = 1; u < nw; ++u) mx = fmaxf(mx, red_m[u]);
    const float f = exp2f(mloc - mx);
    o.x *= f, o.y *= f, o.z *= f, o.w *= f;
    L *= f;
#pragma unroll
    for (int s = 8; s < 32; s <<= 1) {  // lanes of the same column c4 (j differs in bits 0, 1 within the warp)
        o.x += __shfl_xor_sync(kFull, o.x, s);
        o.y += __shfl_xor_sync(kFull, o.y, s);
        o.z += __shfl_xor_sync(kFull, o.z, s);
        o.w += __shfl_xor_sync(kFull, o.w, s);
        L += __shfl_xor_sync(kFull, L, s);
    }
    if (lane < 8) part_o[wp][lane] = o;
    if (lane == 0) part_l[wp] = L;
    __syncthreads();
    NINFER_TL_MARK(2);  // the block's partial sums
    float v[4] = {0.f, 0.f, 0.f, 0.f};  // lanes 8..31 of warp 0 code zeros for store_codes4's full-mask shuffles
    if (tid < 8) {
        float4 s4 = part_o[0][tid];
        float Ls = part_l[0];
        for (int u = 1; u < nw; ++u) {
            const float4 a = part_o[u][tid];
            s4.x += a.x, s4.y += a.y, s4.z += a.z, s4.w += a.w;
            Ls += part_l[u];
        }
        const float r[4] = {s4.x, s4.y, s4.z, s4.w};
        float* dst = out + row * D + col;
#pragma unroll
        for (int z = 0; z < 4; ++z) dst[z] = v[z] = Ls > 0.f ? __fdiv_rn(r[z], Ls) * sigmoidf_(g[z]) : 0.f;
    }
    NINFER_TL_MARK(3);  // out written (warp 0)
    if (xrec && wp == 0) {  // lane i < 8 holds chunk offsets 4i..4i+3
        uint8_t* rec = xrec + (row * D + 32 * blockIdx.z) / 32 * qchunk_bytes(1);
        const float4 h4 = make_float4(v[0], v[1], v[2], v[3]);
        store_codes4_xq(xq, rec, 4 * lane, h4, lane < 8);
    }
    NINFER_TL_MARK(4);  // the records written (warp 0)
}
