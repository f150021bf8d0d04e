// chain.cu: the persistent decode kernel's first op family. chain_gemv_q8 runs a list of M = 1 stream GEMVs of q8
// weights in one resident grid: op i waits on a counter of op i - 1's block arrivals where a kernel of its own waits
// at a kernel boundary. Each op is gemv_q8_s1's body with xvec 2 (x, and norm_w, copied into shared memory by
// cp.async), whose first two register tiles are issued before its wait. Measured (perf.md v111): such a wait costs
// more than the programmatic launch boundary it replaces, so this is a measuring tool, not a decode path.
//
//   ops ChainGemv [n] (device memory): op i computes y_i = W_i x̂_i (mode 0, store) or y_i += W_i x̂_i (mode 1, add)
//   with x̂_i the fused zero-centred RMSNorm of x_i by norm_w_i (x_i itself where norm_w_i is null), exactly as
//   gemv_q8_s1 launched with the same grid and d; W_i [N_i, K_i] in the q8g{32,64,128} artifact layout (gemv.cu).
//   done uint32 [2n], zero before the launch: op i's counter, gridDim.x once every block has finished op i, then
//   op i's flag (1 once the counter is full; written where the wait polls flags).
// An op may read what earlier ops wrote (x_i = y_j, j < i) and write what earlier ops read: op i reads x_i and
// writes y_i only after every block finished op i - 1 (which waited on op i - 2, and so on). The grid must be
// resident all at once (chain.py sizes it by the occupancy query): a block waiting on one that cannot start would
// wait forever. Reference: ninfer_rt.reference.ops.linear per op, in order; the same sums to the bit as
// linear.gemv's gemv_q8_s1 launches at the same blocks and d (tests/gpu/test_chain.py).
#include "gemv_stream.cuh"  // gemv_stream_body

namespace {

// One op of the chain as chain.py's CHAIN_GEMV lays it out (80 bytes, 8-byte aligned).
struct ChainGemv {
    const uint8_t* qs;     // q8 codes, the artifact's row-major units
    const uint8_t* qh;     // unused by q8 (null)
    const uint8_t* sc;     // fp16 group scales
    const float* x;        // fp32 [K]
    float* y;              // fp32 [N]
    const float* norm_w;   // fp32 [K] or null (no norm)
    int N, K, kp, gshift;  // rows, columns, stored row length, log2(group)
    int mode, d;           // 0 store / 1 add; units per lane and row of a register tile (1..2)
    float eps;
    int pad;
};
static_assert(sizeof(ChainGemv) == 80, "chain.py's CHAIN_GEMV");

// Op i's wait: thread 0 polls with acquire loads until op i - 1 is done; the block barrier then orders the block's
// reads of x and y after it. The first op waits on the kernel before, as any kernel does (programmatic dependent
// launch). How (`how`, a launch argument; perf.md v111 measured each, 0 the fastest): 0 polls op i - 1's counter,
// which the arrivals add to; 1 the same with a 64 ns sleep between polls (fewer loads queued at the counter's L2
// slice beside the arrivals); 2 polls a flag that the block arriving last sets (the polls off the arrivals' line);
// 3 does not wait at all, for ops that read nothing the chain writes (chain_bench's bound: the stream alone).
struct ChainWait {
    static constexpr bool kChain = true;
    const unsigned* prev;  // op i - 1's counter (how 0, 1) or flag (how 2); null for op 0
    unsigned target;       // gridDim.x (how 0, 1) or 1 (how 2)
    int how;
    __device__ __forceinline__ void operator()() const {
        if (prev == nullptr) {
            (ninfer_pdl_begin)();  // the function: the body this waits for stamps the warp (NINFER_TL_WAIT)
            return;
        }
        if (how == 3) return;
        if (threadIdx.x == 0) {
            unsigned now;
            while (true) {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(prev) : "memory");
                if (now >= target) break;
                if (how == 1) __nanosleep(64);
            }
        }
        __syncthreads();
    }
};

// The block's arrival at op i's counter once all its threads are done with op i (their y stores and adds made
// visible at gpu scope by thread 0's fence, which is cumulative over the block barrier before it); with how 2 the
// last block to arrive also sets op i's flag (release: after its acquire-release addition saw every other's).
__device__ __forceinline__ void chain_arrive(unsigned* done, unsigned* flag, int how) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned before = atomicAdd(done, 1u);
        if (how == 2 && before == gridDim.x - 1) {
            __threadfence();
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(1u) : "memory");
        }
    }
}

}  // namespace

// chain_gemv_q8(ops, n, done, how): grid = the resident blocks chain.py planned (at most 2 an SM), 256 threads,
// dynamic shared memory = the largest op's slab plus its x (and norm_w) copies; done uint32 [2n] zero (counters,
// then flags).
extern "C" __global__ void __launch_bounds__(256, 2)
    chain_gemv_q8(const ChainGemv* __restrict__ ops, int n, unsigned* done, int how) {
    for (int i = 0; i < n; ++i) {
        const ChainGemv op = ops[i];
        const unsigned* prev = i == 0 ? nullptr : (how == 2 ? done + n + i - 1 : done + i - 1);
        gemv_stream_body<8, false, false, false, false, 1, ChainWait>(
            op.qs, op.qh, op.sc, op.x, op.y, op.norm_w, nullptr, op.N, op.K, op.kp, op.gshift, op.K, op.N, op.mode,
            op.eps, 2, op.d, nullptr, nullptr, nullptr, 0, ChainWait{prev, how == 2 ? 1u : gridDim.x, how});
        chain_arrive(done + i, done + n + i, how);
    }
}
