"""Prefill GEMM throughput (ninfer_rt.gpu.gemm.gemm) on the Qwen3.6-35B-A3B shapes, timed with driver events.

    python bench/gemm_bench.py [--json PATH] [--formats q8g32,q4g64] [--M 512,2048,8192] [--reps 20]
                               [--moe-M 512,2048] [--no-dense] [--kernels mma,wgmma]

For each format, weight shape [N, K] and M rows: `reps` back-to-back launches between two events, after a
warm-up, median of 3 rounds; TFLOP/s = 2·M·N·K / time. Weights are random valid codes and scales. Prints a
table (and writes JSON with --json); without a GPU it exits with one line. --kernels: the GEMM kernels to time
(gemm.KERNELS; default every one this GPU runs: mma, and wgmma on an H100/H200).

MoE: gemm.moe_grouped at the 35B expert shapes (E = 256, top_k = 8, I = 512, H = 2048, gate_up q4g64, down
q5g64) for each --moe-M, random routing (8 distinct experts per token), both paths ("small": moe_small, tiles
of 32 slots; "large": moe_gemm, tiles of 128). One call (sort + 2 GEMMs) is captured in a CUDA graph and replayed
`reps` times between events (no host overhead); GB/s counts the bytes of the touched experts' weights once.
Weight bytes are random (scales may be NaN: timing does not depend on values).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import eager_ms, replay_ms  # noqa: E402

from ninfer_rt.formats import f32_to_bf16_bits, get_format, round_up, K_ALIGN  # noqa: E402
from ninfer_rt.gpu.driver import Gpu, GpuError  # noqa: E402

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


def time_gemm(gpu, k, w, M: int, reps: int, kernel: str) -> float:
    """Milliseconds per launch of gemm.gemm(w) on M random rows (median of 3 rounds of `reps`)."""
    from ninfer_rt.gpu import gemm

    N, K = w.shape
    ss = kernel == "wgmma_ss"  # the time includes the dequantizing pass into the scratch
    nss = gemm.dequant_bytes(w) if ss else 0
    x, y, scratch = gpu.alloc(M * K * 2), gpu.alloc(M * N * 4), gpu.alloc(max(nss, 256))
    try:
        gpu.upload(x, f32_to_bf16_bits(np.random.default_rng(1).standard_normal((M, K), dtype=np.float32)))
        return statistics.median(eager_ms(gpu, lambda: gemm.gemm(k, w, x=x, M=M, y=y, kernel=kernel, scratch=scratch,
                                                                 scratch_bytes=nss), rounds=3, reps=reps, warmup=3))
    finally:
        for p in (x, y, scratch):
            gpu.free(p)


MOE = dict(E=256, top_k=8, I=512, H=2048, gate_up="q4g64", down="q5g64")


def time_moe(gpu, k, gu, dn, M: int, reps: int, path: str, rng, kernel: str) -> tuple[float, int]:
    """(ms per moe_grouped call by graph replay, bytes of the touched experts' weights) for M random tokens."""
    from ninfer_rt.gpu import gemm

    E, top_k, I, H = MOE["E"], MOE["top_k"], MOE["I"], MOE["H"]
    ids = np.argsort(rng.random((M, E)), axis=1)[:, :top_k].astype(np.int32)
    wts = rng.uniform(0, 1, (M, top_k)).astype(np.float32)
    x = f32_to_bf16_bits(rng.standard_normal((M, H), dtype=np.float32))
    bufs = [gpu.alloc(n) for n in (x.nbytes, ids.nbytes, wts.nbytes, M * top_k * I * 2, M * H * 4,
                                   gemm.moe_scratch_bytes(M, top_k, E))]
    xp, ip, wp, ap, yp, sp = bufs
    try:
        gpu.upload(xp, x)
        gpu.upload(ip, ids)
        gpu.upload(wp, wts)
        gpu.memset(yp, 0, M * H * 4)

        def call():
            gemm.moe_grouped(k, gu, dn, x=xp, M=M, ids=ip, weights=wp, top_k=top_k, act=ap, y=yp, scratch=sp,
                             path=path, kernel=kernel)

        rounds = replay_ms(gpu, call, rounds=3, replays=reps)  # eager call first: smem attributes outside
        touched = len(np.unique(ids))
        per_expert = (get_format(MOE["gate_up"]).nbytes((2 * I, H)) + get_format(MOE["down"]).nbytes((H, I)))
        return statistics.median(rounds), touched * per_expert
    finally:
        for b in bufs:
            gpu.free(b)


def bench_moe(gpu, k, Ms, reps: int, rows: list, kernels) -> None:
    from ninfer_rt.gpu.weights import DeviceWeight

    E, I, H = MOE["E"], MOE["I"], MOE["H"]
    shapes = {"gate_up": (MOE["gate_up"], (E, 2 * I, H)), "down": (MOE["down"], (E, H, I))}
    rng = np.random.default_rng(2)
    bases, ws = [], {}
    try:
        for name, (fmt, shape) in shapes.items():
            n = get_format(fmt).nbytes(shape)
            bases.append(gpu.alloc(n))
            gpu.upload(bases[-1], rng.integers(0, 256, n, dtype=np.uint8))
            ws[name] = DeviceWeight(name, fmt, shape, bases[-1])
        table = Table(title=f"gemm.moe_grouped on {gpu.info.name}: E={E} top_k={MOE['top_k']} I={I} H={H}, "
                            f"{MOE['gate_up']}/{MOE['down']} (graph replay)")
        for col in ("M", "path", "ms", "weight GB/s"):
            table.add_column(col, justify="right")
        # moe_small is mma.sync only; the grouped banks are not dequantized (wgmma_ss is dense only)
        paths = ["small"] + [f"large {kern}" for kern in kernels if kern != "wgmma_ss"]
        for M in Ms:
            for path in paths:
                p, kern = (path.split() + ["mma"])[:2]
                ms, nbytes = time_moe(gpu, k, ws["gate_up"], ws["down"], M, reps, p, rng, kern)
                rows.append(dict(moe=True, M=M, path=p, kernel=kern, ms=round(ms, 4),
                                 weight_gbs=round(nbytes / ms / 1e6, 1)))
                table.add_row(str(M), path, f"{ms:.3f}", f"{nbytes / ms / 1e6:.0f}")
        Console().print(table)
    finally:
        for b in bases:
            gpu.free(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--M", default="512,2048,8192", help="rows (tokens), comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--moe-M", default="512,2048", help="tokens for the MoE bench, comma-separated ('' skips)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense gemm table")
    ap.add_argument("--kernels", default=None, help="GEMM kernels to time, comma-separated (mma, wgmma, wgmma_ss: "
                                                    "dequantized first, timed with it); default: every one "
                                                    "this GPU runs")
    args = ap.parse_args()
    try:
        gpu = Gpu(0)
    except GpuError as e:
        sys.exit(f"gemm_bench: no GPU ({e})")
    from ninfer_rt.gpu.kernels import Kernels
    from ninfer_rt.gpu.weights import DeviceWeight

    from ninfer_rt.gpu import gemm

    k = Kernels(gpu)
    hopper = ["wgmma", "wgmma_ss"] if gemm.wgmma_available(k) else []
    kernels = args.kernels.split(",") if args.kernels else ["mma"] + hopper
    bad = [kern for kern in kernels if kern not in ["mma"] + hopper]
    if bad:
        sys.exit(f"gemm_bench: kernel {bad[0]!r} is not one this GPU runs ({', '.join(['mma'] + hopper)})")
    rng = np.random.default_rng(0)
    Ms = [int(m) for m in args.M.split(",")]
    rows = []
    table = Table(title=f"gemm.gemm on {gpu.info.name} (bf16 x, fp32 y)")
    for col in ("format", "shape", "M", "kernel", "ms", "TFLOP/s"):
        table.add_column(col, justify="left" if col in ("format", "shape") else "right")
    for fmt in ([] if args.no_dense else args.formats.split(",")):
        for label, shape in SHAPES.items():
            buf = random_weight(fmt, shape, rng)
            base = gpu.alloc(buf.nbytes)
            try:
                gpu.upload(base, buf)
                w = DeviceWeight(label, fmt, shape, base)
                for M in Ms:
                    for kern in kernels:
                        if kern == "wgmma_ss" and fmt == "bf16":
                            continue  # nothing to dequantize
                        ms = time_gemm(gpu, k, w, M, args.reps, kern)
                        tflops = 2 * M * shape[0] * shape[1] / (ms * 1e-3) / 1e12
                        rows.append(dict(format=fmt, N=shape[0], K=shape[1], M=M, kernel=kern, ms=round(ms, 4),
                                         tflops=round(tflops, 1)))
                        table.add_row(fmt, label, str(M), kern, f"{ms:.3f}", f"{tflops:.1f}")
            finally:
                gpu.free(base)
    if not args.no_dense:
        Console().print(table)
    if args.moe_M:
        bench_moe(gpu, k, [int(m) for m in args.moe_M.split(",")], args.reps, rows, kernels)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
