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
// (split_keys), so cs is the sequence's own. xrec (if set): the block's 32 columns also as row m of o_proj's x̂
// chunk record (h·D + 32·z) / 32 of all M rows (qchunk_bytes(M)) in XQ order xq (store_codes4_rows; reference
// act_records16 of out [M, nH·D]).
// fold_acc (if set; v72; 256 threads): also adds block b = h·(D/32) + z's share of the next MoE's raw router
// logits of row m into fold_acc int64 [M, fold_ld] (2^-32 fixed point): logit e of row m += ms[e]·Σ_j mt[b, e, j]
// ·out[m, 32b + j] + Σ_i wt[b, e, i]·(gain[16b + i]·x[m, 16b + i]), gain = 1 + w_post, x fp32 [M, fold_h]
// (router_fold.py: the layout, reference and tests; fold_h = H; M > 1 since v87, with fold_h % 4 == 0: each row's
// 16 elements go by 16-byte cp.async).
extern "C" __global__ void __launch_bounds__(256)
    attn_combine_fast(const float* __restrict__ acc, const float2* __restrict__ ml, const float* __restrict__ gate,
                      int ld_gate, const int* __restrict__ pos, const int* __restrict__ slot, float* __restrict__ out,
                      int T, int M, int nH, int D, int slots, int max_ctx, int cs, int n_splits, int rt,
                      uint8_t* __restrict__ xrec, int xq, const __half* __restrict__ fold_mt,
                      const float* __restrict__ fold_ms, const uint16_t* __restrict__ fold_wt,
                      const float* __restrict__ fold_gain, const float* __restrict__ fold_x,
                      long long* __restrict__ fold_acc, int fold_ld, int fold_n, int fold_h) {
    __shared__ float red_m[8];
    __shared__ float4 part_o[8][8];
    __shared__ float part_l[8];
    // v72: the block's 16 elements of x and of the gain 1 + w_post (cp.async), its 32 values of out
    __shared__ __align__(16) float fold_x16[16], fold_g16[16], fold_y[32];
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
    // v72: the router fold, as deltanet_step.cu's (v71) on the DeltaNet layers, 256 threads, row m's sums.
    // Its block-major layout (router_fold.py's fold_blocks): block b's rows of fold_mt [nb, ld, 32] and fold_wt
    // [nb, ld, 16], thread e's column e 64 and 32 contiguous bytes, asked of L2 now (weights) and read after the
    // splits (held across them they took the block to 98 registers: no room beside two decode blocks)
    const bool fold = fold_acc != nullptr && blockDim.x == 256;
    long long* const facc = fold_acc + (size_t)m * fold_ld;
    const float* const fxm = fold_x + (size_t)m * fold_h;
    if (fold_acc != nullptr && (!fold || fold_n > 257)) __trap();  // attention.decode refuses these: never skip
    const int fb = h * gridDim.z + blockIdx.z;
    const int fk0 = min(fold_h, fb * 16), fkn = min(fold_h, fk0 + 16) - fk0;
    const __half* fmt = fold_mt + (size_t)fb * fold_ld * 32;
    const uint16_t* fwt = fold_wt + (size_t)fb * fold_ld * 16;
    if (fold) {
        prefetch_l2_span(fmt, (size_t)fold_ld * 64, tid, blockDim.x);
        prefetch_l2_span(fwt, (size_t)fold_ld * 32, tid, blockDim.x);
    }
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
    // v72: thread e < fold_n column e of the fold's rows, the last warp also column 256 (the shared expert's gate) a
    // lane a row, and x's elements with their gains (x is the layer's input: o_proj adds into it after this launch)
    const int nt = blockDim.x;
    const bool extra = fold && fold_n > nt && wp == nw - 1;
    // fm, fw are only read at the tail; x and the gain go to shared memory by cp.async, since ptxas computed with
    // them at once and held the warp there, before the block's barriers, for their round trip (sass_waits.py)
    uint4 fm[4], fw[2];  // fp16 M rows 8i..8i+7; bf16 W_router rows fk0 + 8i..
    float fms = 0.f, fms2 = 0.f;
    uint16_t fm2 = 0, fw2 = 0;
    if (fold) {
        const bool mine = tid < fold_n;
        const uint4* m4 = reinterpret_cast<const uint4*>(fmt + (size_t)tid * 32);
        const uint4* w4 = reinterpret_cast<const uint4*>(fwt + (size_t)tid * 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) fm[i] = mine ? m4[i] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int i = 0; i < 2; ++i) fw[i] = mine ? w4[i] : make_uint4(0u, 0u, 0u, 0u);
        if (mine) fms = fold_ms[tid];
        if (extra) {
            fm2 = reinterpret_cast<const uint16_t*>(fmt)[(size_t)nt * 32 + lane];
            fms2 = fold_ms[nt];
            if (lane < 16) fw2 = fwt[(size_t)nt * 16 + lane];
        }
        // x was last written by the previous layer's MoE; the qkv GEMV, prepare and the decode each waited before
        // they could end, so after this kernel's wait it is complete (cp.async.cg reads L2: no stale L1 line)
        if (tid < 8) {  // 4 chunks of x, then 4 of the gain; bytes past fkn zero-filled (fk0 = 16b: 64-byte aligned)
            const int c = tid & 3, n = min(4, fkn - 4 * c);
            float* dst = (tid < 4 ? fold_x16 : fold_g16) + 4 * c;
            if (n > 0)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                             "l"((tid < 4 ? fxm : fold_gain) + fk0 + 4 * c), "r"(4 * n) : "memory");
            else
                *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
            cp_async_commit();
        }
    }
    NINFER_TL_MARK(5);  // the fold's loads issued
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
        uint8_t* rec = xrec + (size_t)((h * D + 32 * blockIdx.z) >> 5) * qchunk_bytes(M);
        const float4 h4 = make_float4(v[0], v[1], v[2], v[3]);
        store_codes4_rows_xq(xq, rec, M, m, 4 * lane, h4, lane < 8);
    }
    NINFER_TL_MARK(4);  // the records written (warp 0)
    // v72: this block's share of the next router's raw logits, G·x_new = G·x + (G·Ŵ_o)·out (router_fold.py), added
    // as fixed-point int64 (2^-32): exact in any order, so every block of the fused MoE routes the same
    if (fold) {
        if (tid < 8)
#pragma unroll
            for (int z = 0; z < 4; ++z) fold_y[4 * tid + z] = v[z];
        if (tid < 8) cp_async_wait<0>();
        __syncthreads();
        if (tid < fold_n) {
            const uint32_t mw[16] = {fm[0].x, fm[0].y, fm[0].z, fm[0].w, fm[1].x, fm[1].y, fm[1].z, fm[1].w,
                                     fm[2].x, fm[2].y, fm[2].z, fm[2].w, fm[3].x, fm[3].y, fm[3].z, fm[3].w};
            const uint32_t ww[8] = {fw[0].x, fw[0].y, fw[0].z, fw[0].w, fw[1].x, fw[1].y, fw[1].z, fw[1].w};
            float a = 0.f, xs = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {  // rows 2j, 2j + 1 of M (fp16 pairs, the low half first)
                const float2 m2 = __half22float2(*reinterpret_cast<const __half2*>(&mw[j]));
                a = fmaf(m2.y, fold_y[2 * j + 1], fmaf(m2.x, fold_y[2 * j], a));
            }
#pragma unroll
            for (int u = 0; u < 8; ++u)  // rows fk0 + 2u, + 1 of W_routerᵀ (bf16 pairs), times (1 + w_post)·x
                xs = fmaf(__uint_as_float(ww[u] & 0xffff0000u), fold_g16[2 * u + 1] * fold_x16[2 * u + 1],
                          fmaf(__uint_as_float(ww[u] << 16), fold_g16[2 * u] * fold_x16[2 * u], xs));
            atomicAdd(reinterpret_cast<unsigned long long*>(facc + tid),
                      (unsigned long long)__float2ll_rn(fmaf(a, fms, xs) * 0x1p32f));
        }
        if (extra) {
            const float m2 = __half2float(__ushort_as_half(fm2)) * fms2;
            const float gx = lane < 16 ? fold_g16[lane & 15] * fold_x16[lane & 15] : 0.f;
            const float a = warp_sum(fmaf(m2, fold_y[lane], bf16_to_f32(fw2) * gx));
            if (lane == 0)
                atomicAdd(reinterpret_cast<unsigned long long*>(facc + nt),
                          (unsigned long long)__float2ll_rn(a * 0x1p32f));
        }
    }
}
