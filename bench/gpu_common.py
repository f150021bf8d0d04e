"""What every GPU micro-benchmark starts with: the context, the built kernels, a console and a header line."""

from __future__ import annotations

import sys
import time


def open_gpu(prog: str):
    """(gpu, kernels, console) on GPU 0; exits with one line naming `prog` when there is no usable GPU."""
    from ninfer_rt.gpu.driver import GpuError

    try:
        from ninfer_rt.gpu.driver import Gpu
        from ninfer_rt.gpu.kernels import Kernels

        gpu = Gpu(0)
    except GpuError as e:
        sys.exit(f"{prog}: no GPU ({e})")
    from rich.console import Console

    console = Console()
    t0 = time.time()
    k = Kernels(gpu)
    console.print(f"{gpu.info.name} ({gpu.info.arch}, {gpu.info.sm_count} SMs, L2 {gpu.info.l2_bytes >> 20} MiB); "
                  f"kernels ready in {time.time() - t0:.1f} s", highlight=False)
    return gpu, k, console
