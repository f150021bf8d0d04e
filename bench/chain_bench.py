"""What a kernel boundary costs between two decode GEMVs, and what the persistent chain (kernels/chain.cu) saves.

    python bench/chain_bench.py [--layers 30] [--format q8g32] [--json PATH]

The 35B's DeltaNet projections as a chain: per layer in_proj_qkvz [12288, 2048] (norm, store) then out_proj
[2048, 4096] (add into the residual the next in_proj normalises), random q8 weights, `layers` of them (1.07 GB at
30: every replay streams from DRAM). Timed as CUDA graph replays, three ways:
  - "launches, own plans": one linear.gemv launch an op at its own stream plan (programmatic dependent launch, as
    the decode graph runs them);
  - "launches, chain's plan": the same kernel at the chain's grid and depths (chain.sequential, its bit oracle);
  - "chain, wait w": one chain_gemv_q8 launch (and its counters' memset), each op waiting the chain.WAITS way w
    (0 polling the arrivals' counter, 1 the same with a sleep between polls, 2 a flag the last arrival sets);
  - "chain, wait w, ops apart": the same weights, each op on buffers of its own, with wait 0 and with none (3): the
    weight stream without its waits, the bound a persistent kernel's boundaries could reach.
Each row gives µs a replay, µs an op, the weight bytes' rate, and the gap to the bytes at `--copy-gbs` (the card's
measured copy bandwidth; default the H200's 4,180 GB/s, anchors.md). "saved a boundary" is the row's time less the
first chain's (wait 0) over the op boundaries (2 · layers - 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import open_gpu, replay_ms  # noqa: E402

SHAPE = (12288, 2048, 4096)  # in_proj rows, hidden size, out_proj's K (the 35B-A3B's DeltaNet layer)


def build_ops(gpu, fmt: str, layers: int, rng):
    """The chain's ops on random weights (codes in range, scales ~1/127), the same ops each on buffers of its own
    (independent: no op reads another's output), and the device buffers to free."""
    from ninfer_rt.formats import K_ALIGN, get_format, round_up
    from ninfer_rt.gpu import chain
    from ninfer_rt.gpu.weights import DeviceWeight

    f = get_format(fmt)
    n1, h, k2 = SHAPE
    ptrs = []

    def put(a: np.ndarray) -> int:
        p = gpu.alloc(a.nbytes)
        gpu.upload(p, np.ascontiguousarray(a))
        ptrs.append(p)
        return p

    def weight(n: int, k: int, name: str) -> DeviceWeight:
        kp = round_up(k, K_ALIGN)
        q = rng.integers(f.qmin, f.qmax + 1, size=(n, kp), dtype=np.int8)
        sc = (rng.uniform(0.5, 1.5, size=(n, kp // f.group)) / f.offset).astype(np.float16)
        return DeviceWeight(name, fmt, (n, k), put(f.pack(q, sc)))

    x = put(rng.standard_normal(h).astype(np.float32))
    y = put(np.zeros(n1, np.float32))
    ops = []
    for i in range(layers):
        nw = put((rng.standard_normal(h) * 0.2).astype(np.float32))
        ops += [chain.ChainOp(weight(n1, h, f"layers.{i}.linear_attn.in_proj_qkvz.weight"), x, y, "store", nw),
                chain.ChainOp(weight(h, k2, f"layers.{i}.linear_attn.out_proj.weight"), y, x, "add")]
    nbytes = sum(f.nbytes(op.w.shape) for op in ops)
    apart = [chain.ChainOp(op.w, put(rng.standard_normal(op.w.shape[1]).astype(np.float32)),
                           put(np.zeros(op.w.shape[0], np.float32)), op.mode, op.norm_w) for op in ops]
    return ops, apart, ptrs, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30, help="DeltaNet-like layers (two GEMVs each); default 30")
    ap.add_argument("--format", default="q8g32", help="weight format, q8g32 / q8g64 / q8g128 (default q8g32)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per round")
    ap.add_argument("--copy-gbs", type=float, default=4180.0, help="the card's copy bandwidth for the bytes' time")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    a = ap.parse_args()
    if a.layers < 1 or a.format not in ("q8g32", "q8g64", "q8g128"):
        sys.exit("chain_bench: --layers must be >= 1 and --format one of q8g32, q8g64, q8g128")

    from rich.table import Table

    from ninfer_rt.gpu import chain, linear

    gpu, k, console = open_gpu("chain_bench")
    ops, apart, ptrs, nbytes = build_ops(gpu, a.format, a.layers, np.random.default_rng(0))
    chains = [(f"chain, wait {how}", chain.Chain(k, ops, how=how)) for how in chain.WAITS if how != chain.NO_WAIT]
    chains += [(f"chain, wait {how}, ops apart", chain.Chain(k, apart, how=how)) for how in (0, chain.NO_WAIT)]
    c = chains[0][1]
    try:
        def own():
            for op in ops:
                linear.gemv(k, op.w, x=op.x, M=1, y=op.y, mode=op.mode, norm_w=op.norm_w, norm_eps=op.eps)

        ways = {"launches, own plans": own,
                "launches, chain's plan": lambda: chain.sequential(k, ops, c.plan),
                **{name: (lambda ch=ch: ch.launch(gpu.stream)) for name, ch in chains}}
        us = {name: 1e3 * statistics.median(replay_ms(gpu, fn, rounds=a.rounds, replays=a.replays))
              for name, fn in ways.items()}
    finally:
        for _, ch in chains:
            ch.free()
        for p in ptrs:
            gpu.free(p)

    ideal = nbytes / (a.copy_gbs * 1e3)  # µs
    bounds = len(ops) - 1
    rows = [dict(way=name, us=t, us_per_op=t / len(ops), gbs=nbytes / t / 1e3, over_bytes_us=t - ideal,
                 saved_per_boundary_us=(t - us["chain, wait 0"]) / bounds) for name, t in us.items()]
    t = Table(title=f"{a.layers} layers x (in_proj {SHAPE[0]}x{SHAPE[1]} + out_proj {SHAPE[1]}x{SHAPE[2]}), "
                    f"{a.format}, {nbytes / 1e6:.1f} MB: {ideal:.1f} µs at {a.copy_gbs:.0f} GB/s; "
                    f"{c.plan.blocks} blocks")
    for col in ("way", "µs a replay", "µs an op", "GB/s", "µs over the bytes", "saved a boundary (µs)"):
        t.add_column(col, justify="left" if col == "way" else "right")
    for r in rows:
        t.add_row(r["way"], f"{r['us']:.1f}", f"{r['us_per_op']:.2f}", f"{r['gbs']:.0f}", f"{r['over_bytes_us']:.1f}",
                  f"{r['saved_per_boundary_us']:.2f}")
    console.print(t)
    if a.json:
        a.json.write_text(json.dumps(dict(gpu=gpu.info.name, layers=a.layers, format=a.format, bytes=nbytes,
                                          blocks=c.plan.blocks, copy_gbs=a.copy_gbs, rows=rows), indent=1))


if __name__ == "__main__":
    main()
