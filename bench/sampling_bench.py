"""Time the device argmax and sampler at decode shape (M=1, V=248320): `python bench/sampling_bench.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer_rt.errors import NinferError  # noqa: E402


def main() -> None:
    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.driver import Event, Gpu
    from ninfer_rt.gpu.kernels import Kernels

    gpu = Gpu(0)
    k = Kernels(gpu)
    V = 248320
    logits = (np.random.default_rng(0).standard_normal(V) * 2.5).astype(np.float32)
    lp, out = gpu.alloc(logits.nbytes), gpu.alloc(4)
    am, sm = gpu.alloc(misc.argmax_scratch_bytes(1)), gpu.alloc(misc.sample_scratch_bytes(1, V))
    params = misc.sample_params(0.8, 0, 0.95, 0.0, 3, 4)
    pp = gpu.alloc(params.nbytes)
    gpu.upload(lp, logits)
    gpu.upload(pp, params)
    runs = {"argmax": lambda: misc.argmax(k, logits=lp, ld=V, M=1, V=V, out=out, scratch=am),
            "sample (top-p 0.95, T 0.8)": lambda: misc.sample(k, logits=lp, ld=V, M=1, V=V, params=pp, out=out,
                                                              scratch=sm)}
    for name, fn in runs.items():
        fn()
        a, b = Event(), Event()
        a.record(gpu.stream)
        for _ in range(50):
            fn()
        b.record(gpu.stream)
        b.synchronize()
        print(f"{name}: {a.elapsed_ms(b) * 1000 / 50:.1f} us per call (M=1, V={V})")


if __name__ == "__main__":
    try:
        main()
    except NinferError as e:
        sys.exit(f"error: {e}")
