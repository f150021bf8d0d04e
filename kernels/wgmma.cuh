// wgmma.cuh: Hopper pieces of gemm_wgmma.cu (sm_90a): the wgmma.mma_async wrappers, the shared-memory descriptor
// of the staged x tile, tensor-memory copies (TMA) completing on mbarriers, and the weight decoders that build the
// A operand in registers in the MMA's own k order. Only instantiated by sm_90a entry points.
#pragma once
#include "gemm.cuh"

namespace {

// ------------------------------------------------------------------------------------------------ x in shared memory

// A stage's x tile as wgmma reads B (K-major, 128-byte swizzle), the layout a TMA copy with
// CU_TENSOR_MAP_SWIZZLE_128B writes: row r's 64 k (128 bytes) at r·128 from a 1024-byte aligned base, its 16-byte
// unit u at position u ^ (r & 7). Row r, unit u: byte wg_x_offset(r, u).
__device__ __forceinline__ int wg_x_offset(int r, int u) { return r * 128 + ((u ^ (r & 7)) << 4); }

// The descriptor of the 16-wide k slice h of such a tile at shared address `base`: start base + 32h, LBO unused (1),
// SBO 1024 (8-row groups), in 16-byte units at bits 0, 16 and 32; layout "128-byte swizzle" (bits 62-63 = 1).
__device__ __forceinline__ uint64_t wg_desc(uint32_t base, int h) {
    return (uint64_t)(((base + 32u * h) & 0x3FFFFu) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

// ------------------------------------------------------------------------------------------------ TMA

// A CUtensorMap as the driver encodes it (driver.tensor_map_2d): passed by value as a __grid_constant__ parameter.
struct alignas(64) TmaDesc {
    unsigned long long v[16];
};

// (mbar_init, mbar_expect_tx, mbar_wait: common.cuh)
// Copy the box at coordinates (c0 innermost, c1) of the tensor `map` into shared memory at dst; completes on bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaDesc* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// ------------------------------------------------------------------------------------------------ wgmma

// Order earlier register writes (A fragments, accumulators) before the next wgmma reads them.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N of this warpgroup's committed wgmma groups are in flight.
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Make this thread's shared-memory writes (cp.async included) visible to wgmma's reads (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keep the compiler from moving accumulator reads or writes across this point (a wgmma writes them asynchronously).
__device__ __forceinline__ void wg_pin(float* d, int n) {
#pragma unroll
    for (int i = 0; i < n; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of a wgmma: d[0..31] (m64n64, fp32) or d[0..63] (m64n128), and the %-numbers they take.
#define WG_D32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
    "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
    "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D64(d) WG_D32(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WG_R32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R64 \
    WG_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d (64 × 128 fp32, the warpgroup's accumulators: 64 per thread) += A (64 × 16 bf16, registers) · B (128 × 16 bf16,
// shared memory at desc, K-major)
__device__ __forceinline__ void wgmma_n128(float* d, const uint32_t a[4], uint64_t desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_R64 " }, {%64, %65, %66, %67}, %68, "
                 "1, 1, 1, 0;\n"
                 : WG_D64(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// d (64 × 64 fp32, the warpgroup's accumulators: 32 per thread) += A (64 × 16 bf16, registers) · B (64 × 16 bf16,
// shared memory at desc, K-major)
__device__ __forceinline__ void wgmma_n64(float* d, const uint32_t a[4], uint64_t desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_R32 " }, {%32, %33, %34, %35}, %36, "
                 "1, 1, 1, 0;\n"
                 : WG_D32(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// d (64 × 128 fp32) += A (64 × 16 bf16, shared memory at da, K-major) · B (128 × 16 bf16, shared memory at db,
// K-major): both operands from shared memory (gemm_wgmma.cu's dequantized path)
__device__ __forceinline__ void wgmma_ss_n128(float* d, uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_R64 " }, %64, %65, 1, 1, 1, 0, 0;\n"
                 : WG_D64(d) : "l"(da), "l"(db));
}

// d (64 × 64 fp32) += A (64 × 16 bf16 at da) · B (64 × 16 bf16 at db), both K-major in shared memory
__device__ __forceinline__ void wgmma_ss_n64(float* d, uint64_t da, uint64_t db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_R32 " }, %32, %33, 1, 1, 1, 0, 0;\n"
                 : WG_D32(d) : "l"(da), "l"(db));
}

// The wgmmas of one 64-wide stage on the x tile at shared address x0: k slices 0..ns-1 (4, or 2 for a last half
// stage); af[h] holds slice h's A registers.
template <int N>
__device__ __forceinline__ void wg_issue(float* d, const uint32_t (&af)[4][4], uint32_t x0, int ns) {
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        if (h >= 2 && h >= ns) return;
        if constexpr (N == 64) wgmma_n64(d, af[h], wg_desc(x0, h));
        else wgmma_n128(d, af[h], wg_desc(x0, h));
    }
}

// ------------------------------------------------------------------------------------------------ A in registers

// A's register fragment is mma.sync m16n8k16's, per warp of the group (rows 16w..16w+15 of the 64): lane (g, t) holds
// rows g and g + 8 at k = 2t, 2t+1 and 2t+8, 2t+9. Over a 32-wide chunk (two wgmma k-slices) a lane needs, per row,
// the element pairs P_j = (8j + 2t, 8j + 2t + 1), j = 0..3: P_0, P_1 for the first slice, P_2, P_3 for the second.
// wg_decode builds them for every format as bf16x2 of w = q · s rounded once (RN(W), as a dequantizing GEMM
// stores them; bf16 weights as stored), from the stage's planes laid out as in gemm.cu.

// bf16x2 (lo, hi) times s in fp32, rounded once
__device__ __forceinline__ uint32_t scale_pair(uint32_t v, float s) {
    return pack_bf2(__uint_as_float(v << 16) * s, __uint_as_float(v & 0xFFFF0000u) * s);
}

// wq: the chunk's qs bytes of row 0, rows `rs` bytes apart; wh: its qh bytes, rows QH bytes apart.
template <int BITS>
__device__ __forceinline__ void wg_decode(const uint8_t* wq, int rs, const uint8_t* wh, int row, int t, float s,
                                          uint32_t a[4]) {
    if constexpr (BITS == 16) {
        const uint32_t* r = reinterpret_cast<const uint32_t*>(wq + row * rs);  // word p: elements 2p, 2p + 1
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = r[4 * j + t];
    } else if constexpr (BITS == 8) {
        const uint16_t* r = reinterpret_cast<const uint16_t*>(wq + row * rs);  // half-word p: elements 2p, 2p + 1
        const uint32_t u[2] = {((uint32_t)r[t] | ((uint32_t)r[4 + t] << 16)) ^ 0x80808080u,
                               ((uint32_t)r[8 + t] | ((uint32_t)r[12 + t] << 16)) ^ 0x80808080u};
        q8_scaled_pairs(u, s, a);
    } else {
        // byte 4j + t of the row's 16 holds P_j's two nibbles: byte t of each word, gathered into one word
        const uint4 v = *reinterpret_cast<const uint4*>(wq + row * rs);
        const uint32_t sel = (uint32_t)t | ((uint32_t)(t + 4) << 4);
        const uint32_t w = __byte_perm(__byte_perm(v.x, v.y, sel), __byte_perm(v.z, v.w, sel), 0x5410u);
        uint32_t h = 0u;  // the high bits as nibble_pairs takes them
        if constexpr (BITS == 5) {  // bit 8j + 2t + e of the row's 32: element e of P_j -> bit 2j + e
            const uint32_t q = *reinterpret_cast<const uint32_t*>(wh + row * 4) >> (2 * t);
            h = (q & 0x3u) | ((q >> 6) & 0xCu) | ((q >> 12) & 0x30u) | ((q >> 18) & 0xC0u);
        } else if constexpr (BITS == 6) {  // bits 16j + 4t.. of the row's 64: P_j's 4 bits -> bits 4j..
            const uint2 hv = *reinterpret_cast<const uint2*>(wh + row * 8);
            const uint32_t x0 = hv.x >> (4 * t), x1 = hv.y >> (4 * t);
            h = (x0 & 0xFu) | ((x0 >> 12) & 0xF0u) | ((x1 & 0xFu) << 8) | ((x1 >> 4) & 0xF000u);
        }
        nibble_pairs<BITS>(w, h, a);
#pragma unroll
        for (int j = 0; j < 4; ++j) a[j] = scale_pair(a[j], s);
    }
}

}  // namespace
