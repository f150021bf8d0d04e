// gemv_stream.cu: the persistent, register-pipelined decode GEMV for M = 1 (gemv_<code>_s1), used when all of
// x̂ fits one shared-memory slab (K <= 10240 / 18688), and its copies for M = 2..4 rows (gemv_<code>_s{2,3,4}: a
// batched decode step, the slab M-row chunk records). Semantics, layouts and reference ops: as gemv.cu (y = W x̂
// with the fused RMSNorm, store / add / SwiGLU epilogues); tested with it in tests/gpu/test_linear.py.
#include "gemv_stream.cuh"  // gemv_stream_body (and gemv.cuh, gemv_stage.cuh)

// The M = 1 stream kernels gemv_{q4,q5,q6,q8,bf16}_s1: the same arguments (ldy, kw_log2 and ks unused), then d,
// the units per lane and row of one register tile (1..StreamDepth). 2 blocks per SM: 128 registers hold two
// tiles. xvec: 0 scalar x loads, 1 float4 loads, 2 cp.async through K (+ K with norm_w) floats of shared memory
// after the slab (x, norm_w and that memory 16-byte aligned; linear.py takes it past one 4096-element pass before
// sm_90, up to it on sm_90+).
// gemv_<code>_s1b (sm_90+; linear.py's default past K = 4096): the same with xvec 2's copies made by bulk copies
// (16 bytes more shared memory).
// gemv_<code>_s1s / _s1bs: _s1 / _s1b for swiglu only (linear.py launches them for every M = 1 stream swiglu): a
// second loop in the kernel that also serves store/add made its swiglu loop 5% slower (perf-history.md v59). _s1 / _s1b
// then carry no swiglu code (they trap on mode 2): 6% fewer instructions, both models' steps -0.4 to -0.5% (v60).
// gemv_<code>_s1r (quantized codes): x is x̂ itself, K/32 chunk records (qchunk_bytes(1) each, in the weights' XQ
// order, as act_records16 lays them out) written by x's producer, copied into the slab as _s1b copies x (xvec 2;
// no norm, 16 bytes of shared memory after the slab), without coding (linear.gemv x_records, which launches it on
// sm_90+ only: the cp.async copy older GPUs' builds compile is not reached by any test).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define NINFER_GEMV_BULK false  // no copy engine: _s1b is _s1 (linear.py launches it on sm_90+ only)
#else
#define NINFER_GEMV_BULK true
#endif
#define NINFER_GEMV_S1(name, BITS)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1(NINFER_GEMV_ARGS, int d) {                                                        \
        gemv_stream_body<BITS, false>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift, ldx, ldy, mode,    \
                                      eps, xvec, d);                                                       \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1b(NINFER_GEMV_ARGS, int d) {                                                       \
        gemv_stream_body<BITS, NINFER_GEMV_BULK>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp, gshift,    \
                                                 ldx, ldy, mode, eps, xvec, d);                                 \
    }

#define NINFER_GEMV_S1S(name, BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1s(NINFER_GEMV_ARGS, int d) {                                                       \
        gemv_stream_body<BITS, false, false, false, true>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp,   \
                                                          gshift, ldx, ldy, mode, eps, xvec, d);                \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1bs(NINFER_GEMV_ARGS, int d) {                                                      \
        gemv_stream_body<BITS, NINFER_GEMV_BULK, false, false, true>(qs, qh, sc, x, y, norm_w, row_scale,  \
                                                                     N, K, kp, gshift, ldx, ldy, mode, eps,     \
                                                                     xvec, d);                             \
    }

#define NINFER_GEMV_S1R(name, BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1r(NINFER_GEMV_ARGS, int d) {                                                       \
        gemv_stream_body<BITS, NINFER_GEMV_BULK, true>(qs, qh, sc, x, y, norm_w, row_scale, N, K, kp,      \
                                                       gshift, ldx, ldy, mode, eps, xvec, d);                   \
    }

// gemv_<code>_s1bw: _s1b in swiglu mode (mode and y unused) that writes y as its N/64 chunk records instead (yrec,
// in the down projection's XQ order yq), each by a block that sees the chunk's 32 (value, 1) pairs in ybox[N/2]
// (uint64, zero before the launch, zero after it), with counters ycnt[2][N/64]: linear.gemv y_records; N % 64 == 0.
#define NINFER_GEMV_S1W(name, BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s1bw(NINFER_GEMV_ARGS, int d, uint8_t* __restrict__ yrec, unsigned long long* ybox,   \
                           unsigned* ycnt, int yq) {                                                       \
        gemv_stream_body<BITS, NINFER_GEMV_BULK, false, true>(qs, qh, sc, x, y, norm_w, row_scale, N, K,   \
                                                              kp, gshift, ldx, ldy, mode, eps, xvec, d, yrec,   \
                                                              ybox, ycnt, yq);                             \
    }

// gemv_<code>_s{2,3,4}: the stream kernel for M = 2..4 activation rows, for a batched decode step: each weight
// unit read once meets every row's x̂ (a register tile of one unit per lane and row: StreamDepth), x̂ staged from x
// in registers as gemv_body stages it (xvec 0 / 1, the slab K/32 M-row chunk records), every mode at run time.
#define NINFER_GEMV_SM(name, BITS, M)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s##M(NINFER_GEMV_ARGS, int d) {                                                      \
        gemv_stream_body<BITS, false, false, false, false, M>(qs, qh, sc, x, y, norm_w, row_scale, N, K,   \
                                                              kp, gshift, ldx, ldy, mode, eps, xvec, d);        \
    }
// gemv_q8_s{2,3,4}r: x is x̂ itself, K/32 M-row chunk records (qchunk_bytes(M) each, XQ 1) written by x's producer,
// copied into the slab as _s1r copies one row's (linear.gemv x_records): out_proj and o_proj of a batched step.
// q8 only, the recipes' format there: every format would add ~18 s a target to the build.
#define NINFER_GEMV_SMR(name, BITS, M)                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                  \
        gemv_##name##_s##M##r(NINFER_GEMV_ARGS, int d) {                                                   \
        gemv_stream_body<BITS, NINFER_GEMV_BULK, true, false, false, M>(qs, qh, sc, x, y, norm_w, row_scale,  \
                                                                        N, K, kp, gshift, ldx, ldy, mode, eps, \
                                                                        xvec, d);                          \
    }
#define NINFER_GEMV_SM_ALL(M) \
    NINFER_GEMV_SM(q4, 4, M) NINFER_GEMV_SM(q5, 5, M) NINFER_GEMV_SM(q6, 6, M) NINFER_GEMV_SM(q8, 8, M) \
    NINFER_GEMV_SM(bf16, 16, M)

NINFER_GEMV_S1(q4, 4)
NINFER_GEMV_S1(q5, 5)
NINFER_GEMV_S1(q6, 6)
NINFER_GEMV_S1(q8, 8)
NINFER_GEMV_S1(bf16, 16)
NINFER_GEMV_S1S(q4, 4)
NINFER_GEMV_S1S(q5, 5)
NINFER_GEMV_S1S(q6, 6)
NINFER_GEMV_S1S(q8, 8)
NINFER_GEMV_S1S(bf16, 16)
NINFER_GEMV_S1R(q4, 4)
NINFER_GEMV_S1R(q5, 5)
NINFER_GEMV_S1R(q6, 6)
NINFER_GEMV_S1R(q8, 8)
NINFER_GEMV_S1W(q4, 4)
NINFER_GEMV_S1W(q5, 5)
NINFER_GEMV_S1W(q6, 6)
NINFER_GEMV_S1W(q8, 8)
NINFER_GEMV_SM_ALL(2)
NINFER_GEMV_SM_ALL(3)
NINFER_GEMV_SM_ALL(4)
NINFER_GEMV_SMR(q8, 8, 2)
NINFER_GEMV_SMR(q8, 8, 3)
NINFER_GEMV_SMR(q8, 8, 4)
