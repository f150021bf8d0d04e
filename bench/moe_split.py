"""The prefill MoE's two grouped GEMMs timed apart, on the persistent wgmma grid and on one block per tile.

    python bench/moe_split.py [--M 8192] [--json PATH]

gemm.moe_grouped at the 35B expert shapes (E = 256, top_k = 8, I = 512, H = 2048, gate_up q4g64, down q5g64), random
routing, captured in a CUDA graph and replayed (median of 3 rounds of 10). "gate/up" is moe_sort plus the gate/up
GEMM (the down launch is skipped); "both" adds the down projection, whose time is the difference. Grids: the
default (gemm.wg_grid: one block per SM) and one block per tile (max_blocks large). Needs an H100/H200 (the wgmma
kernel); exits with one line otherwise. Weight bytes are random (timing does not depend on values).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--M", type=int, default=8192, help="tokens")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    gpu, k, console = open_gpu("moe_split")
    from rich.table import Table

    from ninfer_rt.formats import f32_to_bf16_bits, get_format
    from ninfer_rt.gpu import gemm
    from ninfer_rt.gpu.weights import DeviceWeight

    if not gemm.wgmma_available(k):
        sys.exit(f"moe_split: the wgmma kernel needs an H100/H200 running sm_90a; this GPU is {gpu.info.arch}")
    E, top_k, I, H, M = 256, 8, 512, 2048, args.M
    rng = np.random.default_rng(2)
    ws = {}
    for name, fmt, shape in (("gate_up", "q4g64", (E, 2 * I, H)), ("down", "q5g64", (E, H, I))):
        n = get_format(fmt).nbytes(shape)
        ws[name] = DeviceWeight(name, fmt, shape, gpu.alloc(n))
        gpu.upload(ws[name].base, rng.integers(0, 256, n, dtype=np.uint8))
    ids = np.argsort(rng.random((M, E)), axis=1)[:, :top_k].astype(np.int32)
    wts = rng.uniform(0, 1, (M, top_k)).astype(np.float32)
    x = f32_to_bf16_bits(rng.standard_normal((M, H), dtype=np.float32))
    xp, ip, wp, ap_, yp, sp = [gpu.alloc(n) for n in (x.nbytes, ids.nbytes, wts.nbytes, M * top_k * I * 2,
                                                       M * H * 4, gemm.moe_scratch_bytes(M, top_k, E))]
    gpu.upload(xp, x)
    gpu.upload(ip, ids)
    gpu.upload(wp, wts)
    gpu.memset(yp, 0, M * H * 4)
    launch, seen = k.launch, {"grouped": 0, "skip_down": False}

    def filtered(name, *a, **kw):  # the second grouped GEMM of a call is the down projection
        if name.startswith("moe_gemm"):
            seen["grouped"] += 1
            if seen["skip_down"] and seen["grouped"] == 2:
                return None
        return launch(name, *a, **kw)

    k.launch = filtered
    rows = []
    for grid, cap in (("one block per SM", None), ("one block per tile", 1 << 30)):
        ms = {}
        for part, skip in (("gate/up", True), ("both", False)):
            seen["skip_down"] = skip

            def call():
                seen["grouped"] = 0
                gemm.moe_grouped(k, ws["gate_up"], ws["down"], x=xp, M=M, ids=ip, weights=wp, top_k=top_k,
                                 act=ap_, y=yp, scratch=sp, path="large", kernel="wgmma", max_blocks=cap)

            ms[part] = statistics.median(replay_ms(gpu, call, rounds=3, replays=10))
        rows.append(dict(grid=grid, M=M, gate_up_ms=round(ms["gate/up"], 4),
                         down_ms=round(ms["both"] - ms["gate/up"], 4), both_ms=round(ms["both"], 4)))
    table = Table(title=f"moe_grouped on {gpu.info.name}, M={M}, q4g64/q5g64 (wgmma, graph replay)")
    for col in ("grid", "sort + gate/up ms", "down ms", "both ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["grid"], f"{r['gate_up_ms']:.3f}", f"{r['down_ms']:.3f}", f"{r['both_ms']:.3f}")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": gpu.info.name, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
