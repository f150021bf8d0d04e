// cluster.cuh: exchanges between the C blocks of a thread-block cluster along x (sm_90+), as the DeltaNet step
// (deltanet_step.cu) runs one value head of one sequence on C blocks. C = 1 is a lone block: local stores and
// __syncthreads. Kernels built on these exist on every target, so all images have the same entry points; below
// sm_90 the C > 1 paths trap.
#pragma once
#include "common.cuh"  // smem_addr

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DN_CLUSTERS 1
#else
#define DN_CLUSTERS 0
#endif

// At the start: trap unless launched as clusters of C; arrive (relaxed) on the barrier cluster_wait completes.
template <int C>
__device__ __forceinline__ void cluster_begin() {
    if constexpr (C > 1) {
#if DN_CLUSTERS
        uint32_t n;
        asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
        if (n != C) __trap();
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
        __trap();
#endif
    }
}

// Wait until every block of the cluster has started (cluster_begin): stores into their shared memory may start.
template <int C>
__device__ __forceinline__ void cluster_wait() {
#if DN_CLUSTERS
    if constexpr (C > 1) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The 4 floats at p (16-byte aligned, this block's copy) into the same place of every other block by st.async, each
// store completing 16 bytes on that block's mbarrier bar (as store_all).
template <int C>
__device__ __forceinline__ void copy4_to_others_async(const float* p, int self, uint64_t* bar) {
#if DN_CLUSTERS
    const float4 v = *reinterpret_cast<const float4*>(p);
    const uint32_t a = smem_addr(p), mb = smem_addr(bar);
#pragma unroll
    for (int r = 0; r < C; ++r) {
        if (r == self) continue;
        uint32_t ra, rb;
        asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(r));
        asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(mb), "r"(r));
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                     ::"r"(ra), "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                     "r"(__float_as_uint(v.w)), "r"(rb) : "memory");
    }
#endif
}

// v into the shared variable p of every block of the cluster (itself included). C > 1: by st.async, each store
// completing 4 bytes on the same block's mbarrier bar: a receiver waits on its own mbarrier, with no cluster barrier
// (whose release would wait for the sender's global stores). C = 1: a plain store (the caller's block barrier
// publishes it; bar unused).
template <int C>
__device__ __forceinline__ void store_all(float* p, float v, uint64_t* bar) {
    if constexpr (C == 1) {
        *p = v;
    } else {
#if DN_CLUSTERS
        const uint32_t a = smem_addr(p), mb = smem_addr(bar);
#pragma unroll
        for (int r = 0; r < C; ++r) {
            uint32_t ra, rb;
            asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(r));
            asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(mb), "r"(r));
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(ra),
                         "r"(__float_as_uint(v)), "r"(rb) : "memory");
        }
#endif
    }
}
