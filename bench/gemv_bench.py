"""Decode GEMV bandwidth on the model shapes: linear.gemv timed by CUDA-graph replay, against a peak read bandwidth.

    python bench/gemv_bench.py [--json PATH] [--peak 4.3e12] [--replays 30] [--m 1 8] [--sweep] [--only TEXT]

Each shape gets several weight buffers (enough that they overflow L2 several times). One CUDA graph holds one
launch per buffer in turn (at least 20 launches), so no launch finds its weights in L2 and the per-launch host
overhead of cuda-python (tens of µs) is not timed; a replay of the graph runs between two events, and the table
reports the median per-launch time over the replays, after warm-up replays. GB/s counts the weight bytes (the
dominant traffic; x and y are < 0.1% here). The graph's launch gaps are timed too (as in the engine's graphs),
so a small kernel reads a little slower here than in ncu. --sweep also times, at M = 1, the other plans of the
block kernel at every K split and the stream kernel's plans (d, blocks) wherever
x̂ fits its slab, one row each, to tune plan_gemv / plan_stream.
Exits with a one-line message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu, replay_ms  # noqa: E402

from ninfer_rt.formats import get_format  # noqa: E402
from ninfer_rt.gpu import linear  # noqa: E402
from ninfer_rt.gpu.weights import DeviceWeight  # noqa: E402

# (what, format, [N, K], mode, fused RMSNorm) as the engine calls them
SHAPES = [
    ("35B attn q|k|v|gate", "q8g32", (9216, 2048), "store", True),
    ("35B attn o_proj +res", "q8g32", (2048, 4096), "add", False),
    ("35B DeltaNet in_proj qkv|z", "q8g32", (12288, 2048), "store", True),
    ("35B DeltaNet out_proj +res", "q8g32", (2048, 4096), "add", False),
    ("35B shared expert gate|up", "q8g32", (1024, 2048), "swiglu", True),
    ("35B shared expert down +res", "q8g32", (2048, 512), "add", False),
    ("35B router|shared gate", "bf16", (257, 2048), "store", False),
    ("35B DeltaNet in_proj b|a", "bf16", (64, 2048), "store", True),
    ("35B lm_head", "q6g64", (248320, 2048), "store", True),
    ("27B mlp gate|up", "q4g64", (34816, 5120), "swiglu", True),
    ("27B mlp down +res", "q5g64", (5120, 17408), "add", False),
    ("27B DeltaNet in_proj qkv|z", "q6g64", (16384, 5120), "store", True),
    ("27B DeltaNet out_proj +res", "q6g64", (5120, 6144), "add", False),
]


def sweep_plans(w, sm_count: int) -> list[tuple[str, dict]]:
    """(label, plan overrides) for M = 1: the default, the block kernel at every K split, and, where all of x̂
    fits a stream kernel's slab, the stream plans around the default (d, 1 or 2 blocks per SM)."""
    plans = [("auto", {})]
    default = linear.plan_gemv(w, 1, sm_count)
    for kl in range(4):
        if default.stream or kl != default.kw_log2:
            plans.append((f"block kw{1 << kl}", {"stream": False, "kw_log2": kl}))
    if w.k > linear._stream_k_cap(w):
        return plans
    seen = {(default.d, default.blocks)} if default.stream else set()
    for d in sorted({1, linear._STREAM_DEPTH[w.bits]}, reverse=True):
        for per_sm in (1, 2):
            p = linear.plan_gemv(w, 1, sm_count, stream=True, d=d, blocks=per_sm * sm_count)
            if (p.d, p.blocks) not in seen:
                seen.add((p.d, p.blocks))
                plans.append((f"s d{d} b{p.blocks}", {"stream": True, "d": d, "blocks": per_sm * sm_count}))
    return plans


def bench_shape(gpu, k, what, fmt, shape, mode, norm, ms, replays, rng, budget_bytes, sweep):
    """Median per-launch microseconds for each M in ms (and, with sweep, each M = 1 plan)."""
    f = get_format(fmt)
    nbytes = f.nbytes(shape)
    n, kk = shape
    l2 = gpu.info.l2_bytes or 50 << 20
    copies = max(2, min(math.ceil(4 * l2 / nbytes), budget_bytes // nbytes))
    launches = max(20, copies)  # one graph: every copy in turn, at least 20 launches
    host = rng.integers(0, 256, size=nbytes, dtype=np.uint8)  # contents do not change the timing
    if fmt.startswith("q"):  # finite scales (random fp16 bits could be NaN; harmless, but keep numbers sane)
        sc = next(p for p in f.planes(shape) if p.name == "scales")
        host[sc.offset:sc.offset + sc.nbytes].view(np.float16)[:] = np.float16(0.01)
    bufs = []
    mmax = max(ms)
    n_out = n // 2 if mode == "swiglu" else n
    x = y = nw = 0
    rows = []
    try:
        for i in range(copies):
            p = gpu.alloc(nbytes)
            bufs.append(DeviceWeight(f"{what}#{i}", fmt, shape, p))
            gpu.upload(p, host)
        x = gpu.alloc(mmax * kk * 4)
        gpu.upload(x, rng.standard_normal((mmax, kk)).astype(np.float32))
        y = gpu.alloc(mmax * n_out * 4)
        gpu.memset(y, 0, mmax * n_out * 4)
        if norm:
            nw = gpu.alloc(kk * 4)
            gpu.upload(nw, (rng.standard_normal(kk) * 0.1).astype(np.float32))
        gpu.synchronize()
        for m in ms:
            variants = sweep_plans(bufs[0], gpu.info.sm_count) if (sweep and m == 1) else [("auto", {})]
            for label, over in variants:
                plan = linear.plan_gemv(bufs[0], m, gpu.info.sm_count, **over)

                def capture():
                    for i in range(launches):
                        w = bufs[i % copies]
                        if over:
                            linear._launch_gemv(k, w, plan, x=x, y=y, ldx=kk, ldy=n_out, mode=mode, norm_w=nw,
                                                norm_eps=1e-6, row_scale=0, stream=gpu.stream)
                        else:
                            linear.gemv(k, w, x=x, M=m, y=y, mode=mode, norm_w=nw, stream=gpu.stream)

                times = [1e3 * t / launches for t in replay_ms(gpu, capture, rounds=replays, replays=1)]
                us = statistics.median(times)
                kind = (f"s1 d{plan.d} ×{plan.blocks}" if plan.stream
                        else f"m{m} kw{1 << plan.kw_log2} ×{plan.grid}")
                rows.append({"what": what, "format": fmt, "shape": list(shape), "mode": mode, "norm": norm, "M": m,
                             "plan": label, "kernel": kind, "us": us, "us_min": min(times), "weight_bytes": nbytes,
                             "gbps": nbytes / us / 1e3, "copies": copies, "launches": launches, "grid": plan.grid,
                             "blocks": plan.launch_blocks, "kw": 1 << plan.kw_log2, "d": plan.d,
                             "ks": plan.ks})
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
    ap.add_argument("--replays", "--batches", type=int, default=30, help="timed graph replays (median reported)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8], help="activation rows per launch")
    ap.add_argument("--budget-gb", type=float, default=8.0, help="device memory for weight copies, per shape")
    ap.add_argument("--sweep", action="store_true", help="at M = 1 also time the other plans (tuning)")
    ap.add_argument("--only", help="only the shapes whose name contains this text")
    args = ap.parse_args()

    gpu, k, console = open_gpu("gemv_bench")
    from rich.table import Table

    rng = np.random.default_rng(0)
    rows = []
    for what, fmt, shape, mode, norm in SHAPES:
        if args.only and args.only not in what:
            continue
        rows += bench_shape(gpu, k, what, fmt, shape, mode, norm, args.m, args.replays, rng,
                            int(args.budget_gb * 2**30), args.sweep)

    table = Table(title=f"linear.gemv in CUDA graphs, median of {args.replays} replays; % of "
                        f"{args.peak / 1e12:.2f} TB/s")
    for col, just in [("tensor", "left"), ("format", "left"), ("[N, K]", "right"), ("mode", "left"),
                      ("M", "right"), ("MB", "right"), ("µs", "right"), ("ideal µs", "right"), ("GB/s", "right"),
                      ("% peak", "right"), ("plan", "left"), ("kernel", "left")]:
        table.add_column(col, justify=just)
    for r in rows:
        pct = 100 * r["gbps"] * 1e9 / args.peak
        style = "green" if pct >= 85 else "yellow" if pct >= 60 else "red"
        table.add_row(r["what"], r["format"], f"{r['shape'][0]}×{r['shape'][1]}",
                      r["mode"] + ("+norm" if r["norm"] else ""), str(r["M"]), f"{r['weight_bytes'] / 1e6:.1f}",
                      f"{r['us']:.1f}", f"{r['weight_bytes'] / args.peak * 1e6:.1f}", f"{r['gbps']:.0f}",
                      f"[{style}]{pct:.0f}%[/]", r["plan"], r["kernel"])
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "arch": gpu.info.arch, "peak": args.peak,
                                         "replays": args.replays, "timing": "cuda-graph replay",
                                         "rows": rows}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
