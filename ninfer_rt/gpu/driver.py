"""The one module of ninfer-rt that talks to the CUDA driver (through cuda-python's `cuda.bindings.driver`).

Everything the GPU path needs from the driver lives here: the context, device memory, pinned host memory,
copies, streams, events, module loading, kernel launches and CUDA graph capture. The rest of ninfer_rt
handles plain ints for device pointers and calls these wrappers; no torch anywhere on this path.

Errors: a missing driver, missing cuda-python or no GPU is a GpuError with one line naming what is missing;
a failing driver call is a GpuError naming the call and the CUDA error.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ninfer_rt.errors import NinferError


class GpuError(NinferError):
    """A CUDA driver call failed (`code`: its CUresult's name, e.g. "CUDA_ERROR_OUT_OF_MEMORY"), or no usable
    GPU/driver/cuda-python is present (code None)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code

    @property
    def out_of_memory(self) -> bool:
        return self.code == "CUDA_ERROR_OUT_OF_MEMORY"


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise GpuError("cuda-python is not installed (pip install 'ninfer[gpu]' or cuda-python)") from None
    return driver


def _check(result, what: str):
    """cuda-python returns (CUresult, *values): raise on an error, else return the values (None, one, or a tuple)."""
    d = _driver()
    err, *vals = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        _, name = d.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        raise GpuError(f"{what} failed: {name}", name)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else tuple(vals)


# ------------------------------------------------------------------------------------------ kernel arguments

class KernelArgs:
    """Kernel parameters packed for cuLaunchKernel: an array of pointers to ctypes values.

    Arguments are given as ctypes instances (ptr(), i32(), f32(), i64()); the instances and the pointer array
    live as long as this object, and the driver copies them at launch (and at graph capture).
    """

    def __init__(self, values):
        self.values = list(values)
        self.array = (ctypes.c_void_p * max(1, len(self.values)))(
            *[ctypes.addressof(v) for v in self.values])

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def ptr(p: int) -> ctypes.c_uint64:
    """A device pointer argument (0 for a null pointer)."""
    return ctypes.c_uint64(int(p))


def i32(v: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def i64(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(v))


def f32(v: float) -> ctypes.c_float:
    return ctypes.c_float(float(v))


TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap): a TMA descriptor, passed to kernels by value


def tensor_map_2d(base: int, *, dtype: str, inner: int, rows: int, row_bytes: int, box_inner: int, box_rows: int,
                  swizzle_128b: bool = False):
    """A TMA descriptor (cuTensorMapEncodeTiled) of the 2-D tensor [rows, inner] of `dtype` ("u8" or "bf16") at
    device address base, rows row_bytes apart, copied in boxes of [box_rows, box_inner] (out-of-bounds elements
    read as zero), optionally with the 128-byte shared-memory swizzle. Returned as a ctypes value of its 128 bytes,
    for a kernel's __grid_constant__ parameter."""
    d = _driver()
    T = d.CUtensorMapDataType
    dt = {"u8": T.CU_TENSOR_MAP_DATA_TYPE_UINT8, "bf16": T.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16}[dtype]
    swz = d.CUtensorMapSwizzle
    u32, u64 = d.cuuint32_t, d.cuuint64_t
    tmap = _check(d.cuTensorMapEncodeTiled(
        dt, u32(2), int(base), [u64(int(inner)), u64(int(rows))], [u64(int(row_bytes))],
        [u32(int(box_inner)), u32(int(box_rows))], [u32(1), u32(1)],
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swz.CU_TENSOR_MAP_SWIZZLE_128B if swizzle_128b else swz.CU_TENSOR_MAP_SWIZZLE_NONE,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return (ctypes.c_ubyte * TENSOR_MAP_BYTES).from_buffer_copy(ctypes.string_at(int(tmap.getPtr()), TENSOR_MAP_BYTES))


def _dim3(v) -> tuple[int, int, int]:
    """A launch dimension (an int, or a tuple of up to 3 ints) as 3 ints, missing ones 1."""
    t = tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),)
    if not 1 <= len(t) <= 3:
        raise GpuError(f"a launch dimension has 1 to 3 components, got {v!r}")
    return t + (1,) * (3 - len(t))


# ------------------------------------------------------------------------------------------ objects

@dataclass
class DeviceInfo:
    name: str
    major: int
    minor: int
    sm_count: int
    total_memory: int
    l2_bytes: int
    max_smem_per_block_optin: int
    max_smem_per_sm: int = 0  # shared memory of one SM, shared by its resident blocks (0: unknown)
    reserved_smem_per_block: int = 1024  # shared memory the system takes from the SM for each resident block

    @property
    def arch(self) -> str:
        """The cubin target of this device: sm_90a for Hopper, sm_120a for Blackwell consumer, else sm_XY."""
        cc = self.major * 10 + self.minor
        return f"sm_{cc}a" if cc in (90, 100, 120) else f"sm_{cc}"


class Stream:
    def __init__(self, handle):
        self.handle = handle

    def synchronize(self) -> None:
        _check(_driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: "Event") -> None:
        """Later work on this stream waits for `event`'s last record (a graph edge while capturing)."""
        _check(_driver().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")


class Event:
    def __init__(self, timing: bool = True):
        d = _driver()
        flags = d.CUevent_flags.CU_EVENT_DEFAULT if timing else d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = _check(d.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        _check(_driver().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        _check(_driver().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            _check(_driver().cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None

    def elapsed_ms(self, later: "Event") -> float:
        """Milliseconds from this event to `later` (both recorded and complete)."""
        return float(_check(_driver().cuEventElapsedTime(self.handle, later.handle), "cuEventElapsedTime"))


class Module:
    """A loaded cubin/fatbin/PTX image; functions are looked up by their extern "C" name and cached."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name
        self._functions: dict[str, object] = {}

    def function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            fn = _check(_driver().cuModuleGetFunction(self.handle, name.encode()),
                        f"cuModuleGetFunction({self.name}:{name})")
            self._functions[name] = fn
        return fn

    def global_address(self, name: str) -> tuple[int, int]:
        """(device address, bytes) of the image's __device__ variable `name`."""
        dptr, nbytes = _check(_driver().cuModuleGetGlobal(self.handle, name.encode()),
                              f"cuModuleGetGlobal({self.name}:{name})")
        return int(dptr), int(nbytes)


class Graph:
    """An instantiated CUDA graph: replay with launch()."""

    def __init__(self, graph, exec_):
        self.graph, self.exec = graph, exec_

    def launch(self, stream: Stream) -> None:
        _check(_driver().cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        d = _driver()
        if self.exec is not None:
            d.cuGraphExecDestroy(self.exec)
            d.cuGraphDestroy(self.graph)
            self.exec = self.graph = None


class PinnedBuffer:
    """Page-locked host memory, viewed as a numpy uint8 array (`.array`)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.address = int(_check(_driver().cuMemHostAlloc(nbytes, 0), f"cuMemHostAlloc({nbytes})"))
        self.array = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(self.address), dtype=np.uint8)

    def free(self) -> None:
        if self.address:
            self.array = None
            _check(_driver().cuMemFreeHost(self.address), "cuMemFreeHost")
            self.address = 0


# ------------------------------------------------------------------------------------------ the context

class Gpu:
    """One device's primary context, with a default stream and tracked allocations.

    pdl: launch kernels with programmatic dependent launch, so each kernel's launch overlaps the end of the one
    before it (every kernel in kernels/ begins with ninfer_pdl_begin or _early, which waits for its predecessor). None
    turns it on for compute capability 9.0 and newer, where the hardware has it.
    """

    def __init__(self, index: int = 0, pdl: bool | None = None):
        d = _driver()
        try:
            _check(d.cuInit(0), "cuInit")
        except RuntimeError as e:  # cuda-python raises this when libcuda.so cannot be loaded
            raise GpuError(f"no CUDA driver on this machine ({e})") from None
        count = _check(d.cuDeviceGetCount(), "cuDeviceGetCount")
        if index >= count:
            raise GpuError(f"GPU {index} requested but {count} CUDA device(s) present")
        self.device = _check(d.cuDeviceGet(index), "cuDeviceGet")
        self.context = _check(d.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.make_current()
        self.info = self._info()
        self.pdl_capable = self.info.major >= 9 if pdl is None else bool(pdl)
        self.pdl = self.pdl_capable  # callers may switch it off for a stretch of launches (see GpuModel)
        self._pdl_attr = None
        self._cluster_attrs: dict[tuple[int, int, int], object] = {}
        if self.pdl_capable:
            a = d.CUlaunchAttribute()
            a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            self._pdl_attr = a
        self.stream = self.new_stream()
        self.allocated = 0
        self.peak_allocated = 0
        self._buffers: dict[int, int] = {}

    def new_stream(self, high_priority: bool = False) -> Stream:
        """A non-blocking stream of this context (the default one, or a side branch's). high_priority: at the
        greatest priority the context has, so that where both wait for SMs its blocks are placed before those of
        streams at the default (in a graph too, with end_capture(node_priority=True))."""
        d = _driver()
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        if not high_priority:
            return Stream(_check(d.cuStreamCreate(flags), "cuStreamCreate"))
        _, greatest = _check(d.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        return Stream(_check(d.cuStreamCreateWithPriority(flags, greatest), "cuStreamCreateWithPriority"))

    def make_current(self) -> None:
        _check(_driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _info(self) -> DeviceInfo:
        d = _driver()
        A = d.CUdevice_attribute

        def attr(a):
            return int(_check(d.cuDeviceGetAttribute(a, self.device), "cuDeviceGetAttribute"))

        name = _check(d.cuDeviceGetName(256, self.device), "cuDeviceGetName")
        name = name.split(b"\0", 1)[0].decode(errors="replace")
        return DeviceInfo(
            name=name,
            major=attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            minor=attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            sm_count=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            total_memory=int(_check(d.cuDeviceTotalMem(self.device), "cuDeviceTotalMem")),
            l2_bytes=attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            max_smem_per_block_optin=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            max_smem_per_sm=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
            reserved_smem_per_block=attr(A.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK),
        )

    # --- memory
    def alloc(self, nbytes: int) -> int:
        """A device allocation of nbytes (at least 1); returns its address. Freed with free()."""
        nbytes = max(int(nbytes), 1)
        p = int(_check(_driver().cuMemAlloc(nbytes), f"cuMemAlloc({nbytes} bytes)"))
        self._buffers[p] = nbytes
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return p

    def free(self, p: int) -> None:
        n = self._buffers.pop(int(p), None)
        if n is not None:
            _check(_driver().cuMemFree(int(p)), "cuMemFree")
            self.allocated -= n

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory as the driver reports them."""
        free, total = _check(_driver().cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def upload(self, dst: int, array: np.ndarray, stream: Stream | None = None) -> None:
        """Copy a host array into device memory at dst, ordered on `stream` (default: the context's stream).

        From pageable memory the driver stages the bytes before returning, so the array may be reused at once;
        from pinned memory the copy is asynchronous and the caller keeps the buffer until an event says done.
        """
        a = np.ascontiguousarray(array)
        if a.nbytes == 0:
            return
        s = stream or self.stream
        _check(_driver().cuMemcpyHtoDAsync(int(dst), a.ctypes.data, a.nbytes, s.handle), "cuMemcpyHtoDAsync")

    def download(self, src: int, shape, dtype) -> np.ndarray:
        """A new host array of shape/dtype copied from device memory at src (synchronous)."""
        out = np.empty(shape, dtype=dtype)
        if out.nbytes:
            self.stream.synchronize()
            _check(_driver().cuMemcpyDtoH(out.ctypes.data, int(src), out.nbytes), "cuMemcpyDtoH")
        return out

    def download_async(self, dst: PinnedBuffer, offset: int, src: int, nbytes: int,
                       stream: Stream | None = None) -> None:
        """Copy nbytes of device memory at src into pinned host memory at dst[offset:], ordered on `stream`;
        returns at once: the bytes are there once an event recorded after it completes."""
        if not (0 <= offset and offset + nbytes <= dst.nbytes):
            raise ValueError(f"download_async: {nbytes} bytes at {offset} past a {dst.nbytes}-byte buffer")
        s = stream or self.stream
        _check(_driver().cuMemcpyDtoHAsync(dst.address + offset, int(src), int(nbytes), s.handle),
               "cuMemcpyDtoHAsync")

    def copy(self, dst: int, src: int, nbytes: int, stream: Stream | None = None) -> None:
        """Device-to-device copy on a stream (the default stream if none)."""
        s = stream or self.stream
        _check(_driver().cuMemcpyDtoDAsync(int(dst), int(src), int(nbytes), s.handle), "cuMemcpyDtoDAsync")

    def memset(self, dst: int, byte: int, nbytes: int, stream: Stream | None = None) -> None:
        s = stream or self.stream
        _check(_driver().cuMemsetD8Async(int(dst), int(byte) & 0xFF, int(nbytes), s.handle), "cuMemsetD8Async")

    def synchronize(self) -> None:
        self.stream.synchronize()

    @contextmanager
    def profiled(self):
        """Only the work inside is profiled by a tool started with profiling off (`ncu --profile-from-start off`):
        cuProfilerStart before it, cuProfilerStop after it, the stream synchronized on both sides."""
        self.synchronize()
        _check(_driver().cuProfilerStart(), "cuProfilerStart")
        try:
            yield
        finally:
            self.synchronize()
            _check(_driver().cuProfilerStop(), "cuProfilerStop")

    # --- code
    def load_module(self, image: bytes, name: str = "module") -> Module:
        """Load a cubin, fatbin or NUL-terminated PTX image."""
        h = _check(_driver().cuModuleLoadData(image), f"cuModuleLoadData({name})")
        return Module(h, name)

    def set_max_dynamic_smem(self, fn, nbytes: int) -> None:
        d = _driver()
        attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(d.cuFuncSetAttribute(fn, attr, int(nbytes)), "cuFuncSetAttribute")

    def set_smem_carveout(self, fn, percent: int) -> None:
        """Prefer `percent` of the SM's unified L1 / shared memory as shared memory for fn (-1: the driver's
        choice). An SM runs one split at a time, so it can switch only when no block is resident."""
        d = _driver()
        attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        _check(d.cuFuncSetAttribute(fn, attr, int(percent)), "cuFuncSetAttribute(carveout)")

    def static_smem(self, fn) -> int:
        """Bytes of static shared memory fn declares (beside a launch's dynamic shared memory)."""
        d = _driver()
        attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        return int(_check(d.cuFuncGetAttribute(attr, fn), "cuFuncGetAttribute(shared size)"))

    def max_active_blocks(self, fn, threads: int, smem: int) -> int:
        """Blocks of fn (threads each, smem bytes of dynamic shared memory) one SM can hold at once."""
        n = _check(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, int(threads), int(smem)),
                   "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return int(n)

    def max_active_clusters(self, fn, grid, block, smem: int, cluster) -> int:
        """Clusters of fn (cluster dimensions as `launch` takes them, block threads, smem bytes of dynamic shared
        memory) the whole GPU can hold at once: a grid of more clusters runs in waves (compute capability 9.0+)."""
        d = _driver()
        cfg = d.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = _dim3(grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = _dim3(block)
        cfg.sharedMemBytes, cfg.hStream = int(smem), self.stream.handle
        attrs = [self._cluster_attr(_dim3(cluster))]
        cfg.attrs, cfg.numAttrs = attrs, len(attrs)
        return int(_check(d.cuOccupancyMaxActiveClusters(fn, cfg), "cuOccupancyMaxActiveClusters"))

    def launch(self, fn, grid, block, args, smem: int = 0, stream: Stream | None = None, cluster=None) -> None:
        """Launch fn on grid × block (ints or up-to-3 tuples) with ctypes-valued args on a stream.

        cluster: thread-block cluster dimensions (an int for (n, 1, 1), or an up-to-3 tuple; compute capability
        9.0+), each dividing the grid's; None or 1 launches no clusters. A cluster launch goes through
        cuLaunchKernelEx with the cluster-dimension attribute, beside the PDL attribute when PDL is on.
        """
        g, b = _dim3(grid), _dim3(block)
        c = _dim3(cluster if cluster is not None else 1)
        if min(g) < 1:
            return  # an empty problem: nothing to launch
        if min(c) < 1 or any(gi % ci for gi, ci in zip(g, c)):
            raise GpuError(f"cluster dimensions {c} must be >= 1 and divide the grid {g}")
        attrs = [self._pdl_attr] if self.pdl else []
        if c != (1, 1, 1):
            attrs.append(self._cluster_attr(c))
        packed = KernelArgs(args)
        s = stream or self.stream
        d = _driver()
        if not attrs:
            _check(d.cuLaunchKernel(fn, *g, *b, int(smem), s.handle, packed.address, 0), "cuLaunchKernel")
            return
        cfg = d.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
        cfg.sharedMemBytes, cfg.hStream = int(smem), s.handle
        cfg.attrs, cfg.numAttrs = attrs, len(attrs)
        _check(d.cuLaunchKernelEx(cfg, fn, packed.address, 0), "cuLaunchKernelEx")

    def _cluster_attr(self, dims: tuple[int, int, int]):
        """The cluster-dimension launch attribute for dims, made once per shape."""
        a = self._cluster_attrs.get(dims)
        if a is None:
            d = _driver()
            a = d.CUlaunchAttribute()
            a.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = dims
            self._cluster_attrs[dims] = a
        return a

    # --- graphs
    def begin_capture(self, stream: Stream | None = None) -> None:
        d = _driver()
        mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(d.cuStreamBeginCapture((stream or self.stream).handle, mode), "cuStreamBeginCapture")

    def end_capture(self, stream: Stream | None = None, node_priority: bool = False) -> Graph:
        """The captured graph, instantiated. node_priority: each kernel node runs at the priority its stream had
        during capture, not at the priority of the stream the graph is launched into."""
        d = _driver()
        graph = _check(d.cuStreamEndCapture((stream or self.stream).handle), "cuStreamEndCapture")
        flags = int(d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY) if node_priority else 0
        exec_ = _check(d.cuGraphInstantiate(graph, flags), "cuGraphInstantiate")
        return Graph(graph, exec_)
