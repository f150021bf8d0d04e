"""Loads the built kernel images into a context and finds entry points by their extern "C" name."""

from __future__ import annotations

import math

from ninfer_rt.gpu.build import TARGETS, BuildResult, build_kernels
from ninfer_rt.gpu.driver import Gpu, GpuError, _dim3


# Shared-memory carveout every launch prefers, in percent of the SM's unified L1 / shared memory (None: the
# driver's choice per kernel, or a shared one below). Read at each launch (the decode graph's capture).
SMEM_CARVEOUT: int | None = None
# Planner switch: the launches of a decode step whose entry point starts with one of these ("": all) share one
# carveout, the smallest SM configuration that holds each one's blocks per SM (GpuModel plans it by a dry run
# before the step first runs), so an SM never drains to switch between two of them; (): the driver's choice per
# kernel. v43 measured ("gemv_",) 3.0% faster on the 27B at 8K; on v50's kernels () is 0.2-0.5% faster on both
# models at 8K and 262K, on two machines (perf-history.md v50)
SHARED_CARVEOUT: tuple[str, ...] = ()
# ... except launches that alone need more than this share of the SM (the attention decode's 2 blocks of 91 KB):
# the others would keep almost no L1 (the GEMVs at the largest carveout: +0.7% on the 27B, v43)
SHARED_CARVEOUT_MAX = 0.5

# The shared-memory capacities (KiB) an SM can be configured to (sm_80-sm_120; a GPU has those up to its
# max_smem_per_sm): the driver maps a preference to one of them, so share_carveout asks for one exactly.
CARVEOUT_KIB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)


class LaunchRecorder:
    """A Kernels stand-in that records each launch's (entry point, grid, block, dynamic smem) instead of
    enqueueing it: a step's dry run. Everything else is the wrapped Kernels'."""

    def __init__(self, kernels: Kernels):
        self.k, self.launches = kernels, []

    def launch(self, name: str, grid, block, args, smem: int = 0, stream=None, cluster=None) -> None:
        self.launches.append((name, grid, block, smem))

    def __getattr__(self, attr):
        return getattr(self.k, attr)


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
        self.shared_carveout = 0  # percent the shared entry points prefer (0: not planned yet)
        self.shared_names: set[str] = set()  # those entry points
        self._unshared: set[str] = set()  # planned entry points too large to share
        self._waves: dict[tuple, int] = {}  # waves(): launch shape -> waves

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
        """Let `name` launch with nbytes of dynamic shared memory: past the 48 KiB default, less the kernel's static
        shared memory, a kernel must opt in (once per larger size); more than the GPU allows per block is a one-line
        GpuError."""
        limit = self.gpu.info.max_smem_per_block_optin
        if nbytes > limit:
            raise GpuError(f"{name} needs {nbytes} bytes of shared memory; this GPU allows {limit}")
        if name not in self._smem:  # the default covers static and dynamic together
            self._smem[name] = 48 * 1024 - self.gpu.static_smem(self.fn(name))
        if nbytes > self._smem[name]:
            self.gpu.set_max_dynamic_smem(self.fn(name), nbytes)
            self._smem[name] = nbytes

    def waves(self, name: str, grid, block, smem: int = 0, cluster=None) -> int:
        """Waves a launch of `name` runs in here: its blocks (its clusters, with `cluster` dimensions) over how many
        the GPU holds at once (the driver's occupancy queries), memoised per launch shape."""
        key = (name, _dim3(grid), _dim3(block), int(smem), _dim3(cluster or 1))
        w = self._waves.get(key)
        if w is None:
            fn, n = self.fn(name), math.prod(key[1])
            if math.prod(key[4]) > 1:
                at_once = self.gpu.max_active_clusters(fn, key[1], key[2], smem, key[4])
                n //= math.prod(key[4])
            else:
                at_once = self.gpu.max_active_blocks(fn, math.prod(key[2]), smem) * self.gpu.info.sm_count
            if at_once < 1:
                raise GpuError(f"{name}: no block of {key[2]} threads and {smem} bytes of shared memory fits an SM")
            w = self._waves[key] = -(-n // at_once)
        return w

    @property
    def clusters(self) -> bool:
        """Whether kernels may launch in thread-block clusters here: compute capability 9.0+ running its own cubin
        from these images (a GPU newer than TARGETS runs the compute_80 PTX, with no sm_90 code compiled in)."""
        return self.gpu.info.major >= 9 and self.gpu.info.arch in self.build.targets

    def launch(self, name: str, grid, block, args, smem: int = 0, stream=None, cluster=None) -> None:
        """Launch entry point `name` (Gpu.launch: cluster gives thread-block cluster dimensions, sm_90+)."""
        want = SMEM_CARVEOUT
        if want is None:
            want = self.shared_carveout if self.shared_carveout and name in self.shared_names else -1
        if self._carveout.get(name, -1) != want:
            self.gpu.set_smem_carveout(self.fn(name), want)
            self._carveout[name] = want
        self.gpu.launch(self.fn(name), grid, block, args, smem, stream, cluster)

    def reset_shared_carveout(self) -> None:
        """Back to no shared carveout: every entry point's next launch takes the driver's choice until the next
        share_carveout."""
        self.shared_carveout, self.shared_names, self._unshared = 0, set(), set()

    def share_carveout(self, launches: list[tuple[str, object, object, int]]) -> int:
        """Raise shared_carveout to hold, for every launch among `launches` (LaunchRecorder's) whose entry point
        starts with one of SHARED_CARVEOUT, its blocks per SM (its grid over the SMs, at most its occupancy: a
        grid of several waves needs no more) with their dynamic, static and reserved shared memory: the smallest
        of CARVEOUT_KIB that does, as a percent of the SM's shared memory rounded up; entry points with a launch
        that alone needs more than SHARED_CARVEOUT_MAX of the SM keep the driver's choice. Returns it."""
        info = self.gpu.info
        if not SHARED_CARVEOUT or info.max_smem_per_sm <= 0:
            return self.shared_carveout
        needs: dict[str, int] = {}
        for name, grid, block, smem in launches:
            if not name.startswith(SHARED_CARVEOUT):
                continue
            blocks = math.prod(grid) if isinstance(grid, (tuple, list)) else int(grid)
            threads = math.prod(block) if isinstance(block, (tuple, list)) else int(block)
            fn = self.fn(name)
            per_sm = min(-(-blocks // info.sm_count), self.gpu.max_active_blocks(fn, threads, smem))
            needs[name] = max(needs.get(name, 0),
                              per_sm * (smem + self.gpu.static_smem(fn) + info.reserved_smem_per_block))
        limit = SHARED_CARVEOUT_MAX * info.max_smem_per_sm
        self._unshared |= {n for n, b in needs.items() if b > limit}
        shared = {n: b for n, b in needs.items() if n not in self._unshared}
        if not shared:
            return self.shared_carveout
        need = max(shared.values())
        cap = next((c for c in CARVEOUT_KIB if c * 1024 >= need), info.max_smem_per_sm // 1024)
        self.shared_carveout = max(self.shared_carveout, min(100, -(-100 * cap * 1024 // info.max_smem_per_sm)))
        self.shared_names = (self.shared_names | set(shared)) - self._unshared
        return self.shared_carveout
