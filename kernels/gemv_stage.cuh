// gemv_stage.cuh: how the M = 1 stream GEMV (gemv_stream.cu) stages x̂ of one row into its slab: from
// registers (stage_m1_vec), or from the fp32 copies of x and norm_w it made in shared memory (stage_m1_smem,
// one thread a chunk past K = 4096: code_chunk). Layouts: gemv.cu; records: xcodes.cuh.
#pragma once
#include "gemv.cuh"

namespace {

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

}  // namespace
