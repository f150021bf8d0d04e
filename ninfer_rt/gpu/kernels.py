"""Loads the built kernel images into a context and finds entry points by their extern "C" name."""

from __future__ import annotations

from ninfer_rt.gpu.build import TARGETS, BuildResult, build_kernels
from ninfer_rt.gpu.driver import Gpu, GpuError


class Kernels:
    """Every kernels/*.cu image loaded on `gpu`; `k.fn(name)` returns the CUfunction, `k.launch(...)` runs it."""

    def __init__(self, gpu: Gpu, build: BuildResult | None = None):
        self.gpu = gpu
        if build is None:
            target = gpu.info.arch
            build = build_kernels((target,) if target in TARGETS else ("sm_80",))
        self.build = build
        self.modules = [gpu.load_module(p.read_bytes(), stem) for stem, p in sorted(build.images.items())]
        self._fns: dict[str, object] = {}

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is not None:
            return f
        for m in self.modules:
            try:
                f = m.function(name)
            except GpuError:
                continue
            self._fns[name] = f
            return f
        raise GpuError(f"kernel entry point {name!r} is in none of the built images")

    def launch(self, name: str, grid, block, args, smem: int = 0, stream=None) -> None:
        self.gpu.launch(self.fn(name), grid, block, args, smem, stream)
