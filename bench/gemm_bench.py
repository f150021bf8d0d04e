"""Prefill GEMM throughput (ninfer_rt.gpu.gemm.gemm) on the Qwen3.6-35B-A3B shapes, timed with driver events.

    python bench/gemm_bench.py [--json PATH] [--formats q8g32,q4g64] [--M 512,2048,8192] [--reps 20]

For each format, weight shape [N, K] and M rows: `reps` back-to-back launches between two events, after a
warm-up, median of 3 rounds; TFLOP/s = 2·M·N·K / time. Weights are random valid codes and scales. Prints a
table (and writes JSON with --json); without a GPU it exits with one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer_rt.formats import get_format, round_up, K_ALIGN  # noqa: E402
from ninfer_rt.gpu.driver import Event, Gpu, GpuError  # noqa: E402

SHAPES = {"qkvg [9216, 2048]": (9216, 2048), "o_proj [2048, 4096]": (2048, 4096)}
FORMATS = ("q8g32", "q4g64", "q5g64", "q6g64", "bf16")


def random_weight(fmt: str, shape, rng) -> np.ndarray:
    """The bytes of a random [N, K] tensor in `fmt` (codes uniform over the range, scales ~ 1/offset)."""
    f = get_format(fmt)
    if not f.is_quantized:
        return f.encode(rng.standard_normal(shape, dtype=np.float32) * 0.05)
    n, k = shape
    kp = round_up(k, K_ALIGN)
    q = np.zeros((n, kp), np.int8)
    q[:, :k] = rng.integers(f.qmin, f.qmax + 1, size=(n, k), dtype=np.int8)
    sc = (rng.uniform(0.5, 1.5, size=(n, kp // f.group)) / f.offset).astype(np.float16)
    return f.pack(q, sc)


def time_gemm(gpu, k, w, M: int, reps: int) -> float:
    """Milliseconds per launch of gemm.gemm(w) on M random rows (median of 3 rounds of `reps`)."""
    from ninfer_rt.gpu import gemm

    N, K = w.shape
    x, y = gpu.alloc(M * K * 4), gpu.alloc(M * N * 4)
    try:
        gpu.upload(x, np.random.default_rng(1).standard_normal((M, K), dtype=np.float32))
        for _ in range(3):
            gemm.gemm(k, w, x=x, M=M, y=y)
        start, stop = Event(), Event()
        rounds = []
        for _ in range(3):
            start.record(gpu.stream)
            for _ in range(reps):
                gemm.gemm(k, w, x=x, M=M, y=y)
            stop.record(gpu.stream)
            stop.synchronize()
            rounds.append(start.elapsed_ms(stop) / reps)
        return statistics.median(rounds)
    finally:
        gpu.free(x)
        gpu.free(y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--M", default="512,2048,8192", help="rows (tokens), comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    try:
        gpu = Gpu(0)
    except GpuError as e:
        sys.exit(f"gemm_bench: no GPU ({e})")
    from ninfer_rt.gpu.kernels import Kernels
    from ninfer_rt.gpu.weights import DeviceWeight

    k = Kernels(gpu)
    rng = np.random.default_rng(0)
    Ms = [int(m) for m in args.M.split(",")]
    rows = []
    table = Table(title=f"gemm.gemm on {gpu.info.name} (fp32 x/y, bf16 mma.sync)")
    for col in ("format", "shape", "M", "ms", "TFLOP/s"):
        table.add_column(col, justify="left" if col in ("format", "shape") else "right")
    for fmt in args.formats.split(","):
        for label, shape in SHAPES.items():
            buf = random_weight(fmt, shape, rng)
            base = gpu.alloc(buf.nbytes)
            try:
                gpu.upload(base, buf)
                w = DeviceWeight(label, fmt, shape, base)
                for M in Ms:
                    ms = time_gemm(gpu, k, w, M, args.reps)
                    tflops = 2 * M * shape[0] * shape[1] / (ms * 1e-3) / 1e12
                    rows.append(dict(format=fmt, N=shape[0], K=shape[1], M=M, ms=round(ms, 4),
                                     tflops=round(tflops, 1)))
                    table.add_row(fmt, label, str(M), f"{ms:.3f}", f"{tflops:.1f}")
            finally:
                gpu.free(base)
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
