// sampling.cu: arg-max, penalties and on-device sampling over rows of fp32 logits.
//
// Layouts: logits [M, ld] fp32, the first V entries of each row are the vocabulary; outputs int32 [M] token ids,
// or fp32 [M, V] final probabilities (sample_rows with `probs`), and with them the kept tokens alone as int32
// [M, 1 + 2·1024] (`support`: the count L, then L pairs of id and fp32 bits, in the sorted order below). NaN logits
// rank as -inf everywhere.
//
// argmax_rows / argmax_finish: torch.argmax over logits[m, :V] (ties -> the lowest index). A row is split over
//   gridDim.x blocks of `chunk` entries each (16-byte loads when aligned); each block leaves its best
//   (value, index) in part_v/part_i and argmax_finish reduces them. With one block per row it writes out directly.
//
// penalize_rows / penalty_count: the repetition, presence and frequency penalties of sampling.apply_penalties,
//   from a sequence's dense per-id state (seen in its history, count in its output), which the draw keeps.
//
// mask_rows: a copy of each row with the ids its slot's bitmask leaves out set to -inf (a JSON row's allowed
//   tokens, so that any draw over the copy is one the constraint takes); the rows themselves stay as they were.
//
// sample_hist / sample_rows: the distribution of ninfer_rt/sampling.py's Sampler.distribution (HF order:
//   temperature -> top-k -> top-p -> min-p), then one draw. Candidates are capped at SAMPLE_CAND = 1024: with
//   top_k = 0 or top_k > 1024 the sampler behaves as top_k = 1024 (vLLM / llama.cpp practice). The K-th largest
//   key t is found by a radix select (11 + 11 + 10 bits): sample_hist builds the first-digit histogram over many
//   blocks; sample_compact (as many blocks) picks the first digit b1 and copies every key whose digit is >= b1, with
//   its index, into one segment per block, in index order (typically a few thousand of the row's entries);
//   sample_rows refines the select over those; candidates are every key > t and the keys == t in index order, at
//   most 1024 in all (HF keeps all ties with the k-th value; only ties that overflow the cap are dropped). They are sorted
//   by (logit desc, index asc); probabilities, top-p and min-p are computed in fp64 as the reference does.
//   The draw: u in [0, 1) from Philox4x32-10 with key = seed and counter = (step, 0), so a request draws the same
//   numbers whatever row it occupies; the token is the inverse CDF of u over the kept tokens in sorted order.
//   temperature <= 0 (or NaN) is greedy: the arg-max, lowest index on ties, with probability 1.
#include "common.cuh"

#define SAMPLE_THREADS 1024  // sample_rows: one block per row, one candidate per thread
#define SAMPLE_CAND 1024     // candidate cap
#define HIST_BINS 2048       // first radix digit: key bits 31..21
#define MAX_SEGMENTS 256     // sample_compact blocks per row (misc.py: V <= 256 × its chunk)

struct SampleParams {  // numpy twin: ninfer_rt.gpu.misc.SAMPLE_PARAMS
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    unsigned long long seed;
    unsigned long long step;
};
static_assert(sizeof(SampleParams) == 32, "SampleParams must match misc.SAMPLE_PARAMS");

// ------------------------------------------------------------------------------------------ arg-max

// grid (nsplit, M): block b scans logits[m, b*chunk : min(V, (b+1)*chunk)); chunk is a multiple of 4 when
// nsplit > 1. nsplit == 1: out[m] is written here and part_v/part_i are unused.
extern "C" __global__ void __launch_bounds__(1024) argmax_rows(const float* logits, long long ld, int V, int chunk,
                                                               float* part_v, int* part_i, int* out)
{ ninfer_pdl_begin();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int m = blockIdx.y;
    const float* row = logits + static_cast<long long>(m) * ld;
    const int c0 = blockIdx.x * chunk, c1 = min(V, c0 + chunk);
    const bool vec = (reinterpret_cast<uintptr_t>(logits) & 15) == 0 && (ld & 3) == 0;
    float bv = -INFINITY;
    int bi = INT_MAX;
    if (vec) {
        // c0 is a multiple of 4: float4 groups [c0/4, c1/4), then a scalar tail of c1 % 4 entries
        const int g0 = c0 >> 2, g1 = c1 >> 2;
        const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
        for (int g = g0 + threadIdx.x; g < g1; g += blockDim.x) {
            const float4 t = r4[g];
            const int i = g << 2;
            arg_take(bv, bi, is_nan_bits(t.x) ? -INFINITY : t.x, i);
            arg_take(bv, bi, is_nan_bits(t.y) ? -INFINITY : t.y, i + 1);
            arg_take(bv, bi, is_nan_bits(t.z) ? -INFINITY : t.z, i + 2);
            arg_take(bv, bi, is_nan_bits(t.w) ? -INFINITY : t.w, i + 3);
        }
        for (int i = (g1 << 2) + threadIdx.x; i < c1; i += blockDim.x) {
            const float v = row[i];
            arg_take(bv, bi, is_nan_bits(v) ? -INFINITY : v, i);
        }
    } else {
        for (int i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
            const float v = row[i];
            arg_take(bv, bi, is_nan_bits(v) ? -INFINITY : v, i);
        }
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        if (gridDim.x == 1) {
            out[m] = bi;
        } else {
            part_v[static_cast<long long>(m) * gridDim.x + blockIdx.x] = bv;
            part_i[static_cast<long long>(m) * gridDim.x + blockIdx.x] = bi;
        }
    }
}

// grid M, block 32: out[m] = the best of argmax_rows' nsplit partial results of row m.
extern "C" __global__ void argmax_finish(const float* part_v, const int* part_i, int nsplit, int* out)
{ ninfer_pdl_begin();
    __shared__ float sv[32];
    __shared__ int si[32];
    const long long base = static_cast<long long>(blockIdx.x) * nsplit;
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int j = threadIdx.x; j < nsplit; j += blockDim.x) arg_take(bv, bi, part_v[base + j], part_i[base + j]);
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

// ------------------------------------------------------------------------------------------ penalties

// penalize_rows: sampling.py's apply_penalties on each row m of logits[m, :V], in place and in fp32 (the host
//   twin: misc.penalize_reference). With s = slots[m] and pen[s] = (r, presence, frequency, -):
//   seen[s, i] (uint8: id i is in the sequence's history, prompt and output): v = v > 0 ? v / r : v * r;
//   counts[s, i] (int32: id i's count in the output): v -= frequency * count + presence, where count > 0.
//   pen (1, 0, 0) leaves a row as it is. grid (nblk, M), block 256, a grid-stride loop over the row.
extern "C" __global__ void __launch_bounds__(256) penalize_rows(float* logits, long long ld, int V, const int* slots,
                                                                const float4* pen, const int* counts,
                                                                const unsigned char* seen)
{ ninfer_pdl_begin();
    const int m = blockIdx.y, s = slots[m];
    const float4 p = pen[s];
    if (p.x == 1.f && p.y == 0.f && p.z == 0.f) return;
    float* row = logits + static_cast<long long>(m) * ld;
    const int* cnt = counts + static_cast<long long>(s) * V;
    const unsigned char* sn = seen + static_cast<long long>(s) * V;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x) {
        const int c = cnt[i];
        if (!sn[i] && c == 0) continue;
        float v = row[i];
        // each step rounded alone (no fused multiply-add), so the host twin repeats it bit for bit
        if (sn[i] && p.x != 1.f) v = v > 0.f ? __fdiv_rn(v, p.x) : __fmul_rn(v, p.x);
        if (c > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(p.z, static_cast<float>(c)), p.y));
        row[i] = v;
    }
}

// penalty_count: after a draw, the drawn token tokens[m] joins its sequence's output: counts[s, t] += 1 and
//   seen[s, t] = 1, s = slots[m] (each row its own slot). grid 1, one thread a row (block >= M).
extern "C" __global__ void penalty_count(const int* tokens, const int* slots, int M, int V, int* counts,
                                         unsigned char* seen)
{ ninfer_pdl_begin();
    const int m = threadIdx.x;
    if (m >= M) return;
    const int t = tokens[m];
    if (t < 0 || t >= V) return;
    const long long at = static_cast<long long>(slots[m]) * V + t;
    counts[at] += 1;
    seen[at] = 1;
}

// ------------------------------------------------------------------------------------------ masks

// mask_rows: out[m, i] = bit i of masks[slots[m], :] ? logits[m, i] : -inf for i < V (the host twin:
//   misc.mask_reference). masks: uint32 [S, words], bit (i & 31) of word i >> 5, words >= ceil(V / 32); a slot
//   whose row needs no mask holds every bit set. grid (ceil(V / 1024), M), block 256: four ids a thread, so the
//   8 threads of a word read it once each from L1 and the row's loads and stores stay coalesced.
extern "C" __global__ void __launch_bounds__(256) mask_rows(const float* logits, long long ld, int V,
                                                            const int* slots, const unsigned* masks, int words,
                                                            float* out, long long ldo)
{ ninfer_pdl_begin();
    const int m = blockIdx.y;
    const int i0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i0 >= V) return;
    const unsigned bits = masks[static_cast<long long>(slots[m]) * words + (i0 >> 5)] >> (i0 & 31);
    const float* row = logits + static_cast<long long>(m) * ld;
    float* dst = out + static_cast<long long>(m) * ldo;
#pragma unroll
    for (int q = 0; q < 4; ++q)
        if (i0 + q < V) dst[i0 + q] = (bits >> q) & 1u ? row[i0 + q] : -INFINITY;
}

// ------------------------------------------------------------------------------------------ sampling helpers

// Order-preserving uint32 of a logit: a > b as floats <=> key(a) > key(b). NaN maps to -inf; -0 to +0.
__device__ __forceinline__ uint32_t order_key(float x)
{
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) u = 0xff800000u;
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The 4 logits of float4 group g (entries 4g .. 4g+3); entries at or past V, and groups at or past gend, read 0.
__device__ __forceinline__ void load_group(const float* row, int V, bool vec, int g, int gend, float (&v)[4])
{
    const int i0 = g << 2;
    if (g < gend && vec && i0 + 4 <= V) {
        const float4 t = *reinterpret_cast<const float4*>(row + i0);
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = (g < gend && i0 + q < V) ? row[i0 + q] : 0.f;
    }
}

// h[bin] += 1 for every lane whose bin >= 0, one shared atomic per distinct bin in the warp (logits crowd into
// a few bins, and same-address atomics serialise). The whole warp must call it.
__device__ __forceinline__ void hist_add(int* h, int bin)
{
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (bin >= 0 && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[bin], __popc(peers));
}

// Histogram of the keys of groups [gbeg, gend) with (key & mmask) == mval, binned by (key >> shift) & bmask.
// Loop bounds are block-uniform so every lane reaches hist_add.
template <int U>
__device__ __forceinline__ void hist_pass(const float* row, int V, bool vec, int gbeg, int gend, int* h,
                                          uint32_t mmask, uint32_t mval, int shift, uint32_t bmask)
{
    for (int g0 = gbeg; g0 < gend; g0 += U * blockDim.x) {
        float v[U][4];
#pragma unroll
        for (int r = 0; r < U; ++r) load_group(row, V, vec, g0 + r * blockDim.x + threadIdx.x, gend, v[r]);
#pragma unroll
        for (int r = 0; r < U; ++r) {
            const int g = g0 + r * blockDim.x + threadIdx.x;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint32_t key = order_key(v[r][q]);
                const bool ok = g < gend && (g << 2) + q < V && (key & mmask) == mval;
                hist_add(h, ok ? static_cast<int>((key >> shift) & bmask) : -1);
            }
        }
    }
}

// Inclusive prefix sum over the block (blockDim.x a multiple of 32); total gets the block's sum.
// red: shared scratch of 33 entries.
template <typename T>
__device__ __forceinline__ T block_incl_scan(T v, T* red, T& total)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    T inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();  // red may still be read by an earlier call
    if (lane == 31) red[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        T s = lane < nw ? red[lane] : T(0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T n = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += n;
        }
        const T ex = __shfl_up_sync(0xffffffffu, s, 1);
        if (lane < nw) red[lane] = lane ? ex : T(0);
        if (lane == 31) red[32] = s;
    }
    __syncthreads();
    total = red[32];
    return red[warp] + inc;
}

__device__ __forceinline__ int block_min_int(int v, int* red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    int t = lane < nw ? red[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = min(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

// The bin holding the rank-th largest counted key (rank from 1): above(b) < rank <= above(b) + h[b], where
// above(b) counts the keys in bins > b. sel[0] = b, sel[1] = above(b). nb is a multiple of blockDim.x.
__device__ __forceinline__ void select_bin(const int* h, int nb, int rank, int* sel, int* red)
{
    const int per = nb / blockDim.x;
    const int top = nb - 1 - threadIdx.x * per;  // this thread owns bins top, top-1, ..., top-per+1
    int local = 0;
    for (int q = 0; q < per; ++q) local += h[top - q];
    int total;
    int above = block_incl_scan(local, red, total) - local;
    for (int q = 0; q < per; ++q) {
        const int c = h[top - q];
        if (above < rank && rank <= above + c) {
            sel[0] = top - q;
            sel[1] = above;
        }
        above += c;
    }
    __syncthreads();
}

// Philox4x32-10 (Salmon et al. 2011) of counter (step, 0) under key seed; 53 of its bits as u in [0, 1).
// Host twin: ninfer_rt.gpu.misc.sample_uniform.
__device__ __forceinline__ double philox_uniform(unsigned long long seed, unsigned long long step)
{
    uint32_t c0 = static_cast<uint32_t>(step), c1 = static_cast<uint32_t>(step >> 32), c2 = 0u, c3 = 0u;
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint32_t lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const uint32_t lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    const unsigned long long bits = (static_cast<unsigned long long>(c0) << 21) | (c1 >> 11);
    return static_cast<double>(bits) * 0x1.0p-53;
}

// K of a row: top_k capped at SAMPLE_CAND (0 = the cap), 1 when greedy, at most V.
__device__ __forceinline__ int sample_k(const SampleParams& p, int V)
{
    const bool greedy = !(p.temperature > 0.f);
    const int K = (p.top_k >= 1 && p.top_k <= SAMPLE_CAND) ? p.top_k : SAMPLE_CAND;
    return min(greedy ? 1 : K, V);
}

// Entry i of sample_compact's segments read as one list in index order: segment s holds entries start[s] ..
// start[s+1] - 1 of it (at ents + s·chunk). The largest s with start[s] <= i is never an empty segment.
__device__ __forceinline__ uint2 entry_at(const uint2* ents, const int* start, int nseg, int chunk, int i)
{
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return ents[static_cast<long long>(lo) * chunk + (i - start[lo])];
}

// hist_pass over the n entries of sample_compact's segments instead of the row: SAMPLE_THREADS of them at a time
// whatever segment they sit in (a loop over the segments waited for one L2 round trip each, ~31 a pass).
__device__ __forceinline__ void hist_pass_compact(const uint2* ents, const int* start, int nseg, int chunk, int n,
                                                  int* h, uint32_t mmask, uint32_t mval, int shift, uint32_t bmask)
{
    for (int j0 = 0; j0 < n; j0 += blockDim.x) {
        const int j = j0 + threadIdx.x;
        const uint32_t key = j < n ? entry_at(ents, start, nseg, chunk, j).x : 0u;
        const bool ok = j < n && (key & mmask) == mval;
        hist_add(h, ok ? static_cast<int>((key >> shift) & bmask) : -1);
    }
}

// ------------------------------------------------------------------------------------------ sampling kernels

// grid (nsplit, M), block 512: hist[m, b] += count of keys of logits[m, chunk slice] whose top 11 bits are b.
// hist [M, 2048] int32 must be zero beforehand (the wrapper memsets it); chunk is a multiple of 4.
extern "C" __global__ void __launch_bounds__(512) sample_hist(const float* logits, long long ld, int V, int chunk,
                                                              int* hist)
{ ninfer_pdl_begin();
    __shared__ int h[HIST_BINS];
    for (int i = threadIdx.x; i < HIST_BINS; i += blockDim.x) h[i] = 0;
    __syncthreads();
    const int m = blockIdx.y;
    const float* row = logits + static_cast<long long>(m) * ld;
    const bool vec = (reinterpret_cast<uintptr_t>(logits) & 15) == 0 && (ld & 3) == 0;
    const int c0 = blockIdx.x * chunk, c1 = min(V, c0 + chunk);
    hist_pass<4>(row, V, vec, c0 >> 2, (c1 + 3) >> 2, h, 0u, 0u, 21, HIST_BINS - 1);
    __syncthreads();
    int* out = hist + static_cast<long long>(m) * HIST_BINS;
    for (int i = threadIdx.x; i < HIST_BINS; i += blockDim.x)
        if (h[i]) atomicAdd(&out[i], h[i]);
}

// grid (nsplit, M), block 512, after sample_hist: block b copies the keys of logits[m, chunk slice] whose first digit
// is >= b1 (the digit holding the row's K-th largest key), as (key, index) in index order, to
// entries[m, b, 0 .. counts[m, b]); entries holds chunk slots per block.
extern "C" __global__ void __launch_bounds__(512) sample_compact(const float* logits, long long ld, int V, int chunk,
                                                                 const SampleParams* params, const int* hist,
                                                                 int* counts, uint2* entries)
{ ninfer_pdl_begin();
    __shared__ int h[HIST_BINS];
    __shared__ int red[33];
    __shared__ int sel[2];
    const int m = blockIdx.y, tid = threadIdx.x;
    for (int i = tid; i < HIST_BINS; i += blockDim.x) h[i] = hist[static_cast<long long>(m) * HIST_BINS + i];
    __syncthreads();
    select_bin(h, HIST_BINS, sample_k(params[m], V), sel, red);
    const uint32_t lo = static_cast<uint32_t>(sel[0]) << 21;  // keys >= lo: first digit >= b1
    const float* row = logits + static_cast<long long>(m) * ld;
    const bool vec = (reinterpret_cast<uintptr_t>(logits) & 15) == 0 && (ld & 3) == 0;
    const int c0 = blockIdx.x * chunk, c1 = min(V, c0 + chunk), gend = (c1 + 3) >> 2;
    uint2* seg = entries + (static_cast<long long>(m) * gridDim.x + blockIdx.x) * chunk;
    int base = 0;
    for (int g0 = c0 >> 2; g0 < gend; g0 += blockDim.x) {  // block-uniform bounds: every thread scans
        const int g = g0 + tid;
        float v[4];
        load_group(row, V, vec, g, gend, v);
        uint32_t key[4];
        int n = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            key[q] = order_key(v[q]);
            n += g < gend && (g << 2) + q < V && key[q] >= lo;
        }
        int tot;
        int at = base + block_incl_scan(n, red, tot) - n;
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (g < gend && (g << 2) + q < V && key[q] >= lo) seg[at++] = make_uint2(key[q], (g << 2) + q);
        base += tot;
    }
    if (tid == 0) counts[static_cast<long long>(m) * gridDim.x + blockIdx.x] = base;
}

// grid M, block SAMPLE_THREADS. hist: sample_hist's output; counts, entries: sample_compact's (nseg segments of
// chunk slots). tokens int32 [M] (or null): the drawn ids.
// probs fp32 [M, V] (or null): the final kept probabilities, zero for every dropped token. support (with probs, or
// null): row m's L kept tokens as [L, id_0, bits(p_0), ..] at m·(1 + 2·SAMPLE_CAND), the same fp32 values as probs,
// so that a host reads the few kept tokens (speculative decoding's draws) and not the whole row.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
sample_rows(int V, const SampleParams* params, const int* hist, const int* counts, const uint2* entries, int nseg,
            int chunk, int* tokens, float* probs, int* support)
{ ninfer_pdl_begin();
    __shared__ int h[HIST_BINS];
    __shared__ unsigned long long cand[SAMPLE_CAND];  // (~key << 32) | index: ascending = logit desc, index asc
    __shared__ double cdf[SAMPLE_CAND];
    __shared__ double redd[33];
    __shared__ int redi[33];
    __shared__ int sel[2];
    __shared__ int start[MAX_SEGMENTS + 1];  // segment s: entries start[s] .. start[s+1] - 1 of the list
    const int m = blockIdx.x, tid = threadIdx.x;
    const SampleParams p = params[m];
    const bool greedy = !(p.temperature > 0.f);
    const int K = sample_k(p, V);
    const uint2* ents = entries + static_cast<long long>(m) * nseg * chunk;
    int n_ent;  // entries in all segments
    {
        const int c = tid < nseg ? counts[static_cast<long long>(m) * nseg + tid] : 0;  // nseg <= SAMPLE_THREADS
        const int incl = block_incl_scan(c, redi, n_ent);
        if (tid < nseg) start[tid + 1] = incl;
        if (tid == 0) start[0] = 0;
    }

    // Radix select of the K-th largest key t. Digit 1 (bits 31..21) from sample_hist.
    for (int i = tid; i < HIST_BINS; i += SAMPLE_THREADS) h[i] = hist[static_cast<long long>(m) * HIST_BINS + i];
    __syncthreads();
    select_bin(h, HIST_BINS, K, sel, redi);
    const uint32_t b1 = sel[0];
    int G = sel[1];  // keys above the current prefix: count of keys > t once all digits are fixed
    int rank = K - sel[1];
    // Digit 2 (bits 20..10) among keys whose digit 1 is b1.
    for (int i = tid; i < HIST_BINS; i += SAMPLE_THREADS) h[i] = 0;
    __syncthreads();
    hist_pass_compact(ents, start, nseg, chunk, n_ent, h, 0xffe00000u, b1 << 21, 10, 2047u);
    __syncthreads();
    select_bin(h, HIST_BINS, rank, sel, redi);
    const uint32_t b2 = sel[0];
    G += sel[1];
    rank -= sel[1];
    // Digit 3 (bits 9..0) among keys whose digits 1-2 are b1, b2.
    for (int i = tid; i < HIST_BINS; i += SAMPLE_THREADS) h[i] = 0;
    __syncthreads();
    const uint32_t pre = (b1 << 21) | (b2 << 10);
    hist_pass_compact(ents, start, nseg, chunk, n_ent, h, 0xfffffc00u, pre, 0, 1023u);
    __syncthreads();
    select_bin(h, 1024, rank, sel, redi);
    const uint32_t t = pre | static_cast<uint32_t>(sel[0]);
    G += sel[1];                              // G < K <= SAMPLE_CAND keys are > t
    const int N = min(G + h[sel[0]], SAMPLE_CAND);  // candidates: those, then ties with t in index order

    // Gather, in index order (the segments' list): keys > t to slots [0, G), ties to slots [G, N). One block scan
    // per step of SAMPLE_THREADS entries gives each its slot; both counts travel packed in one int.
    for (int i = tid; i < SAMPLE_CAND; i += SAMPLE_THREADS) cand[i] = ~0ull;
    int base_gt = 0, base_eq = 0;
    for (int j0 = 0; j0 < n_ent && !(base_gt >= G && G + base_eq >= N); j0 += SAMPLE_THREADS) {  // block-uniform
        const int j = j0 + tid;
        const uint2 en = j < n_ent ? entry_at(ents, start, nseg, chunk, j) : make_uint2(0u, 0u);
        const bool gt = j < n_ent && en.x > t, eq = j < n_ent && en.x == t;
        const int packed = static_cast<int>(gt) | (static_cast<int>(eq) << 16);
        int tot;
        const int ex = block_incl_scan(packed, redi, tot) - packed;
        const unsigned long long c = (static_cast<unsigned long long>(~en.x) << 32) | en.y;
        if (gt && base_gt + (ex & 0xffff) < SAMPLE_CAND) cand[base_gt + (ex & 0xffff)] = c;
        if (eq && G + base_eq + (ex >> 16) < SAMPLE_CAND) cand[G + base_eq + (ex >> 16)] = c;
        base_gt += tot & 0xffff;
        base_eq += tot >> 16;
    }
    __syncthreads();

    // Bitonic sort of the first n2 >= N slots, ascending (the rest hold ~0, which sorts last already).
    int n2 = 2;
    while (n2 < N) n2 <<= 1;
    for (int k = 2; k <= n2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            const int l = tid ^ j;
            if (l > tid && l < n2) {
                const unsigned long long a = cand[tid], b = cand[l];
                if ((a > b) == ((tid & k) == 0)) {
                    cand[tid] = b;
                    cand[l] = a;
                }
            }
            __syncthreads();
        }
    }

    // Thread j holds the j-th candidate. Probabilities in fp64 like the reference: e_j = exp((x_j - x_0) / T).
    const unsigned long long c = cand[tid];
    const bool valid = tid < N;
    const int idx = static_cast<int>(static_cast<uint32_t>(c));
    const float x = key_value(~static_cast<uint32_t>(c >> 32));
    const float x0 = key_value(~static_cast<uint32_t>(cand[0] >> 32));
    // An infinite top logit (+inf, or a row of -inf/NaN) has no softmax: take the first candidate.
    const bool single = greedy || (__float_as_uint(x0) & 0x7fffffffu) == 0x7f800000u;
    double e = 0.0;
    if (valid) e = single ? (tid == 0 ? 1.0 : 0.0) : exp((static_cast<double>(x) - x0) / p.temperature);
    double S;
    block_incl_scan(e, redd, S);
    const double pr = e / S;
    double total;
    const double C = block_incl_scan(pr, redd, total);  // C_j - pr_j: the mass above token j (top-p)
    cdf[tid] = C;
    const bool keep = valid && e > 0.0 && (p.top_p >= 1.f || C - pr < static_cast<double>(p.top_p)) &&
                      (p.min_p <= 0.f || e >= static_cast<double>(p.min_p));
    // Kept tokens form a prefix (top-p and min-p each keep a head of the sorted list): its length L.
    int L = block_min_int(keep ? SAMPLE_CAND : tid, redi);
    L = single ? 1 : max(L, 1);
    const double W = cdf[L - 1];

    if (tokens) {
        const double r = philox_uniform(p.seed, p.step) * W;
        int win = block_min_int((tid < L && C > r) ? tid : SAMPLE_CAND, redi);
        if (win >= L) win = L - 1;  // r rounded up to W
        if (tid == 0) tokens[m] = static_cast<int>(static_cast<uint32_t>(cand[win]));
    }
    if (probs) {
        float* out = probs + static_cast<long long>(m) * V;
        for (int i = tid; i < V; i += SAMPLE_THREADS) out[i] = 0.f;
        __syncthreads();
        const float q = static_cast<float>(pr / W);
        if (tid < L) out[idx] = q;
        if (support) {
            int* sup = support + static_cast<long long>(m) * (1 + 2 * SAMPLE_CAND);
            if (tid == 0) sup[0] = L;
            if (tid < L) {
                sup[1 + 2 * tid] = idx;
                sup[2 + 2 * tid] = __float_as_int(q);
            }
        }
    }
}
