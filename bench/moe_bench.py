"""Decode MoE kernels on the 35B shapes: moe.route, moe.gate_up, moe.down, timed in CUDA graph replays.

    python bench/moe_bench.py [--json PATH] [--m 1 8] [--launches 20] [--replays 10] [--reps 15]

Each (op, M) captures `launches` launches in one CUDA graph (no host launch overhead) and times `replays`
replays of it between two events; the table reports the median per-launch time over `reps` such batches.
Every launch routes to different experts (ids drawn ahead), so the expert weights it reads are not in L2 from
the launch before (at M = 1 the 20 launches cover 160 distinct experts of 256). GB/s counts the weight bytes of
the distinct experts a launch reads (random code bytes, fp16 scales ~1e-3). Exits with one line without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import open_gpu, replay_ms  # noqa: E402

from ninfer_rt.formats import get_format  # noqa: E402
from ninfer_rt.gpu import moe  # noqa: E402
from ninfer_rt.gpu.weights import DeviceWeight  # noqa: E402

E, TOP_K, I, H = 256, 8, 512, 2048  # Qwen3.6-35B-A3B routed experts


def random_bank(gpu, fmt: str, shape, rng) -> DeviceWeight:
    """An expert bank of random code bytes and fp16 scales of magnitude ~1e-3 (bf16: small random values)."""
    f = get_format(fmt)
    nbytes = f.nbytes(shape)
    host = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    if f.is_quantized:
        sc = next(p for p in f.planes(shape) if p.name == "scales")
        n = sc.nbytes // 2
        host[sc.offset:sc.offset + sc.nbytes].view(np.float16)[:] = (
            rng.uniform(0.5e-3, 1.5e-3, n) * rng.choice([-1.0, 1.0], n)).astype(np.float16)
    else:
        host.view(np.uint16)[:] = (host.view(np.uint16) & 0x3FFF) | 0x3800  # finite, |v| < 2
    p = gpu.alloc(nbytes)
    gpu.upload(p, host)
    return DeviceWeight(f"bank{list(shape)}", fmt, tuple(shape), p)


def bench_m(gpu, k, gu, dn, M: int, args, rng) -> list[dict]:
    n = args.launches
    ptrs = []

    def put(a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        p = gpu.alloc(a.nbytes)
        gpu.upload(p, a)
        ptrs.append(p)
        return p

    def empty(nbytes: int) -> int:
        p = gpu.alloc(nbytes)
        gpu.memset(p, 0, nbytes)
        ptrs.append(p)
        return p

    # ids per launch: distinct experts per row; at M = 1 disjoint over the launches while E allows
    perm = rng.permutation(E)
    ids_host = []
    for i in range(n):
        if M == 1 and (i + 1) * TOP_K <= E:
            ids_host.append(perm[i * TOP_K:(i + 1) * TOP_K][None].astype(np.int32))
        else:
            ids_host.append(np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(M)]).astype(np.int32))
    distinct = statistics.mean(len(np.unique(a)) for a in ids_host)
    ids = [put(a) for a in ids_host]
    w = rng.uniform(0.5, 1.5, (M, TOP_K)).astype(np.float32)
    wts = put(w / w.sum(-1, keepdims=True))
    logits = put((rng.standard_normal((M, E + 1)) * 2).astype(np.float32))
    r_ids, r_w, r_ss = empty(M * TOP_K * 4), empty(M * TOP_K * 4), empty(M * 4)
    x = put((rng.standard_normal((M, H)) * 0.05).astype(np.float32))
    act = put((rng.standard_normal((M, TOP_K, I)) * 0.05).astype(np.float32))
    act_out = empty(M * TOP_K * I * 4)
    y = put(np.zeros((M, H), np.float32))

    ops = {
        "route": (lambda i: moe.route(k, logits=logits, ld=E + 1, M=M, E=E, top_k=TOP_K, ids=r_ids, weights=r_w,
                                      shared_scale=r_ss, stream=gpu.stream),
                  0, f"[{M}, {E + 1}] fp32"),
        "gate_up": (lambda i: moe.gate_up(k, gu, x=x, M=M, ids=ids[i], top_k=TOP_K, act=act_out, stream=gpu.stream),
                    distinct * gu.nbytes / E, f"{gu.fmt} {TOP_K}×[{2 * I}, {H}]"),
        "down": (lambda i: moe.down(k, dn, act=act, ids=ids[i], weights=wts, M=M, top_k=TOP_K, y=y,
                                    stream=gpu.stream),
                 distinct * dn.nbytes / E, f"{dn.fmt} {TOP_K}×[{H}, {I}]"),
    }
    rows = []
    try:
        for op, (fn, nbytes, what) in ops.items():
            times = [1e3 * t / n for t in replay_ms(gpu, lambda: [fn(i) for i in range(n)], rounds=args.reps,
                                                     replays=args.replays)]
            us, us_min = statistics.median(times), min(times)
            rows.append({"op": op, "what": what, "M": M, "us": us, "us_min": us_min, "weight_bytes": nbytes,
                         "distinct_experts": distinct if nbytes else 0,
                         "gbps": nbytes / us / 1e3 if nbytes else 0.0})
    finally:
        gpu.synchronize()
        for p in ptrs:
            gpu.free(p)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8], help="token rows per launch")
    ap.add_argument("--launches", type=int, default=20, help="launches captured per graph")
    ap.add_argument("--replays", type=int, default=10, help="graph replays per timed batch")
    ap.add_argument("--reps", type=int, default=15, help="timed batches (median reported)")
    ap.add_argument("--gate-up-fmt", default="q4g64")
    ap.add_argument("--down-fmt", default="q5g64")
    ap.add_argument("--peak", type=float, default=4.23e12, help="reference read bandwidth, bytes/s (H200 copy)")
    args = ap.parse_args()

    gpu, k, console = open_gpu("moe_bench")
    from rich.table import Table

    rng = np.random.default_rng(0)
    gu = random_bank(gpu, args.gate_up_fmt, (E, 2 * I, H), rng)
    dn = random_bank(gpu, args.down_fmt, (E, H, I), rng)
    rows = []
    try:
        for m in args.m:
            rows += bench_m(gpu, k, gu, dn, m, args, rng)
    finally:
        gpu.free(gu.base)
        gpu.free(dn.base)

    table = Table(title=f"moe decode ops, {args.launches} launches per graph, median of {args.reps} batches; "
                        f"% of {args.peak / 1e12:.2f} TB/s")
    for col, just in [("op", "left"), ("shape", "left"), ("M", "right"), ("experts", "right"), ("MB", "right"),
                      ("µs", "right"), ("min µs", "right"), ("ideal µs", "right"), ("GB/s", "right"),
                      ("% peak", "right")]:
        table.add_column(col, justify=just)
    for r in rows:
        nb = r["weight_bytes"]
        pct = 100 * r["gbps"] * 1e9 / args.peak
        style = "green" if pct >= 60 else "yellow" if pct >= 35 else "red"
        table.add_row(r["op"], r["what"], str(r["M"]), f"{r['distinct_experts']:.1f}" if nb else "-",
                      f"{nb / 1e6:.2f}" if nb else "-", f"{r['us']:.2f}", f"{r['us_min']:.2f}",
                      f"{nb / args.peak * 1e6:.2f}" if nb else "-", f"{r['gbps']:.0f}" if nb else "-",
                      f"[{style}]{pct:.0f}%[/]" if nb else "-")
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": gpu.info.name, "arch": gpu.info.arch, "peak": args.peak,
                                         "launches": args.launches, "replays": args.replays, "reps": args.reps,
                                         "rows": rows}, indent=1))
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
