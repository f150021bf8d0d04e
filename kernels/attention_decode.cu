// attention_decode.cu: gated attention decode for few query rows per kv head (decode, MTP verify: T·(nH/nKV)
// small), on CUDA cores in fp32 (bf16 cache) or mma.sync tensor cores (int8 cache); its split partials are merged
// by attn_combine_fast (attention_combine.cu). Same contract as attn_decode_* + attn_combine of attention.cu
// (ops.gated_attention per sequence; see that file's header for the semantics, the cache layout and the scratch
// layout), which stays the path for long T (prefill).
//
// attn_decode_fast_{bf16,int8}_d{D}: grid (ceil(R/8), n_splits, B*nKV), block 128 (4 warps), dynamic smem
//     FastGeo<D, I8>::SMEM (ninfer_rt/gpu/attention.py _fast_smem computes the same number). Block (gi, sp, b*nKV+kvh)
//     takes query rows r = 8gi .. 8gi+7 of R = T*G (row r = token r/G, head kvh*G + r%G, as in attention.cu) and
//     the keys [sp*cs, sp*cs + cs) of split sp (cs: the launch's, or with rt the sequence's own, split_keys). The
//     split is walked in steps of 32 keys: warp w owns keys
//     8w .. 8w+7 of every step and runs its own cp.async ring of NS stages (its 8 K rows, 8 V rows and int8
//     scales), so the warps never wait on each other until the end; the stages holding only keys before the
//     step's first new token are issued before the wait on prepare. Per step a warp computes the 8x8 scores:
//       bf16 cache: fp32 FMAs (LPK lanes share a key, each holding CB bytes of it; q is read from shared memory in
//       a layout that makes those reads conflict-free), reduced over the LPK lanes with a select-free transpose
//       (lane l's partial sum slot 8a+c holds key a^(l>>2), row c^(2(l&3)), so after the log2(LPK) shuffle levels
//       lane L holds rows 2(L&3), 2(L&3)+1 of key L>>2);
//       int8 cache: int8 tensor cores (mma m16n8k32, rows 8-15 of the A tile zero), K codes as stored and q as
//       three int8 code planes per row, q ≈ s·(c1 + c2/254 + c3/254²), summed exactly in int32 (lane 4g + t: row
//       g, keys 2t, 2t+1);
//     then the online softmax per row across the warp's 8 keys, and p*v: bf16 cache, on CUDA cores with lane L
//     owning dims D/32*L .. +D/32 of all 8 rows; int8 cache, o^T += V^T p^T on bf16 tensor cores (mma m16n8k8: the
//     value codes are exact in bf16, p times the value scale goes in as hi + lo; pv_int8). K and V rows of int8
//     stages are XOR-swizzled in 16-byte chunks (k_chunk, v_chunk). At the end the 4 warps' (max, sum, o) are
//     merged through shared memory and written as one split partial: acc[sp, m, h, :] (unnormalised, relative
//     to the max), ml[sp, m, h] = (max in log2 units, sum), exactly the layout attention.cu's decode writes.
//     Accuracy: bf16 cache: products and sums in fp32 (K/V values are exact in fp32). int8 cache: q's codes are
//     within max|q_row|·6.1e-8 of q per element (the fp32 rounding of q itself), the int32 sums exact, the scores
//     then scaled in fp32 (q's row scale, the int8 key scale); p times the value scale within 2^-18 of itself in
//     the p*v mma, which accumulates in fp32. exp2 of the fast-math intrinsic as in attention.cu.
#include "attention.cuh"
#include "attention_decode_int8.cuh"  // the int8 cache's q codes and tensor-core q·k, p·v

namespace {

constexpr int kFastRows = 8;                           // query rows per block
constexpr int kFastWarps = 4;                          // warps per block
constexpr int kWarpKeys = 8;                           // keys per warp per step
constexpr int kStepKeys = kFastWarps * kWarpKeys;      // keys per block per step

template <int D, bool I8>
struct FastGeo {
    static constexpr int ES = I8 ? 1 : 2;                       // bytes per cached element
    static constexpr int RB = D * ES;                           // bytes per cached row (key, kv head)
    static constexpr int CB = RB >= 64 ? 16 : RB / 4;           // bytes of one lane's run of a K row (QK)
    static constexpr int LPK = RB / CB < 8 ? RB / CB : 8;       // lanes sharing one key (QK)
    static constexpr int CPL = RB / (CB * LPK);                 // runs per lane per key
    static constexpr int CDIM = CB / ES;                        // dims per run
    static constexpr int KPT = LPK / 4;                         // keys per lane (QK): KPT * 32/LPK = 8 keys
    static constexpr int NV = kFastRows * KPT;                  // partial dot products per lane (= 2 LPK)
    static constexpr int DV = D / 32;                           // dims per lane (PV)
    static constexpr int STAGE = 2 * kWarpKeys * RB;            // one warp's 8 K rows then 8 V rows
    // ring stages per warp: 5 for an int8 cache at D = 256, so a split of 128 keys (4 steps, the 27B at 8K) is in
    // flight before the wait instead of its last step's refill costing a round trip after it (perf-history.md v44)
    static constexpr int NS_RAW = 20480 / STAGE;
    static constexpr int NS = NS_RAW < 2 ? 2 : NS_RAW > 5 ? 5 : NS_RAW;
    // dynamic shared memory: q (permuted fp32 rows) | stages [warp][stage] | p [warp][key][row] |
    // scales [warp][stage][k 0..7, v 0..7] | (max, sum) [warp][row]
    static constexpr int Q_OFF = 0;
    static constexpr int ST_OFF = Q_OFF + kFastRows * D * 4;
    static constexpr int P_OFF = ST_OFF + kFastWarps * NS * STAGE;
    static constexpr int SC_OFF = P_OFF + kFastWarps * kWarpKeys * kFastRows * 4;
    static constexpr int ML_OFF = SC_OFF + kFastWarps * NS * 2 * kWarpKeys * 4;
    static constexpr int SMEM = ML_OFF + kFastWarps * kFastRows * 8;

    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dim");
    static_assert((LPK == 4 || LPK == 8) && CPL * CB * LPK == RB && CDIM % 4 == 0, "QK geometry");
    static_assert(NV == 2 * LPK, "the transpose reduction leaves two sums per lane");
    static_assert(kFastWarps * kFastRows * D * 4 <= kFastWarps * NS * STAGE, "the merge buffer reuses the stages");
    static_assert(kFastRows * 8 * 2 <= SC_OFF - P_OFF, "p's buffer holds q's scales, then the rows' partial indices");
    static_assert(RB % 16 == 0 && STAGE % 16 == 0 && ST_OFF % 16 == 0 && P_OFF % 16 == 0, "16-byte alignment");
};

// DV consecutive bf16 elements of a cached row as exact floats
template <int DV>
__device__ __forceinline__ void load_run_bf16(float* v, const unsigned char* p) {
    if constexpr (DV >= 2) {
        uint32_t w[DV / 2];
        lds<2 * DV>(w, p);
#pragma unroll
        for (int u = 0; u < DV / 2; ++u) {
            v[2 * u] = __uint_as_float(w[u] << 16);
            v[2 * u + 1] = __uint_as_float(w[u] & 0xffff0000u);
        }
    } else {
        v[0] = __uint_as_float((uint32_t)*reinterpret_cast<const uint16_t*>(p) << 16);
    }
}

// One level (lane stride SFT) of the select-free transpose sum, then the next: slots [0, 2 SFT) stay, the partner's
// slots [2 SFT, 4 SFT) are added to them. Recursion keeps every index a compile-time constant (registers only).
template <int SFT>
__device__ __forceinline__ void transpose_sum(float* x) {
#pragma unroll
    for (int n = 0; n < 2 * SFT; ++n) x[n] += __shfl_xor_sync(kFull, x[n + 2 * SFT], SFT);
    if constexpr (SFT > 1) transpose_sum<SFT / 2>(x);
}

template <int D, bool I8>
__device__ __forceinline__ void fast_decode_impl(const float* __restrict__ q, const unsigned char* __restrict__ kc,
                                                 const unsigned char* __restrict__ vc, const float* __restrict__ ks,
                                                 const float* __restrict__ vs, const int* __restrict__ pos,
                                                 const int* __restrict__ slot, float* __restrict__ acc,
                                                 float2* __restrict__ ml, int T, int nH, int nKV, int M, int slots,
                                                 int max_ctx, int cs, int n_splits, float sc, int rt) {
    using F = FastGeo<D, I8>;
    extern __shared__ __align__(16) unsigned char fast_smem[];
    uint32_t dyn_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
    if (dyn_smem < (uint32_t)F::SMEM) return;  // launched with too little shared memory: write nothing

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int gi = blockIdx.x, sp = blockIdx.y, b = blockIdx.z / nKV, kvh = blockIdx.z - b * nKV;
    const int G = nH / nKV, R = T * G, r0 = kFastRows * gi;
    const int p0 = pos[b], sl = slot[b];
    if (sl < 0 || sl >= slots || p0 < 0) return;
    cs = split_keys(cs, n_splits, p0 + T, rt);
    const int cap = min(max_ctx, n_splits * cs);
    const int t_hi = (min(R, r0 + kFastRows) - 1) / G;
    const int k_begin = sp * cs;
    const int k_end = min(k_begin + cs, min(p0 + t_hi + 1, cap));
    if (k_begin >= k_end) return;  // beyond the real length (or the last token of this row group)

    float* q_s = reinterpret_cast<float*>(fast_smem + F::Q_OFF);
    unsigned char* st = fast_smem + F::ST_OFF;
    float* p_s = reinterpret_cast<float*>(fast_smem + F::P_OFF) + w * (kWarpKeys * kFastRows);
    float* sc_s = reinterpret_cast<float*>(fast_smem + F::SC_OFF) + w * (F::NS * 2 * kWarpKeys);
    float2* ml_s = reinterpret_cast<float2*>(fast_smem + F::ML_OFF);

    // cache rows of (slot, position p, kv head) sit at (sl*max_ctx + p)*nKV + kvh
    const size_t row0 = (size_t)sl * max_ctx * nKV + kvh;
    const unsigned char* kbase = kc + row0 * F::RB;
    const unsigned char* vbase = vc + row0 * F::RB;
    const float* ksbase = I8 ? ks + row0 : nullptr;
    const float* vsbase = I8 ? vs + row0 : nullptr;
    const size_t kstride = (size_t)nKV * F::RB;

    // this warp's keys: kw0 + it*32 + 0..7 for it < nit
    const int kw0 = k_begin + kWarpKeys * w;
    const int nit = k_end > kw0 ? (k_end - kw0 + kStepKeys - 1) / kStepKeys : 0;

    // keys kb .. kb+7 into stage s of this warp (keys >= k_end zero-filled); the caller commits the group. Each copy
    // instruction of the warp takes whole 128-byte lines, as HEAD's did: lane LPR·r + c copies chunk c + LPR·(u / NR)
    // of row r + RPI·(u % NR). The swizzles flip chunk bits 1-2 only and the K swizzle does not see row bit 2
    // (kSwizzleMask), so a lane's offsets are its own plus immediates (V: one base a row). A stage costs a row
    // index and two multiply-adds a row the lane copies, and 2·NU copies; lanes c < 2·NR also copy the scales.
    constexpr int CH = F::RB / 16;                             // 16-byte chunks per row (a power of two, 2 .. 32)
    constexpr int LPR = CH < 8 ? CH : 8;                       // lanes per row: one line
    constexpr int RPI = 32 / LPR < kWarpKeys ? 32 / LPR : kWarpKeys;  // rows an instruction covers
    constexpr int NR = kWarpKeys / RPI;                        // rows a lane copies (1 or 2)
    constexpr int NU = CH / LPR * NR;                          // copies a lane and matrix
    static_assert(NR * RPI == kWarpKeys && (NR == 1 || (kSwizzleMask<F::RB> | 6) == 6), "lines and swizzles");
    const int rl = lane / LPR, cl = lane % LPR;
    const bool copies = lane < RPI * LPR;
    const int kdl = rl * F::RB + (I8 ? k_chunk<F::RB>(rl, cl) : cl) * 16;  // + stage, + RPI·h·RB, + u's chunks
    int vdl[NR];
#pragma unroll
    for (int h = 0; h < NR; ++h) {
        const int r = rl + RPI * h;
        vdl[h] = (kWarpKeys + r) * F::RB + (I8 ? v_chunk<F::RB>(r, cl) : cl) * 16;
    }
    const unsigned char* kgl = kbase + cl * 16;
    const unsigned char* vgl = vbase + cl * 16;
    const float* sgl = (cl & 1) ? vsbase : ksbase;                      // the scales: lanes c < 2·NR
    const int sdl = ((cl & 1) ? kWarpKeys : 0) + rl + RPI * (cl >> 1);
    const uint32_t kstride32 = (uint32_t)kstride;
    auto issue = [&](int s, int kb) {
        const uint32_t stage = smem_addr(st + (w * F::NS + s) * F::STAGE);
        bool valid[NR];
        uint32_t idx[NR];
        const unsigned char *ksrc[NR], *vsrc[NR];
#pragma unroll
        for (int h = 0; h < NR; ++h) {
            const int key = kb + rl + RPI * h;
            valid[h] = key < k_end;
            idx[h] = (uint32_t)(valid[h] ? key : k_begin);
            ksrc[h] = kgl + (size_t)idx[h] * kstride32;
            vsrc[h] = vgl + (size_t)idx[h] * kstride32;
        }
        if (copies) {
#pragma unroll
            for (int u = 0; u < NU; ++u) {
                const int h = u % NR, dc = LPR * (u / NR) * 16;  // constants: the swizzles leave these bits alone
                cp_async16(stage + kdl + RPI * h * F::RB + dc, ksrc[h] + dc, valid[h]);
                cp_async16(stage + vdl[h] + dc, vsrc[h] + dc, valid[h]);
            }
        }
        if constexpr (I8) {
            if (cl < 2 * NR && copies) {
                const bool h = NR > 1 && (cl >> 1);  // (selected, not indexed: idx and valid stay in registers)
                const float* src = sgl + (size_t)(h ? idx[NR - 1] : idx[0]) * nKV;
                cp_async_small<4>(smem_addr(sc_s + s * 2 * kWarpKeys + sdl), src, h ? valid[NR - 1] : valid[0]);
            }
        }
    };

    // the ring's first NS-1 stages (one group each, possibly empty, so that the wait counts hold). Those whose keys
    // all precede the step's first new token p0 were written by earlier steps: they are issued before the wait on
    // the previous kernel (prepare, which writes keys p0 ..), so they load while it runs
    int s0 = 0;
    for (; s0 < F::NS - 1 && s0 < nit && kw0 + s0 * kStepKeys + kWarpKeys <= p0; ++s0) {
        issue(s0, kw0 + s0 * kStepKeys);
        cp_async_commit();
    }
    // q, and keys p0 .. are the previous kernel's. Waits before letting the combine launch: the combine reads the
    // gate (q|k|v|gate's) before its own wait (a trigger first cost +0.1% with the gate after it, perf-history.md v53)
    ninfer_pdl_begin();
    for (int s = s0; s < F::NS - 1; ++s) {
        if (s < nit) issue(s, kw0 + s * kStepKeys);
        cp_async_commit();
    }

    // q of the 8 rows (zeros past R) into shared memory, while the first stages load: int8 code planes for the
    // tensor cores, or fp32: float4 f4 of a row (dims 4f4 .. 4f4+3) is element e of run ch = l + LPK*i
    // (l = ch % LPK): it goes to float4 (i*CDIM/4 + e)*LPK + l of the row, so the LPK lanes of a key read LPK
    // consecutive float4s.
    using QF = QFrags<D, kFastRows>;
    static_assert(QF::BYTES <= F::ST_OFF - F::Q_OFF, "q's records fit q's fp32 rows");
    unsigned char* qf = reinterpret_cast<unsigned char*>(q_s);
    float* qsc = reinterpret_cast<float*>(fast_smem + F::P_OFF);  // p's buffer: the CUDA-core path's only
    if constexpr (I8) stage_q_codes<D, kFastRows>(q, b, T, nH, kvh, G, R, r0, qf, qsc);
    for (int f = tid; !I8 && f < kFastRows * (D / 4); f += kFastWarps * 32) {
        const int c = f / (D / 4), f4 = f - c * (D / 4), rr = r0 + c;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (rr < R) {
            const int tt = rr / G, j = rr - tt * G;
            x = reinterpret_cast<const float4*>(q + ((size_t)(b * T + tt) * nH + kvh * G + j) * D)[f4];
        }
        const int ch = f4 / (F::CDIM / 4), e = f4 - ch * (F::CDIM / 4);
        const int l = ch % F::LPK, i = ch / F::LPK;
        reinterpret_cast<float4*>(q_s)[c * (D / 4) + (i * (F::CDIM / 4) + e) * F::LPK + l] = x;
    }
    __syncthreads();
    NINFER_TL_MARK(0);  // q staged

    // QK roles: lane = kg*LPK + l; partial sum slot 8a + c is key kg*KPT + (a ^ ka), row c ^ kr
    const int kg = lane / F::LPK, l = lane % F::LPK, ka = l >> 2, kr = 2 * (l & 3);
    const float4* q4 = reinterpret_cast<const float4*>(q_s) + l;
    int koff[F::KPT];
#pragma unroll
    for (int a = 0; a < F::KPT; ++a) koff[a] = (kg * F::KPT + (a ^ ka)) * F::RB + l * F::CB;
    // after the reduction: rows 2(lane&3) + h of key lane>>2; keys < lim[h] are visible to row h. int8 (mma):
    // lane 4g + t holds row g's scores of keys 2t, 2t+1 (lim[0]), its q fragments in qa
    const int kk = lane >> 2, mg = lane >> 2, mt = lane & 3;
    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rr = r0 + (I8 ? mg : 2 * (lane & 3) + h);
        lim[h] = rr < R ? min(min(p0 + rr / G + 1, cap), k_end) : 0;
    }
    const unsigned char* qlane = qf + mg * 64 + mt * 16;  // + j·BLOCK: the pair record; + THIRD: plane 3's
    uint4 qa[I8 && QF::IN_REGS ? D / 32 : 1][2];
    float q_scale = 0.f;
    if constexpr (I8) {
        if constexpr (QF::IN_REGS) {
#pragma unroll
            for (int j = 0; j < D / 32; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    qa[j][h] = *reinterpret_cast<const uint4*>(qlane + h * QF::THIRD + j * QF::BLOCK);
        }
        q_scale = qsc[mg] * sc;
    }

    // o: bf16 cache, lane L owns dims DV*L .. +DV of the 8 rows (o[row][i]); int8 cache, the mma's C fragments
    // (o[p][tile][c], see pv_int8): lane 4g + t holds rows 2t, 2t+1 of dims 32p + 4g .. +3
    float o[I8 ? D / 32 : kFastRows][I8 ? 2 : F::DV][I8 ? 4 : 1];
#pragma unroll
    for (int r = 0; r < (I8 ? D / 32 : kFastRows); ++r)
#pragma unroll
        for (int i = 0; i < (I8 ? 2 : F::DV); ++i)
#pragma unroll
            for (int c = 0; c < (I8 ? 4 : 1); ++c) o[r][i][c] = 0.f;
    float m_run[2] = {kMasked, kMasked}, l_run[2] = {0.f, 0.f};  // l_run: this lane's keys only, summed at the end

    for (int it = 0; it < nit; ++it) {
        if (it == nit - 1) NINFER_TL_MARK(5);  // the warp at its last stage's wait (mark 4 - 5: waiting for data)
        cp_async_wait<F::NS - 2>();  // this step's stage (later ones may still be in flight)
        __syncwarp();                // ... every lane's copies visible; every lane done with the previous step
        if (it == 0) NINFER_TL_MARK(3);        // the warp's first stage landed
        if (it == nit - 1) NINFER_TL_MARK(4);  // ... and its last
        {
            const int nx = it + F::NS - 1;  // refill the stage the previous step used
            if (nx < nit) issue(nx % F::NS, kw0 + nx * kStepKeys);
            cp_async_commit();
        }
        const int s = it % F::NS;
        const unsigned char* kt = st + (w * F::NS + s) * F::STAGE;
        const unsigned char* vt = kt + kWarpKeys * F::RB;
        const int kb = kw0 + it * kStepKeys;

        if constexpr (I8) {
            // ---- scores: row mg's keys 2mt, 2mt+1 from the exact int32 sums of the code planes: plane 1 in
            // s12[0..1], plane 2 in s12[2..3] (the A tile's rows 8-15), plane 3 in s3[0..1]
            int s12[4] = {0, 0, 0, 0}, s3[4] = {0, 0, 0, 0};
            const unsigned char* krow = kt + mg * F::RB + (mt & 1) * 8;
#pragma unroll
            for (int j = 0; j < D / 32; ++j) {
                const uint2 kb8 = *reinterpret_cast<const uint2*>(krow + (k_chunk<F::RB>(mg, 2 * j + (mt >> 1)) << 4));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned char* rec = qlane + h * QF::THIRD + j * QF::BLOCK;
                    const uint4 a = QF::IN_REGS ? qa[QF::IN_REGS ? j : 0][h] : *reinterpret_cast<const uint4*>(rec);
                    mma_s8(h ? s3 : s12, a, kb8);
                }
            }
            const float2 ksc = *reinterpret_cast<const float2*>(sc_s + s * 2 * kWarpKeys + 2 * mt);
            const float2 vsc = *reinterpret_cast<const float2*>(sc_s + s * 2 * kWarpKeys + kWarpKeys + 2 * mt);
            float sv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float v = (float)s12[e] + ((float)s12[2 + e] + (float)s3[e] * (1.f / kQBase)) * (1.f / kQBase);
                sv[e] = kb + 2 * mt + e < lim[0] ? v * q_scale * (e ? ksc.y : ksc.x) : kMasked;
            }
            // ---- online softmax of row mg over the warp's 8 keys (its quad's lanes)
            float alpha;
            const float base = online_base(fmaxf(sv[0], sv[1]), m_run[0], alpha);
            const float pa = exp2f(sv[0] - base), pb = exp2f(sv[1] - base);
            l_run[0] = l_run[0] * alpha + pa + pb;
            if (it > 0 && __any_sync(kFull, alpha != 1.f)) {  // (o is still zero in the first step)
                const float a0 = __shfl_sync(kFull, alpha, 8 * mt), a1 = __shfl_sync(kFull, alpha, 8 * mt + 4);
#pragma unroll
                for (int pp = 0; pp < D / 32; ++pp)
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        o[pp][u][0] *= a0, o[pp][u][2] *= a0;
                        o[pp][u][1] *= a1, o[pp][u][3] *= a1;
                    }
            }
            // ---- o += p v on the tensor cores: P^T's fragment is this lane's (p · value scale) as bf16 hi + lo
            pv_int8<D>(o, vt, mg, mt, pa * vsc.x, pb * vsc.y);
        } else {
            // ---- scores: x[8a + c] = q[row c ^ kr] . k[key kg*KPT + (a ^ ka)] over this lane's runs
            float x[F::NV];
#pragma unroll
            for (int n = 0; n < F::NV; ++n) x[n] = 0.f;
#pragma unroll
            for (int i = 0; i < F::CPL; ++i) {
                uint32_t kw[F::KPT][F::CB / 4];
#pragma unroll
                for (int a = 0; a < F::KPT; ++a) lds<F::CB>(kw[a], kt + koff[a] + F::LPK * F::CB * i);
#pragma unroll
                for (int e = 0; e < F::CDIM / 4; ++e) {
                    float kf[F::KPT][4];
#pragma unroll
                    for (int a = 0; a < F::KPT; ++a) {
                        kf[a][0] = __uint_as_float(kw[a][2 * e] << 16);
                        kf[a][1] = __uint_as_float(kw[a][2 * e] & 0xffff0000u);
                        kf[a][2] = __uint_as_float(kw[a][2 * e + 1] << 16);
                        kf[a][3] = __uint_as_float(kw[a][2 * e + 1] & 0xffff0000u);
                    }
#pragma unroll
                    for (int c = 0; c < kFastRows; ++c) {
                        const float4 qv = q4[(c ^ kr) * (D / 4) + (i * (F::CDIM / 4) + e) * F::LPK];
#pragma unroll
                        for (int a = 0; a < F::KPT; ++a) {
                            float& y = x[kFastRows * a + c];
                            y = fmaf(qv.x, kf[a][0], y);
                            y = fmaf(qv.y, kf[a][1], y);
                            y = fmaf(qv.z, kf[a][2], y);
                            y = fmaf(qv.w, kf[a][3], y);
                        }
                    }
                }
            }
            // sum over the LPK lanes of the key: level with lane stride sft keeps slots [0, 2 sft) and adds the
            // partner's slots [2 sft, 4 sft), which hold the same (key, row) pairs (see the slot rule above)
            transpose_sum<F::LPK / 2>(x);

            // ---- scores in log2 units (masked past each row's limit), online softmax over the warp's 8 keys
            float pv[2], alpha[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float sv = kb + kk < lim[h] ? x[h] * sc : kMasked;
                float mx = fmaxf(sv, __shfl_xor_sync(kFull, sv, 4));
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 16));
                const float m_new = fmaxf(m_run[h], mx);
                const float base = m_new == kMasked ? 0.f : m_new;  // a row with nothing visible yet keeps p = 0
                alpha[h] = m_new == m_run[h] ? 1.f : exp2f(m_run[h] - base);  // (a row that sees nothing: no rescale)
                pv[h] = exp2f(sv - base);
                l_run[h] = l_run[h] * alpha[h] + pv[h];
                m_run[h] = m_new;
            }
            reinterpret_cast<float2*>(p_s)[lane] = make_float2(pv[0], pv[1]);  // p_s[key][row]
            if (it > 0 && __any_sync(kFull, alpha[0] != 1.f || alpha[1] != 1.f)) {  // (o is zero in the first step)
#pragma unroll
                for (int r = 0; r < kFastRows; ++r) {
                    const float ar = __shfl_sync(kFull, alpha[r & 1], r >> 1);
#pragma unroll
                    for (int i = 0; i < F::DV; ++i) o[r][i][0] *= ar;
                }
            }
            __syncwarp();  // p_s written by every lane

            // ---- o += p v: lane owns dims DV*lane .. +DV of the 8 rows
#pragma unroll
            for (int k2 = 0; k2 < kWarpKeys; ++k2) {
                const float4 pa = reinterpret_cast<const float4*>(p_s)[2 * k2];
                const float4 pb = reinterpret_cast<const float4*>(p_s)[2 * k2 + 1];
                const float pr[kFastRows] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
                float v[F::DV];
                load_run_bf16<F::DV>(v, vt + k2 * F::RB + lane * F::DV * F::ES);
#pragma unroll
                for (int r = 0; r < kFastRows; ++r)
#pragma unroll
                    for (int i = 0; i < F::DV; ++i) o[r][i][0] = fmaf(pr[r], v[i], o[r][i][0]);
            }
        }
    }
    cp_async_wait<0>();

    // ---- merge the 4 warps: (max, sum) per row through ml_s, o through the (now idle) stage buffers
    if constexpr (I8) {  // row mg: the lane sums of its quad (l_run[1] unused, 0)
        quad_total(l_run);
        if (mt == 0) ml_s[w * kFastRows + mg] = make_float2(m_run[0], l_run[0]);
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l_run[h] += __shfl_xor_sync(kFull, l_run[h], 4);
            l_run[h] += __shfl_xor_sync(kFull, l_run[h], 8);
            l_run[h] += __shfl_xor_sync(kFull, l_run[h], 16);
        }
        if (lane < 4) {
            ml_s[w * kFastRows + 2 * lane] = make_float2(m_run[0], l_run[0]);
            ml_s[w * kFastRows + 2 * lane + 1] = make_float2(m_run[1], l_run[1]);
        }
    }
    __syncthreads();  // ml_s complete; every warp done with its stages (its copies have landed)
    NINFER_TL_MARK(1);  // the block's keys done

    // rows' (max, sum) out, and their partials' index for the final stores (in p's buffer past q's scales, both
    // read before the barrier), by 8 threads while the warps write o: one division each, not one a store
    size_t* idx_s = reinterpret_cast<size_t*>(fast_smem + F::P_OFF) + kFastRows;
    if (tid < kFastRows && r0 + tid < R) {
        const int r = tid, rr = r0 + r;
        float mx = kMasked;
#pragma unroll
        for (int u = 0; u < kFastWarps; ++u) mx = fmaxf(mx, ml_s[u * kFastRows + r].x);
        const float base = mx == kMasked ? 0.f : mx;
        float L = 0.f;
#pragma unroll
        for (int u = 0; u < kFastWarps; ++u) {
            const float2 e = ml_s[u * kFastRows + r];
            L += e.y * exp2f(e.x - base);
        }
        int tt, j;
        const size_t idx = partial_row(rr, G, sp, M, b, T, nH, kvh, tt, j);
        idx_s[r] = idx;
        ml[idx] = make_float2(mx, L);
    }

    // this warp's o rescaled to the block's max of each row (row r's factor: warp_factor(r))
    auto warp_factor = [&](int r) {
        float mx = kMasked;
#pragma unroll
        for (int u = 0; u < kFastWarps; ++u) mx = fmaxf(mx, ml_s[u * kFastRows + r].x);
        return exp2f(ml_s[w * kFastRows + r].x - (mx == kMasked ? 0.f : mx));
    };
    float* ored = reinterpret_cast<float*>(st);  // [warp][row][D]
    if constexpr (I8) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // rows 2mt + e: C columns e (c0/c2 of the even row, c1/c3 of the odd)
            const int r = 2 * mt + e;
            const float f = warp_factor(r);
#pragma unroll
            for (int pp = 0; pp < D / 32; ++pp)
                *reinterpret_cast<float4*>(ored + (w * kFastRows + r) * D + 32 * pp + 4 * mg) =
                    make_float4(o[pp][0][e] * f, o[pp][0][2 + e] * f, o[pp][1][e] * f, o[pp][1][2 + e] * f);
        }
    } else {
#pragma unroll
        for (int r = 0; r < kFastRows; ++r) {
            const float f = warp_factor(r);
            float* dst = ored + (w * kFastRows + r) * D + lane * F::DV;
            if constexpr (F::DV % 4 == 0) {  // 16-byte stores (dst is 16-byte aligned then)
#pragma unroll
                for (int i = 0; i < F::DV; i += 4)
                    *reinterpret_cast<float4*>(dst + i) =
                        make_float4(o[r][i][0] * f, o[r][i + 1][0] * f, o[r][i + 2][0] * f, o[r][i + 3][0] * f);
            } else {
#pragma unroll
                for (int i = 0; i < F::DV; ++i) dst[i] = o[r][i][0] * f;
            }
        }
    }
    __syncthreads();
    NINFER_TL_MARK(2);  // the warps' o merged in shared memory

    for (int f = tid; f < kFastRows * (D / 4); f += kFastWarps * 32) {
        const int r = f / (D / 4), c4 = f - r * (D / 4), rr = r0 + r;
        if (rr >= R) continue;
        float4 sum = reinterpret_cast<const float4*>(ored + r * D)[c4];
#pragma unroll
        for (int u = 1; u < kFastWarps; ++u) {
            const float4 a = reinterpret_cast<const float4*>(ored + (u * kFastRows + r) * D)[c4];
            sum.x += a.x, sum.y += a.y, sum.z += a.z, sum.w += a.w;
        }
        reinterpret_cast<float4*>(acc + idx_s[r] * D)[c4] = sum;
    }
}

}  // namespace

// ------------------------------------------------------------------------------------------------ entry points

// 3 blocks (12 warps) per SM where the shared memory holds them (Hopper: 3 x 75 KB of 228 KB; the int8 d256 ring's
// 92.7 KB holds 2, its 160 registers under the cap of 168 either way); elsewhere 1 (sm_86/89/120) or 2 (sm_80).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000)
#define NINFER_FAST_MIN_BLOCKS 3
#else
#define NINFER_FAST_MIN_BLOCKS 2
#endif

#define NINFER_FAST_DECODE(NAME, D, I8)                                                                           \
    extern "C" __global__ void __launch_bounds__(kFastWarps * 32, NINFER_FAST_MIN_BLOCKS) NAME(                  \
        const float* q, const unsigned char* kc, const unsigned char* vc, const float* ks, const float* vs,      \
        const int* pos, const int* slot, float* acc, float2* ml, int T, int nH, int nKV, int M, int slots,       \
        int max_ctx, int cs, int n_splits, float sc, int rt) {                                                   \
        fast_decode_impl<D, I8>(q, kc, vc, ks, vs, pos, slot, acc, ml, T, nH, nKV, M, slots, max_ctx, cs,        \
                                n_splits, sc, rt);                                                                \
    }

NINFER_FAST_DECODE(attn_decode_fast_bf16_d32, 32, false)
NINFER_FAST_DECODE(attn_decode_fast_bf16_d64, 64, false)
NINFER_FAST_DECODE(attn_decode_fast_bf16_d128, 128, false)
NINFER_FAST_DECODE(attn_decode_fast_bf16_d256, 256, false)
NINFER_FAST_DECODE(attn_decode_fast_int8_d32, 32, true)
NINFER_FAST_DECODE(attn_decode_fast_int8_d64, 64, true)
NINFER_FAST_DECODE(attn_decode_fast_int8_d128, 128, true)
NINFER_FAST_DECODE(attn_decode_fast_int8_d256, 256, true)
