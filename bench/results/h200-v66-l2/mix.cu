#include <cstdint>
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
// per block: thread 0 bulk-copies `per` bytes of A into smem (mode & 1); every thread loads `lsu` bytes of B into
// registers in `waves` waves (mode & 2); times (ns, globaltimer) of: start, register loads in, bulk copy in.
extern "C" __global__ void mix(const char* A, const int4* B, uint32_t per, uint32_t lsu, int mode, unsigned long long* out) {
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) unsigned long long bar;
    __shared__ unsigned long long t_reg;
    const uint32_t b = sa(&bar);
    const unsigned long long t0 = gt();
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(b), "r"(1) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        if (mode & 1) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(per) : "memory");
            for (uint32_t o = 0; o < per; o += 32768)
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             ::"r"(sa(sm) + o), "l"(A + (size_t)blockIdx.x * per + o), "r"(min(32768u, per - o)), "r"(b) : "memory");
        } else {
            asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory");
        }
    }
    __syncthreads();
    int acc = 0;
    if (mode & 2) {
        // lsu bytes a block: 16 B a thread a load, 8 loads in flight a thread, then used
        const int4* p = B + (size_t)blockIdx.x * (lsu / 16);
        for (uint32_t i = threadIdx.x; i < lsu / 16; i += 8 * blockDim.x) {
            int4 v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = i + j * blockDim.x < lsu / 16 ? __ldg(p + i + j * blockDim.x) : make_int4(0, 0, 0, 0);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].w;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) t_reg = gt();
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(b), "r"(0) : "memory");
    } while (!done);
    if (threadIdx.x == 0) {
        out[3 * blockIdx.x] = t0;
        out[3 * blockIdx.x + 1] = t_reg;
        out[3 * blockIdx.x + 2] = gt();
    }
    if (acc == 0x1234567 && sm[threadIdx.x] == 3) out[0] = 0;
}
extern "C" __global__ void rd(const uint4* p, long long n16, unsigned* out) {
    unsigned s = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
        uint4 v = __ldcg(p + i); s ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (s == 0x12345678u) out[blockIdx.x] = s;
}
