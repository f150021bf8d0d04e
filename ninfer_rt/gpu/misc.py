"""Launch wrappers for the small op families: RMSNorm and the bf16 cast (kernels/norm.cu), arg-max and
sampling (kernels/sampling.cu), log-probabilities (kernels/logprobs.cu).

Each wrapper takes the loaded Kernels first, then device pointers (ints) and sizes by keyword, validates the
sizes (GpuError, one line), computes the launch shape and launches on `stream` (the context's stream if None).

Sampling semantics (kernels/sampling.cu says how): the distribution of ninfer_rt.sampling.Sampler.distribution
without penalties (temperature -> top-k -> top-p -> min-p), except that candidates are capped at
SAMPLE_MAX_CANDIDATES = 1024: top_k = 0 or top_k > 1024 behaves as top_k = 1024. Ties with the k-th logit are
kept, as HF does, unless they overflow the cap (then the lowest indices win). Temperature <= 0 is greedy.
The draw is u = sample_uniform(seed, step) (Philox4x32-10), mapped through the inverse CDF of the kept tokens
ordered by (logit desc, index asc). The row does not enter the RNG, so a request's tokens do not depend on
which batch row it sits in; give each request its own seed.
"""

from __future__ import annotations

import numpy as np

from ninfer_rt.formats import round_up
from ninfer_rt.gpu.driver import GpuError, f32, i32, i64, ptr
from ninfer_rt.logprobs import TokenLogprob

SAMPLE_MAX_CANDIDATES = 1024
ARGMAX_MAX_SPLIT = 256      # partial results per row in the argmax scratch
_ARGMAX_CHUNK = 2048        # entries per argmax block (256 threads × 2 float4)
_HIST_BINS = 2048           # first radix digit of the sampler's select
_HIST_CHUNK = 8192          # entries per sample_hist / sample_compact block (512 threads × 4 float4)
_MAX_SEGMENTS = 256         # sampling.cu MAX_SEGMENTS: sample_compact blocks per row
_MAX_V = 1 << 30            # keeps 4 × (float4 group index) inside int32 in the kernels

# One record per row of `sample`'s params array; layout = struct SampleParams in kernels/sampling.cu.
SAMPLE_PARAMS = np.dtype({
    "names": ["temperature", "top_k", "top_p", "min_p", "seed", "step"],
    "formats": [np.float32, np.int32, np.float32, np.float32, np.uint64, np.uint64],
    "offsets": [0, 4, 8, 12, 16, 24],
    "itemsize": 32,
})


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise GpuError(what)


def _rows(name: str, M: int, V: int, ld: int) -> None:
    _need(0 <= M <= 65535, f"{name}: M={M} must be in [0, 65535]")
    _need(1 <= V <= _MAX_V, f"{name}: V={V} must be in [1, 2^30]")
    _need(ld >= V, f"{name}: row stride ld={ld} is smaller than V={V}")


# ------------------------------------------------------------------------------------------ RMSNorm

def _row_strides(name: str, M: int, D: int, ldx: int | None, ldy: int | None) -> tuple[int, int]:
    """Checked sizes of a row-wise op on M rows of D elements; the strides default to D."""
    ldx = D if ldx is None else ldx
    ldy = D if ldy is None else ldy
    _need(M >= 0 and 1 <= D < 2**31, f"{name}: bad size M={M}, D={D}")
    _need(ldx >= D and ldy >= D, f"{name}: row strides ldx={ldx}, ldy={ldy} must be >= D={D}")
    return ldx, ldy


def _row_block(D: int) -> int:
    """Threads of a block that takes a whole row (kernels/norm.cu; argmax_rows when a row is one slice): one float4
    of the row each, in whole warps, at most 1024."""
    return min(1024, round_up((D + 3) // 4, 32))


def rms_norm(k, *, x: int, y: int, M: int, D: int, w: int, eps: float,
             ldx: int | None = None, ldy: int | None = None, out: str = "f32", stream=None) -> None:
    """y[m] = x[m] · rsqrt(mean(x[m]²) + eps) · (1 + w) for m < M (ops.rms_norm_zc in fp32).

    x [M, D] fp32 with row stride ldx (default D), w [D] fp32; y [M, D] with row stride ldy (default D),
    fp32 (out="f32") or rounded to bf16 (out="bf16": the prefill GEMMs' input). y may be x (in place, fp32)
    when the strides are equal.
    """
    _need(out in ("f32", "bf16"), f"rms_norm: out={out!r} must be 'f32' or 'bf16'")
    ldx, ldy = _row_strides("rms_norm", M, D, ldx, ldy)
    _need(bool(x and y and w), "rms_norm: x, y and w must be device pointers")
    _need(x != y or (ldx == ldy and out == "f32"), f"rms_norm: in place needs fp32 out and ldx == ldy "
                                                   f"(got {out}, {ldx}, {ldy})")
    if M == 0:
        return
    k.launch("rms_norm" if out == "f32" else "rms_norm_bf16", M, _row_block(D),
             [ptr(x), ptr(y), ptr(w), i32(D), i64(ldx), i64(ldy), f32(eps)], 0, stream)


def cast_bf16(k, *, x: int, y: int, M: int, D: int, ldx: int | None = None, ldy: int | None = None,
              stream=None) -> None:
    """y[m, :D] = x[m, :D] rounded to bf16 (nearest even; torch's .to(bfloat16)) for m < M.

    x [M, D] fp32 with row stride ldx (default D); y [M, D] bf16 with row stride ldy (default D); no overlap.
    """
    ldx, ldy = _row_strides("cast_bf16", M, D, ldx, ldy)
    _need(bool(x and y), "cast_bf16: x and y must be device pointers")
    if M == 0:
        return
    k.launch("cast_bf16", M, _row_block(D), [ptr(x), ptr(y), i32(D), i64(ldx), i64(ldy)], 0, stream)


# ------------------------------------------------------------------------------------------ arg-max

def argmax_scratch_bytes(M: int) -> int:
    """Bytes of device scratch `argmax` needs for M rows (a best value and index per row slice)."""
    return max(1, M) * ARGMAX_MAX_SPLIT * 8


def _argmax_split(V: int) -> tuple[int, int]:
    """(chunk, nsplit): row slices of `chunk` entries (a multiple of 4), at most ARGMAX_MAX_SPLIT of them."""
    nsplit = min(ARGMAX_MAX_SPLIT, -(-V // _ARGMAX_CHUNK))
    chunk = round_up(-(-V // nsplit), 4)
    return chunk, -(-V // chunk)


def argmax(k, *, logits: int, ld: int, M: int, V: int, out: int, scratch: int = 0, stream=None) -> None:
    """out int32 [M] = index of the largest of logits[m, :V] (fp32, row stride ld).

    Ties go to the lowest index (torch.argmax); NaN ranks as -inf, so it never wins over a number (a row of
    NaN/-inf only gives 0). With scratch (argmax_scratch_bytes(M) bytes) each row is split over many blocks and
    a second launch reduces the slices; without it one block scans each row.
    """
    _rows("argmax", M, V, ld)
    _need(bool(logits and out), "argmax: logits and out must be device pointers")
    if M == 0:
        return
    if scratch:
        chunk, nsplit = _argmax_split(V)
    else:
        chunk, nsplit = V, 1
    part_v = scratch
    part_i = scratch + M * ARGMAX_MAX_SPLIT * 4 if scratch else 0
    block = 256 if nsplit > 1 else _row_block(V)
    k.launch("argmax_rows", (nsplit, M), block,
             [ptr(logits), i64(ld), i32(V), i32(chunk), ptr(part_v), ptr(part_i), ptr(out)], 0, stream)
    if nsplit > 1:
        k.launch("argmax_finish", M, 32, [ptr(part_v), ptr(part_i), i32(nsplit), ptr(out)], 0, stream)


# ------------------------------------------------------------------------------------------ sampling

def sample_params(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  seed: int = 0, step: int = 0) -> np.ndarray:
    """One SAMPLE_PARAMS record (np.concatenate one per row, then upload).

    temperature >= 0 (0 = greedy), top_k >= 0 (0 = off, capped at 1024), top_p in (0, 1] (1 = off),
    min_p in [0, 1] (0 = off), seed and step in [0, 2^64): step is the token's index, so each step draws anew.
    """
    _need(np.isfinite(temperature) and temperature >= 0, f"sample_params: temperature={temperature} must be >= 0")
    _need(int(top_k) == top_k and top_k >= 0, f"sample_params: top_k={top_k} must be an integer >= 0")
    _need(0 < top_p <= 1, f"sample_params: top_p={top_p} must be in (0, 1]")
    _need(0 <= min_p <= 1, f"sample_params: min_p={min_p} must be in [0, 1]")
    _need(0 <= seed < 2**64 and 0 <= step < 2**64, f"sample_params: seed={seed}, step={step} must be in [0, 2^64)")
    rec = np.zeros(1, SAMPLE_PARAMS)
    rec[0] = (temperature, min(int(top_k), 2**31 - 1), top_p, min_p, seed, step)
    return rec


def _segments(V: int) -> int:
    """sample_hist / sample_compact blocks per row of V logits."""
    return -(-int(V) // _HIST_CHUNK)


def sample_scratch_bytes(M: int, V: int) -> int:
    """Bytes of device scratch `sample` / `sample_probs` need for M rows of V logits: per row a 2048-bin histogram,
    then sample_compact's segment counts and (key, index) slots for every entry of the row, 8-byte aligned."""
    nseg = _segments(V)
    return max(1, M) * (_HIST_BINS * 4 + round_up(nseg * 4, 8) + nseg * _HIST_CHUNK * 8)


def _sample(name: str, k, logits: int, ld: int, M: int, V: int, params: int, scratch: int,
            tokens: int, probs: int, stream, support: int = 0) -> None:
    _rows(name, M, V, ld)
    _need(bool(logits and params and scratch), f"{name}: logits, params and scratch must be device pointers")
    nseg = _segments(V)
    _need(nseg <= _MAX_SEGMENTS, f"{name}: V={V} exceeds the sampler's {_MAX_SEGMENTS * _HIST_CHUNK} entries")
    if M == 0:
        return
    hist = scratch
    counts = hist + M * _HIST_BINS * 4
    entries = counts + round_up(M * nseg * 4, 8)
    k.gpu.memset(hist, 0, M * _HIST_BINS * 4, stream)  # sample_hist accumulates into it
    k.launch("sample_hist", (nseg, M), 512, [ptr(logits), i64(ld), i32(V), i32(_HIST_CHUNK), ptr(hist)], 0, stream)
    k.launch("sample_compact", (nseg, M), 512, [ptr(logits), i64(ld), i32(V), i32(_HIST_CHUNK), ptr(params),
                                                ptr(hist), ptr(counts), ptr(entries)], 0, stream)
    k.launch("sample_rows", M, 1024, [i32(V), ptr(params), ptr(hist), ptr(counts), ptr(entries), i32(nseg),
                                      i32(_HIST_CHUNK), ptr(tokens), ptr(probs), ptr(support)], 0, stream)


def sample(k, *, logits: int, ld: int, M: int, V: int, params: int, out: int, scratch: int, stream=None) -> None:
    """out int32 [M]: one token per row drawn from logits[m, :V] (fp32, row stride ld) under params[m]
    (a device array of M SAMPLE_PARAMS records). scratch: sample_scratch_bytes(M, V) bytes."""
    _need(bool(out), "sample: out must be a device pointer")
    _sample("sample", k, logits, ld, M, V, params, scratch, out, 0, stream)


def sample_probs(k, *, logits: int, ld: int, M: int, V: int, params: int, out: int, scratch: int,
                 stream=None, support: int = 0) -> None:
    """out fp32 [M, V] (row stride V): the final probabilities `sample` draws from, 0 for dropped tokens.
    support (optional): int32 [M, SUPPORT_INTS], each row's kept tokens alone (split_support reads one)."""
    _need(bool(out), "sample_probs: out must be a device pointer")
    _sample("sample_probs", k, logits, ld, M, V, params, scratch, 0, out, stream, support)


# ------------------------------------------------------------------------------------------ penalties

PENALTY_PARAMS = np.dtype([("repetition", np.float32), ("presence", np.float32), ("frequency", np.float32),
                           ("pad", np.float32)])  # one a slot: penalize_rows' float4


def penalty_params(repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    """One PENALTY_PARAMS record (the defaults leave a row as it is)."""
    rec = np.zeros(1, PENALTY_PARAMS)
    rec[0] = (repetition, presence, frequency, 0.0)
    return rec


def penalty_state(history, prompt_len: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """(counts int32 [V], seen uint8 [V]) of a sequence: each id's count in the output history[prompt_len:], and
    whether it is anywhere in history (what penalize_rows reads for its slot, and penalty_count keeps)."""
    h = np.asarray(history, np.int64)
    counts = np.bincount(h[prompt_len:], minlength=V)[:V].astype(np.int32)
    seen = (np.bincount(h, minlength=V)[:V] > 0).astype(np.uint8)
    return counts, seen


def penalize(k, *, logits: int, ld: int, M: int, V: int, slots: int, params: int, counts: int, seen: int,
             stream=None) -> None:
    """penalize_rows: logits[m, :V] (fp32, row stride ld) in place under the penalties of slot slots[m] (int32
    [M]): params PENALTY_PARAMS [S], counts int32 [S, V], seen uint8 [S, V] (penalize_reference is its twin)."""
    _rows("penalize", M, V, ld)
    _need(bool(logits and slots and params and counts and seen), "penalize: every array must be a device pointer")
    if M:
        k.launch("penalize_rows", (min(64, -(-V // 256)), M), 256,
                 [ptr(logits), i64(ld), i32(V), ptr(slots), ptr(params), ptr(counts), ptr(seen)], 0, stream)


def penalty_count(k, *, tokens: int, slots: int, M: int, V: int, counts: int, seen: int, stream=None) -> None:
    """penalty_count: each row's drawn token tokens[m] counted in its slot slots[m]'s output (counts, seen)."""
    _need(0 <= M <= 1024, f"penalty_count: M={M} must be in [0, 1024]")
    if M:
        k.launch("penalty_count", 1, round_up(M, 32), [ptr(tokens), ptr(slots), i32(M), i32(V), ptr(counts),
                                                       ptr(seen)], 0, stream)


def penalize_reference(logits: np.ndarray, V: int, slots, params: np.ndarray, counts: np.ndarray,
                       seen: np.ndarray) -> np.ndarray:
    """penalize_rows on the host, fp32 step by step as the kernel rounds: a penalized copy of logits [M, ld]."""
    out = np.array(logits, np.float32)
    for m, s in enumerate(slots):
        r, pres, freq = (np.float32(params[s][f]) for f in ("repetition", "presence", "frequency"))
        if r == 1 and pres == 0 and freq == 0:
            continue
        v = out[m, :V]
        sn, c = seen[s, :V].astype(bool), counts[s, :V]
        if r != 1:
            v[sn] = np.where(v[sn] > 0, v[sn] / r, v[sn] * r)
        hit = c > 0
        v[hit] = v[hit] - (freq * c[hit].astype(np.float32) + pres)
    return out


# ------------------------------------------------------------------------------------------ masks

def mask_words(V: int) -> int:
    """uint32 words of a slot's mask over ids < V (bit i & 31 of word i >> 5)."""
    return -(-V // 32)


def mask_rows(k, *, logits: int, ld: int, M: int, V: int, slots: int, masks: int, words: int, out: int,
              ldo: int, stream=None) -> None:
    """mask_rows: out[m, :V] (fp32, row stride ldo) = logits[m, :V] (row stride ld) where slot slots[m]'s mask
    (masks uint32 [S, words]) has the id's bit, else -inf (mask_reference is its twin)."""
    _rows("mask_rows", M, V, ld)
    _need(ldo >= V and words >= mask_words(V), f"mask_rows: ldo={ldo} or words={words} too small for V={V}")
    _need(bool(logits and slots and masks and out), "mask_rows: every array must be a device pointer")
    if M:
        k.launch("mask_rows", (-(-V // 1024), M), 256,
                 [ptr(logits), i64(ld), i32(V), ptr(slots), ptr(masks), i32(words), ptr(out), i64(ldo)], 0, stream)


def mask_reference(logits: np.ndarray, V: int, slots, masks: np.ndarray) -> np.ndarray:
    """mask_rows on the host: logits [M, >= V] fp32, masks uint32 [S, words] -> the masked copy [M, V]."""
    bits = np.unpackbits(np.ascontiguousarray(masks, "<u4").view(np.uint8), axis=1, bitorder="little")
    keep = bits[np.asarray(slots, np.int64), :V].astype(bool)
    return np.where(keep, np.asarray(logits, np.float32)[:, :V], np.float32(-np.inf))


# ------------------------------------------------------------------------------------------ log-probabilities

LP_TOP = 20                 # logprobs.cu LP_TOP: alternatives a record lists (logprobs.MAX_TOP_LOGPROBS)
LP_INTS = 4 + 2 * LP_TOP    # a row's record: lse (fp64), the token's logit, n, n (id, logit) pairs
LP_PART_BYTES = 176         # logprobs.cu struct LpPart: one block's slice of a row
_LP_CHUNK = 4096            # logprobs.cu LP_CHUNK: ids a logprob_rows block takes
_LP_MAX_SPLIT = 256         # logprobs.cu LP_MAX_SPLIT


def logprob_scratch_bytes(M: int, V: int) -> int:
    """Bytes of the LpPart records logprob_rows leaves for logprob_finish, M rows of V."""
    return max(1, M) * -(-V // _LP_CHUNK) * LP_PART_BYTES


def logprob_rows(k, *, logits: int, ld: int, M: int, V: int, tops: int, scratch: int, raw: int = 0,
                 stream=None) -> None:
    """The first half of each row's logprobs (logprobs.cu): its slices' max, Σ exp and top tops[m] (int32 [M]; -1:
    the row is skipped) into scratch (logprob_scratch_bytes(M, V)). raw (fp32 [M, ld], optional): the rows copied
    there, for logprob_finish to read the drawn tokens' logits after a penalty has changed the rows."""
    _rows("logprob_rows", M, V, ld)
    nsplit = -(-V // _LP_CHUNK)
    _need(nsplit <= _LP_MAX_SPLIT, f"logprob_rows: V={V} is over {_LP_MAX_SPLIT * _LP_CHUNK} ids")
    _need(bool(logits and tops and scratch), "logprob_rows: logits, tops and scratch must be device pointers")
    if M:
        k.launch("logprob_rows", (nsplit, M), 256, [ptr(logits), i64(ld), i32(V), ptr(tops), ptr(raw),
                                                     ptr(scratch)], 0, stream)


def logprob_finish(k, *, tokens: int, src: int, ld: int, M: int, V: int, tops: int, scratch: int, out: int,
                   stream=None) -> None:
    """out int32 [M, LP_INTS]: each row's record (logprob_record reads one) from logprob_rows's scratch and the
    drawn tokens (int32 [M]), whose logits come from src (the logits, or logprob_rows's raw copy; row stride ld)."""
    _rows("logprob_finish", M, V, ld)
    _need(bool(tokens and src and tops and scratch and out), "logprob_finish: every array must be a device pointer")
    if M:
        k.launch("logprob_finish", M, 64, [ptr(tokens), ptr(src), i64(ld), i32(V), ptr(tops), ptr(scratch),
                                           i32(-(-V // _LP_CHUNK)), ptr(out)], 0, stream)


def logprob_record(rec: np.ndarray, token: int) -> TokenLogprob:
    """One row's record (int32 [LP_INTS]) as the host's TokenLogprob: each logit minus lse in float64, as
    logprobs.token_logprob reports them."""
    lse = float(rec[:2].view(np.float64)[0])
    n = int(rec[3])
    if not 0 <= n <= LP_TOP:
        raise GpuError(f"logprobs: a record of {n} alternatives (at most {LP_TOP})")
    pairs = rec[4:4 + 2 * n].reshape(n, 2)
    vals = pairs[:, 1].view(np.float32)
    top = tuple((int(i), float(v) - lse) for i, v in zip(pairs[:, 0], vals))
    return TokenLogprob(int(token), float(rec[2:3].view(np.float32)[0]) - lse, top)


SUPPORT_INTS = 1 + 2 * SAMPLE_MAX_CANDIDATES  # a support row: the count L, then L (id, fp32 bits) pairs


def split_support(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A support row (int32 [SUPPORT_INTS], as sample_probs wrote it) -> (ids int64 ascending, their probabilities
    float64): the entries of the probs row that are > 0, as np.flatnonzero would find them."""
    n = int(row[0])
    if not 0 <= n <= SAMPLE_MAX_CANDIDATES:
        raise GpuError(f"support: a count of {n} kept tokens (at most {SAMPLE_MAX_CANDIDATES})")
    pairs = row[1:1 + 2 * n].reshape(n, 2)
    ids, probs = pairs[:, 0].astype(np.int64), pairs[:, 1].view(np.float32).astype(np.float64)
    order = np.argsort(ids, kind="stable")
    ids, probs = ids[order], probs[order]
    keep = probs > 0  # a kept token's probability can round to 0 in fp32; the probs row has no entry for it
    return ids[keep], probs[keep]


# ------------------------------------------------------------------------------------------ the RNG's host twin

_M32 = 0xFFFFFFFF


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., SC 2011; Random123's philox4x32 with 10 rounds) on Python ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
    return c0, c1, c2, c3


def sample_uniform(seed: int, step: int) -> float:
    """The u in [0, 1) the sampling kernel draws for (seed, step): 53 bits of Philox4x32-10, counter (step, 0),
    key seed."""
    o = philox4x32_10((step & _M32, step >> 32, 0, 0), (seed & _M32, seed >> 32))
    return ((o[0] << 21) | (o[1] >> 11)) * 2.0**-53
