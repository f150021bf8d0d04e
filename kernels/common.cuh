// common.cuh: small device helpers shared by every op family (conversions, reductions, activations, cp.async,
// programmatic dependent launch). No op lives here; each kernels/*.cu includes this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifdef __CUDACC_RTC__
// NVRTC compiles without the C library headers: the fixed-width types, INT_MAX and INFINITY the kernels use
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#define INT_MAX 2147483647
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#else
#include <limits.h>
#include <stdint.h>
#endif

#define NINFER_WARP 32

__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }

// round to nearest even, NaN -> 0x7FC0 (same rule as ninfer_rt.formats.f32_to_bf16_bits)
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; `red` is shared scratch of >= 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.f;
    return warp_sum(t);
}

__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : -INFINITY;
    return warp_max(t);
}

// exp(x) to ~2 ulp under --use_fast_math for x <= 0: x·log2(e) is formed with its rounding error (split
// constant + fma), so the error does not grow with |x| as __expf's does. exp(-inf) = 0 (r is NaN there).
__device__ __forceinline__ float exp_accurate(float x) {
    const float L2E_HI = 1.44269502162933349609375f;  // fp32 nearest to log2(e)
    const float L2E_LO = 1.925962991126617e-08f;      // log2(e) - L2E_HI
    const float y = x * L2E_HI;
    float r = fmaf(x, L2E_HI, -y);
    r = fmaf(x, L2E_LO, r);
    const float t = exp2f(y);
    return t == 0.f ? 0.f : fmaf(t, r * 0.693147180559945f, t);  // 2^(y + r) ≈ 2^y · (1 + r·ln 2), |r| < 2^-17
}

// ------------------------------------------------------------------------------------------------ arg-max

// NaN ranks as -inf in the arg-max and the samplers (sampling.cu, logprobs.cu).
__device__ __forceinline__ bool is_nan_bits(float v) { return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u; }

// Keep (v, i) if it beats the best so far: larger value, or equal value at a lower index. v is never NaN.
__device__ __forceinline__ void arg_take(float& bv, int& bi, float v, int i)
{
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

__device__ __forceinline__ void warp_argmax(float& bv, int& bi)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        arg_take(bv, bi, ov, oi);
    }
}

// Block-wide best; the result is valid in warp 0. sv/si: shared scratch of 32 entries each.
__device__ __forceinline__ void block_argmax(float& bv, int& bi, float* sv, int* si)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    warp_argmax(bv, bi);
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : INT_MAX;
        warp_argmax(bv, bi);
    }
}

// ------------------------------------------------------------------------------------------------ activations

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + __expf(-x)); }
// softplus as torch: x for x > 20, else log1p(exp(x))
__device__ __forceinline__ float softplusf_(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

// ------------------------------------------------------------------------------------------------ L2 prefetch

// Ask L2 for the 128-byte line holding p: no register, nothing waits for it (a hint).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Ask L2 for every line of [p, p + bytes), thread i of n taking lines i, i + n, ...
__device__ __forceinline__ void prefetch_l2_span(const void* p, size_t bytes, int i, int n) {
    const char* c = static_cast<const char*>(p);
    const size_t first = reinterpret_cast<uintptr_t>(c) & 127;  // p's offset in its line
    for (size_t a = (size_t)i * 128; a < first + bytes; a += (size_t)n * 128) prefetch_l2(c - first + a);
}

// ------------------------------------------------------------------------------------------------ cp.async (sm_80+)

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared (L2 only), zero-filled without reading when !valid (src must still be mapped)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// 4 or 8 bytes global -> shared, zero-filled when !valid
template <int BYTES>
__device__ __forceinline__ void cp_async_small(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(BYTES),
                 "r"(valid ? BYTES : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ------------------------------------------------------------------------------------------------ mbarriers, bulk
// copies (sm_90+: callers compile them for __CUDA_ARCH__ >= 900 only)

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Make initialised mbarriers visible to the copy engine (the async proxy) before any copy completes on them.
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` of copies to complete on the barrier before its phase ends.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Wait until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory by the copy engine
// (one instruction, not one per 16 bytes); completes on bar.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// A kernel whose launcher computes its dynamic shared memory from a Python mirror of the kernel's layout calls this
// first: a launch with less than `need` bytes means the two disagree, and it traps rather than corrupt memory.
__device__ __forceinline__ void require_dynamic_smem(uint32_t need) {
    uint32_t have;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(have));
    if (have < need) __trap();
}

// Programmatic dependent launch (sm_90+). Every kernel starts with ninfer_pdl_begin(): wait until the kernel
// before it in the stream has finished and its writes are visible, then let the next kernel start launching,
// so its launch and block ramp-up overlap this kernel's work. Both are no-ops on older GPUs and when the launch
// did not allow overlap, so a kernel that calls this is correct either way.
__device__ __forceinline__ void ninfer_pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// ninfer_pdl_begin_early(): the same two steps the other way round. The next kernel may start launching while this
// one still waits, so its blocks take the room this kernel leaves and issue their pre-wait loads early. Only for a
// kernel whose successor reads, before its own wait, nothing this kernel's predecessor writes: the successor's
// pre-wait section may now run while that predecessor still does (each use says why its successor qualifies).
__device__ __forceinline__ void ninfer_pdl_begin_early() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// In-graph timeline, only in builds with -DNINFER_TIMELINE (bench/decode_timeline.py; never the runtime's build).
// ninfer_pdl_begin() then also declares a stamp: lane 0 of every warp records its grid, block, SM, the call's
// source line, and the global time at the call, after the wait, and at its exit, into this image's per-SM ring.
#ifdef NINFER_TIMELINE
#define NINFER_TL_SMS 256      // SM ids covered
#define NINFER_TL_PER_SM 8192  // records per SM and image
#define NINFER_TL_MARKS 8      // NINFER_TL_MARK slots per warp
struct NinferTlRecord {
    unsigned long long grid, pre, post, exit, mark[NINFER_TL_MARKS];
    unsigned int block, warp, smid, line;
};
__device__ unsigned int ninfer_tl_count[NINFER_TL_SMS];
__device__ NinferTlRecord ninfer_tl[NINFER_TL_SMS * NINFER_TL_PER_SM];
// A mark after a register value's arrival needs a use that reaches ptxas (an empty asm does not): a store here on a
// condition it cannot decide. NINFER_TL_USE(v), v any number: the mark after it waits for v.
__device__ unsigned int ninfer_tl_sink;
#define NINFER_TL_USE(v) do { if (__float_as_uint((float)(v)) == 0x7fbadbadu) ninfer_tl_sink = 1u; } while (0)

__device__ __forceinline__ unsigned long long ninfer_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The time at a point of the program order: no memory access moves across it (a mark after a loaded value's first
// use times the data's arrival, not the load's issue). ptxas may still read it before a block barrier just above
// it: a warp that waits there then shows its arrival, and the last warp the release.
__device__ __forceinline__ unsigned long long ninfer_clock_fenced() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
    return t;
}

struct NinferStamp {
    unsigned long long pre, post, mark[NINFER_TL_MARKS];
    unsigned int line;
    __device__ explicit NinferStamp(unsigned int l) : pre(ninfer_clock()), post(0), mark{}, line(l) {}
    __device__ ~NinferStamp() {  // at the kernel's exit: the stamp lives in the kernel body's scope
        if (threadIdx.x & 31) return;
        NinferTlRecord r;
        r.exit = ninfer_clock();
        r.pre = pre, r.post = post, r.line = line, r.warp = threadIdx.x >> 5;
#pragma unroll
        for (int i = 0; i < NINFER_TL_MARKS; ++i) r.mark[i] = mark[i];
        r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(r.grid));
        asm volatile("mov.u32 %0, %%smid;" : "=r"(r.smid));
        const unsigned int sm = r.smid % NINFER_TL_SMS, i = atomicAdd(&ninfer_tl_count[sm], 1u);
        if (i < NINFER_TL_PER_SM) ninfer_tl[sm * NINFER_TL_PER_SM + i] = r;
    }
};
// NINFER_TL_WAIT(wait): the wait statement stamped, its stamp declared in the enclosing scope, where the marks
// after it read it (a branch between waits, as gemv_stream.cuh's, goes in whole); in other builds, wait.
#define NINFER_TL_WAIT(wait) \
    NinferStamp ninfer_stamp_(__LINE__); \
    wait; \
    ninfer_stamp_.post = ninfer_clock()
// (ninfer_pdl_begin) in parentheses calls the function of that name above, not the macro that names it
#define ninfer_pdl_begin() NINFER_TL_WAIT((ninfer_pdl_begin)())
#define ninfer_pdl_begin_early() NINFER_TL_WAIT((ninfer_pdl_begin_early)())
// NINFER_TL_MARK(i): the time this warp reached this point, slot i (0 = never), after ninfer_pdl_begin() in the
// same scope. decode_timeline.py reports each slot relative to the launch's release. Nothing in other builds.
#define NINFER_TL_MARK(i) (ninfer_stamp_.mark[i] = ninfer_clock_fenced())
#else
#define NINFER_TL_MARK(i) ((void)0)
#define NINFER_TL_USE(v) ((void)0)
#define NINFER_TL_WAIT(wait) wait
#endif
