"""Time split-KV attention decode at 35B dims: `python bench/attention_bench.py [--json PATH] [--quick]`.

B = 1, nH = 16, nKV = 2, d = 256; T new tokens (1 = decode, 2..8 = MTP verify) at contexts 8K / 64K / 256K, bf16
and int8 caches filled with a valid constant. Each number is the mean of CUDA-graph replays of 20 captured
launches (host launch overhead excluded, as in the engine's decode graphs). The 20 launches rotate over 8 cache
slots, so at 8K the KV of a launch is not in L2 from the one before (8 slots x 8.4 MB int8 > 50 MB), like a real
decode step where the other layers' weights pass through L2 in between.

For each point: the path decode takes (fast: attention_decode.cu, CUDA cores; mma: attention.cu, tensor cores)
and, for comparison, the other path forced through attention._FAST_MAX_ROWS; per path the whole decode (partials +
combine), the partials kernel alone and the combine alone, the KV read bandwidth of the whole decode, and the
floor 2 us + KV bytes / 4.2 TB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import replay_ms  # noqa: E402

from ninfer_rt.errors import NinferError  # noqa: E402

N_LAUNCH = 20     # launches captured per graph
N_REPLAY = 5      # graph replays timed
N_SLOTS = 8       # cache slots the launches rotate over


def main() -> None:
    from ninfer_rt.gpu import attention
    from ninfer_rt.gpu.driver import Gpu
    from ninfer_rt.gpu.kernels import Kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="T = 1 and 8, int8 only")
    args = ap.parse_args()
    gpu = Gpu(0)
    k = Kernels(gpu)
    nH, nKV, d, S = 16, 2, 256, 262144
    Ts = (1, 8) if args.quick else (1, 2, 4, 8)
    dtypes = ("int8",) if args.quick else ("int8", "bf16")
    fast_max = attention._FAST_MAX_ROWS
    G = nH // nKV
    rows = []

    def timed(launches) -> float:
        """us per launch group: a graph of N_LAUNCH groups, replayed N_REPLAY times after a warm-up replay."""
        def capture():
            for group in launches:
                for fn, grid, block, a, smem in group:
                    k.launch(fn, grid, block, a, smem=smem)

        gpu.synchronize()
        ms = replay_ms(gpu, capture, rounds=1, replays=N_REPLAY, warmup=1, eager=False)[0]
        return ms * 1000 / len(launches)

    slots = []
    for i in range(N_SLOTS):
        p = gpu.alloc(4)
        gpu.upload(p, np.array([i], np.int32))
        slots.append(p)
    for dtype in dtypes:
        n = attention.KVCache.nbytes(N_SLOTS, S, nKV, d, dtype)
        base = gpu.alloc(n)
        gpu.memset(base, 0x3F, n)  # bf16 0x3F3F = 0.746, int8 code 63, fp32 scale 0x3F3F3F3F = 0.747
        cache = attention.KVCache.at(base, N_SLOTS, S, nKV, d, dtype)
        for T in Ts:
            q, gate, out = (gpu.alloc(T * nH * d * 4) for _ in range(3))
            for p in (q, gate):
                gpu.memset(p, 0x3C, T * nH * d * 4)
            scratch = gpu.alloc(attention.decode_scratch_bytes(T, nH, d, S))
            pos = gpu.alloc(4)
            for ctx in (8192, 65536, 262144):
                gpu.upload(pos, np.array([ctx - T], np.int32))
                gpu.synchronize()
                kv = ctx * nKV * (2 * d * (2 if dtype == "bf16" else 1) + (8 if dtype == "int8" else 0))
                floor = 2.0 + kv / 4.2e6
                taken = "fast" if T * G <= fast_max else "mma"
                for path in (taken, "mma" if taken == "fast" else "fast"):
                    attention._FAST_MAX_ROWS = fast_max if path == taken else (64 if path == "fast" else 0)
                    try:
                        groups = [attention._decode_launches(
                            k, q=q, gate=gate, ld_gate=nH * d, pos=pos, slot=slots[i % N_SLOTS], B=1, T=T, nH=nH,
                            cache=cache, out=out, scratch=scratch, ctx_bucket=ctx) for i in range(N_LAUNCH)]
                    finally:
                        attention._FAST_MAX_ROWS = fast_max
                    if path == "fast" and not groups[0][0][0].startswith("attn_decode_fast"):
                        continue  # this GPU lacks the shared memory of the fast path
                    total = timed(groups)
                    part = timed([g[:1] for g in groups])
                    comb = timed([g[1:] for g in groups])
                    row = {"dtype": dtype, "T": T, "context": ctx, "path": path, "default": path == taken,
                           "us": total, "partials_us": part, "combine_us": comb, "tbs": kv / total / 1e6,
                           "floor_us": floor}
                    rows.append(row)
                    print(f"{dtype} T={T} ctx={ctx:6d} {path:4s}{'*' if path == taken else ' '}: {total:7.1f} us "
                          f"(partials {part:7.1f}, combine {comb:5.1f}), {kv / total / 1e6:5.2f} TB/s of KV, "
                          f"floor {floor:6.1f} us", flush=True)
            for p in (q, gate, out, scratch, pos):
                gpu.free(p)
        gpu.free(base)
    print("* = the path attention.decode takes")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    try:
        main()
    except NinferError as e:
        sys.exit(f"error: {e}")
