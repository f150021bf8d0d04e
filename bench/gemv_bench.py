"""Decode GEMV bandwidth on the model shapes: linear.gemv timed with CUDA events, against a peak read bandwidth.

    python bench/gemv_bench.py [--json PATH] [--peak 4.3e12] [--batches 30] [--m 1 8]

Each shape gets several weight buffers (enough that they overflow L2 several times) launched in turn, so no
launch finds its weights in L2; a batch times one launch per buffer between two events, and the table reports
the median per-launch time over the batches, after warm-up. GB/s counts the weight bytes (the dominant
traffic; x and y are < 0.1% here). Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer_rt.formats import get_format  # noqa: E402
from ninfer_rt.gpu import linear  # noqa: E402
from ninfer_rt.gpu.driver import GpuError  # noqa: E402
from ninfer_rt.gpu.weights import DeviceWeight  # noqa: E402

# (what, format, [N, K], mode, fused RMSNorm) as the engine calls them
SHAPES = [
    ("35B attn q|k|v|gate", "q8g32", (9216, 2048), "store", True),
    ("35B attn o_proj +res", "q8g32", (2048, 4096), "add", False),
    ("35B DeltaNet in_proj qkv|z", "q8g32", (12288, 2048), "store", True),
    ("35B DeltaNet out_proj +res", "q8g32", (2048, 4096), "add", False),
    ("35B shared expert gate|up", "q8g32", (1024, 2048), "swiglu", True),
    ("35B lm_head", "q6g64", (248320, 2048), "store", True),
    ("27B mlp gate|up", "q4g64", (34816, 5120), "swiglu", True),
    ("27B mlp down +res", "q5g64", (5120, 17408), "add", False),
]


def bench_shape(gpu, k, what, fmt, shape, mode, norm, ms, batches, rng, budget_bytes):
    """Median per-launch microseconds for each M in ms."""
    from ninfer_rt.gpu.driver import Event

    f = get_format(fmt)
    nbytes = f.nbytes(shape)
    n, kk = shape
    l2 = gpu.info.l2_bytes or 50 << 20
    copies = max(2, min(math.ceil(4 * l2 / nbytes), budget_bytes // nbytes))
    host = rng.integers(0, 256, size=nbytes, dtype=np.uint8)  # contents do not change the timing
    if fmt.startswith("q"):  # finite scales (random fp16 bits could be NaN; harmless, but keep numbers sane)
        sc = next(p for p in f.planes(shape) if p.name == "scales")
        host[sc.offset:sc.offset + sc.nbytes].view(np.float16)[:] = np.float16(0.01)
    bufs = []
    for i in range(copies):
        p = gpu.alloc(nbytes)
        gpu.upload(p, host)
        bufs.append(DeviceWeight(f"{what}#{i}", fmt, shape, p))
    mmax = max(ms)
    n_out = n // 2 if mode == "swiglu" else n
    x = gpu.alloc(mmax * kk * 4)
    gpu.upload(x, rng.standard_normal((mmax, kk)).astype(np.float32))
    y = gpu.alloc(mmax * n_out * 4)
    gpu.memset(y, 0, mmax * n_out * 4)
    nw = 0
    if norm:
        nw = gpu.alloc(kk * 4)
        gpu.upload(nw, (rng.standard_normal(kk) * 0.1).astype(np.float32))
    rows = []
    try:
        for m in ms:
            def launch(w):
                linear.gemv(k, w, x=x, M=m, y=y, mode=mode, norm_w=nw, stream=gpu.stream)
            for w in bufs * 2:  # warm-up: every buffer touched, clocks up
                launch(w)
            gpu.synchronize()
            start, stop = Event(), Event()
            times = []
            for _ in range(batches):
                start.record(gpu.stream)
                for w in bufs:
                    launch(w)
                stop.record(gpu.stream)
                stop.synchronize()
                times.append(start.elapsed_ms(stop) * 1e3 / len(bufs))
            us = statistics.median(times)
            plan = linear.plan_gemv(bufs[0], m, gpu.info.sm_count)
            rows.append({"what": what, "format": fmt, "shape": list(shape), "mode": mode, "norm": norm, "M": m,
                         "us": us, "us_min": min(times), "weight_bytes": nbytes, "gbps": nbytes / us / 1e3,
                         "copies": copies, "grid": plan.grid, "kw": 1 << plan.kw_log2, "ks": plan.ks})
    finally:
        for w in bufs:
            gpu.free(w.base)
        for p in (x, y, nw):
            if p:
                gpu.free(p)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--peak", type=float, default=4.3e12, help="reference read bandwidth, bytes/s (H200: 4.3e12)")
    ap.add_argument("--batches", type=int, default=30, help="timed batches per shape and M (median reported)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8], help="activation rows per launch")
    ap.add_argument("--budget-gb", type=float, default=8.0, help="device memory for weight copies, per shape")
    args = ap.parse_args()

    try:
        from ninfer_rt.gpu.driver import Gpu
        from ninfer_rt.gpu.kernels import Kernels

        gpu = Gpu(0)
    except GpuError as e:
        sys.exit(f"gemv_bench: no GPU ({e})")
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t0 = time.time()
    k = Kernels(gpu)
    console.print(f"{gpu.info.name} ({gpu.info.arch}, {gpu.info.sm_count} SMs, L2 {gpu.info.l2_bytes >> 20} MiB); "
                  f"kernels ready in {time.time() - t0:.1f} s", highlight=False)
    rng = np.random.default_rng(0)
    rows = []
    for what, fmt, shape, mode, norm in SHAPES:
        rows += bench_shape(gpu, k, what, fmt, shape, mode, norm, args.m, args.batches, rng,
                            int(args.budget_gb * 2**30))

    table = Table(title=f"linear.gemv, median of {args.batches} batches; % of {args.peak / 1e12:.2f} TB/s")
    for col, just in [("tensor", "left"), ("format", "left"), ("[N, K]", "right"), ("mode", "left"),
                      ("M", "right"), ("MB", "right"), ("µs", "right"), ("ideal µs", "right"), ("GB/s", "right"),
                      ("% peak", "right"), ("grid×KW", "right")]:
        table.add_column(col, justify=just)
    for r in rows:
        pct = 100 * r["gbps"] * 1e9 / args.peak
        style = "green" if pct >= 85 else "yellow" if pct >= 60 else "red"
        table.add_row(r["what"], r["format"], f"{r['shape'][0]}×{r['shape'][1]}",
                      r["mode"] + ("+norm" if r["norm"] else ""), str(r["M"]), f"{r['weight_bytes'] / 1e6:.1f}",
                      f"{r['us']:.1f}", f"{r['weight_bytes'] / args.peak * 1e6:.1f}", f"{r['gbps']:.0f}",
                      f"[{style}]{pct:.0f}%[/]", f"{r['grid']}×{r['kw']}")
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "arch": gpu.info.arch, "peak": args.peak,
                                         "batches": args.batches, "rows": rows}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
