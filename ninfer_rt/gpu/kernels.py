"""Loads the built kernel images into a context and finds entry points by their extern "C" name."""

from __future__ import annotations

from ninfer_rt.gpu.build import TARGETS, BuildResult, build_kernels
from ninfer_rt.gpu.driver import Gpu, GpuError


# Shared-memory carveout every launch prefers, in percent of the SM's unified L1 / shared memory (None: the
# driver's choice per kernel). Read at each launch (the decode graph's capture).
SMEM_CARVEOUT: int | None = None


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
        self._smem: dict[str, int] = {}  # dynamic shared memory each entry point is opted in to
        self._carveout: dict[str, int] = {}  # the carveout preference each entry point was given (-1: none)

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

    def opt_in_smem(self, name: str, nbytes: int) -> None:
        """Let `name` launch with nbytes of dynamic shared memory: above the 48 KiB default a kernel must opt in
        (once per larger size); more than the GPU allows per block is a one-line GpuError."""
        limit = self.gpu.info.max_smem_per_block_optin
        if nbytes > limit:
            raise GpuError(f"{name} needs {nbytes} bytes of shared memory; this GPU allows {limit}")
        if nbytes > self._smem.get(name, 48 * 1024):
            self.gpu.set_max_dynamic_smem(self.fn(name), nbytes)
            self._smem[name] = nbytes

    @property
    def clusters(self) -> bool:
        """Whether kernels may launch in thread-block clusters here: compute capability 9.0+ running its own cubin
        from these images (a GPU newer than TARGETS runs the compute_80 PTX, with no sm_90 code compiled in)."""
        return self.gpu.info.major >= 9 and self.gpu.info.arch in self.build.targets

    def launch(self, name: str, grid, block, args, smem: int = 0, stream=None, cluster=None) -> None:
        """Launch entry point `name` (Gpu.launch: cluster gives thread-block cluster dimensions, sm_90+)."""
        want = -1 if SMEM_CARVEOUT is None else SMEM_CARVEOUT
        if self._carveout.get(name, -1) != want:
            self.gpu.set_smem_carveout(self.fn(name), want)
            self._carveout[name] = want
        self.gpu.launch(self.fn(name), grid, block, args, smem, stream, cluster)
