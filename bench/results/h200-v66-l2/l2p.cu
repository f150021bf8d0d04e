#include <cstdint>
// slice b of gridDim.x of [p, p+bytes) asked of L2 by one bulk prefetch per 64 KB piece (thread 0)
extern "C" __global__ void pf(const char* p, long long bytes, int mode) {
    if (threadIdx.x != 0) return;
    long long chunk = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~15LL, lo = (long long)blockIdx.x * chunk;
    long long hi = lo + chunk < bytes ? lo + chunk : bytes;
    uint64_t pol;
    if (mode == 2) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    for (long long a = lo; a < hi; a += 65536) {
        uint32_t n = (uint32_t)((hi - a < 65536 ? hi - a : 65536) + 15) & ~15u;
        if (mode == 2)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p + a), "r"(n), "l"(pol) : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + a), "r"(n) : "memory");
    }
}
// read [p, p+bytes) (uint4 loads), write a sum per block so nothing is dropped
extern "C" __global__ void rd(const uint4* p, long long n16, unsigned* out) {
    unsigned s = 0;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += 4 * step) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = i + j * step < n16 ? __ldcg(p + i + j * step) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < 4; ++j) s ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    if (s == 0x12345678u) out[blockIdx.x] = s;
}
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
// read with the evict_last policy on every load
extern "C" __global__ void rdl(const uint4* p, long long n16, unsigned* out) {
    unsigned s = 0;
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += step) {
        uint4 v;
        asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i), "l"(pol));
        s ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (s == 0x12345678u) out[blockIdx.x] = s;
}
// bulk prefetch in 16 KB pieces, evict_last
extern "C" __global__ void pf16(const char* p, long long bytes) {
    long long chunk = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~15LL, lo = (long long)blockIdx.x * chunk;
    long long hi = lo + chunk < bytes ? lo + chunk : bytes;
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    for (long long a = lo + threadIdx.x * 16384; a < hi; a += 16384 * blockDim.x) {
        uint32_t n = (uint32_t)((hi - a < 16384 ? hi - a : 16384) + 15) & ~15u;
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p + a), "r"(n), "l"(pol) : "memory");
    }
}
