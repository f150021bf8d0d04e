"""What every GPU micro-benchmark shares: the context, the built kernels, a console and a header line (open_gpu),
timing direct launches (eager_ms, from ninfer_rt.gpu.bench) and a captured CUDA graph's replays (replay_ms)."""

from __future__ import annotations

import sys
import time

from ninfer_rt.gpu.bench import eager_ms  # noqa: F401  (the micro-benchmarks' eager timer, shared with ninfer-rt bench)


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


def replay_ms(gpu, capture, *, rounds: int, replays: int, warmup: int = 3, eager: bool = True) -> list[float]:
    """Milliseconds per replay of a CUDA graph of what capture() enqueues, one value per timed round.

    capture() runs once eagerly first (kernel lookups and shared-memory attributes happen outside the capture;
    eager=False skips it), once into the graph; `warmup` untimed replays follow (clocks up, buffers touched),
    then `rounds` rounds of `replays` back-to-back replays, each round timed between two events.
    """
    if eager:
        capture()
        gpu.synchronize()
    gpu.begin_capture(gpu.stream)
    try:
        capture()
    finally:
        graph = gpu.end_capture(gpu.stream)
    try:
        return eager_ms(gpu, lambda: graph.launch(gpu.stream), rounds=rounds, reps=replays, warmup=warmup)
    finally:
        graph.destroy()
