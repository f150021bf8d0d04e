// logprobs.cu: the log-probabilities OpenAI's `logprobs` / `top_logprobs` report, on the device, so that a drawn
// row sends back a record of LP_INTS ints instead of its 1 MB of logits.
//
// Matches ninfer_rt.logprobs.token_logprob: log_softmax of the raw logits over ids < V (before temperature,
// penalties or truncation): lse = m + log Σ exp(x - m); the drawn token's x - lse; the row's `top` largest (x, id),
// x descending and id ascending on ties, each x - lse. NaN logits rank as -inf (as the arg-max and the sampler).
//
// Layouts: logits [M, ld] fp32 (the first V entries of a row are the vocabulary); tops int32 [M]: how many
// alternatives row m lists (0..LP_TOP), or -1: the row asks for no logprobs and both kernels skip it; part:
// nsplit = ceil(V / LP_CHUNK) LpPart records a row; out int32 [M, LP_INTS]: lse (fp64, ints 0-1), the token's
// logit (fp32 bits), n, then n pairs (id, logit as fp32 bits), most likely first.
//
// logprob_rows (grid (nsplit, M), LP_THREADS threads): block b of row m takes ids [b·LP_CHUNK, (b+1)·LP_CHUNK),
//   LP_PER a thread in registers: its max m_b, S_b = Σ exp(x - m_b) (each exp to ~2 ulp, summed in fp64) and its
//   top n (x, id) in order, n rounds of a block arg-max. With raw (fp32 [M, ld]) it copies the row there, so that
//   logprob_finish reads the token's logit from before penalize_rows changes the row in place.
// logprob_finish (grid M, LP_FIN_THREADS threads), after the draw: m = max m_b, lse = m + log Σ_b S_b exp(m_b - m)
//   (fp64); the top n by merging the blocks' sorted lists; the token tokens[m]'s logit from src (raw or logits).
#include "common.cuh"

#define LP_TOP 20                        // alternatives a token may list (logprobs.MAX_TOP_LOGPROBS)
#define LP_THREADS 256
#define LP_PER 16                        // logits a thread holds
#define LP_CHUNK (LP_THREADS * LP_PER)   // ids a block takes
#define LP_FIN_THREADS 64
#define LP_MAX_SPLIT 256                 // blocks a row (V <= 1,048,576; misc.py checks)
#define LP_INTS (4 + 2 * LP_TOP)

struct LpPart {  // one block's slice of a row; numpy twin: ninfer_rt.gpu.misc.LP_PART_BYTES
    float m;     // its largest logit (-inf when it has no finite one)
    int n;       // entries in v / i
    double s;    // Σ exp(x - m) over the slice
    float v[LP_TOP];
    int i[LP_TOP];
};
static_assert(sizeof(LpPart) == 176, "LpPart must match misc.LP_PART_BYTES");

__device__ __forceinline__ double block_sum_f64(double v, double* red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double t = lane < nw ? red[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

extern "C" __global__ void __launch_bounds__(LP_THREADS) logprob_rows(const float* logits, long long ld, int V,
                                                                      const int* tops, float* raw, LpPart* part)
{ ninfer_pdl_begin();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ double sd[32];
    __shared__ float wv[LP_TOP];
    __shared__ int wi[LP_TOP];
    const int m = blockIdx.y, top = min(tops[m], LP_TOP);
    if (top < 0) return;  // block-uniform: the row asks for no logprobs
    const float* row = logits + static_cast<long long>(m) * ld;
    const int c0 = blockIdx.x * LP_CHUNK;
    float v[LP_PER];
    float bm = -INFINITY;
#pragma unroll
    for (int j = 0; j < LP_PER; ++j) {  // id c0 + j·LP_THREADS + tid: each load a coalesced line
        const int id = c0 + j * LP_THREADS + threadIdx.x;
        const float x = id < V ? row[id] : -INFINITY;
        if (raw && id < V) raw[static_cast<long long>(m) * ld + id] = x;
        v[j] = is_nan_bits(x) ? -INFINITY : x;
        bm = fmaxf(bm, v[j]);
    }
    const float mb = block_max(bm, sv);
    double s = 0.0;
    if (mb > -INFINITY) {
#pragma unroll
        for (int j = 0; j < LP_PER; ++j) s += static_cast<double>(exp_accurate(v[j] - mb));
    }
    s = block_sum_f64(s, sd);
    unsigned taken = 0u;  // bit j: v[j] is listed already
    for (int r = 0; r < top; ++r) {
        float bv = -INFINITY;
        int bi = INT_MAX;
#pragma unroll
        for (int j = 0; j < LP_PER; ++j) {
            const int id = c0 + j * LP_THREADS + threadIdx.x;
            if (id < V && !(taken >> j & 1u)) arg_take(bv, bi, v[j], id);
        }
        block_argmax(bv, bi, sv, si);
        if (threadIdx.x == 0) {
            wv[r] = bv;
            wi[r] = bi;
        }
        __syncthreads();
        const int w = wi[r] - c0;  // INT_MAX - c0 when the slice has run out: owned by no thread
        if (w >= 0 && w < LP_CHUNK && w % LP_THREADS == threadIdx.x) taken |= 1u << (w / LP_THREADS);
    }
    if (threadIdx.x == 0) {
        LpPart* p = part + static_cast<long long>(m) * gridDim.x + blockIdx.x;
        p->m = mb;
        p->s = s;
        int n = 0;
        for (int r = 0; r < top && wi[r] != INT_MAX; ++r, ++n) {
            p->v[n] = wv[r];
            p->i[n] = wi[r];
        }
        p->n = n;
    }
}

extern "C" __global__ void __launch_bounds__(LP_FIN_THREADS) logprob_finish(const int* tokens, const float* src,
                                                                            long long ld, int V, const int* tops,
                                                                            const LpPart* part, int nsplit, int* out)
{ ninfer_pdl_begin();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ double sd[32];
    __shared__ int head[LP_MAX_SPLIT];
    const int m = blockIdx.x, top = min(tops[m], LP_TOP), tid = threadIdx.x;
    if (top < 0) return;
    const LpPart* p = part + static_cast<long long>(m) * nsplit;
    float mx = -INFINITY;
    for (int j = tid; j < nsplit; j += blockDim.x) {
        mx = fmaxf(mx, p[j].m);
        head[j] = 0;
    }
    mx = block_max(mx, sv);
    double s = 0.0;
    for (int j = tid; j < nsplit; j += blockDim.x)
        if (p[j].m > -INFINITY) s += p[j].s * exp(static_cast<double>(p[j].m) - static_cast<double>(mx));
    s = block_sum_f64(s, sd);  // (its barriers also publish head)
    int* o = out + static_cast<long long>(m) * LP_INTS;
    const int n = min(top, V);
    for (int r = 0; r < n; ++r) {  // merge: each thread offers the heads of the lists it owns
        float bv = -INFINITY;
        int bi = INT_MAX;
        for (int j = tid; j < nsplit; j += blockDim.x)
            if (head[j] < p[j].n) arg_take(bv, bi, p[j].v[head[j]], p[j].i[head[j]]);
        block_argmax(bv, bi, sv, si);
        if (tid == 0) {
            o[4 + 2 * r] = bi;
            o[5 + 2 * r] = __float_as_int(bv);
            if (bi != INT_MAX) ++head[bi / LP_CHUNK];
        }
        __syncthreads();
    }
    if (tid == 0) {
        const double lse = mx > -INFINITY ? static_cast<double>(mx) + log(s) : -INFINITY;
        reinterpret_cast<double*>(o)[0] = lse;
        const int t = tokens[m];
        o[2] = __float_as_int(t >= 0 && t < V ? src[static_cast<long long>(m) * ld + t] : __int_as_float(0x7fc00000));
        o[3] = n;
    }
}
