"""Weights onto the GPU: an artifact's bytes streamed into one device arena, or synthetic weights of a recipe.

The artifact's tensor bytes already are the kernels' layout, so loading is a copy: tensors of the wanted
groups are packed back to back (256-byte aligned) into one allocation, through two pinned staging buffers
so the disk read of one chunk overlaps the copy of the previous one. Matrices stay as stored; the small
1-D parameters (norm weights, A_log, dt_bias) and the tap-major conv weight are decoded to fp32 on the host
(exact) into a second, small arena, because the kernels read them as fp32 whatever the recipe chose.

`synthetic_weights` builds the same arena for a config + recipe without a file: random codes, valid fp16
scales and bf16 values (never zeros: zeros can run faster than real data), for `ninfer-rt bench --synthetic`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ninfer_rt.formats import f32_to_bf16_bits, get_format, round_up
from ninfer_rt.gpu.driver import Event, Gpu, PinnedBuffer
from ninfer_rt.gpu.weights import DeviceWeight

ALIGN = 256
STAGE_BYTES = 64 << 20  # per pinned staging buffer; two alternate


def is_small_param(name: str, shape) -> bool:
    """Tensors the kernels read as fp32 vectors: every 1-D tensor, and the DeltaNet conv weight [Kc, C]."""
    return len(shape) == 1 or name.endswith("linear_attn.conv1d.weight")


@dataclass
class DeviceWeights:
    """Everything the engine reads: matrices in artifact layout (by artifact name) and fp32 small params."""

    matrices: dict[str, DeviceWeight] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)   # name -> device address of fp32 values
    arena: int = 0
    arena_bytes: int = 0
    params_arena: int = 0
    params_bytes: int = 0
    load_s: float = 0.0

    def matrix(self, name: str) -> DeviceWeight:
        w = self.matrices.get(name)
        if w is None:
            from ninfer_rt.errors import FormatError
            raise FormatError(f"the artifact has no tensor {name}")
        return w

    def param(self, name: str) -> int:
        p = self.params.get(name)
        if p is None:
            from ninfer_rt.errors import FormatError
            raise FormatError(f"the artifact has no tensor {name}")
        return p

    def free(self, gpu: Gpu) -> None:
        for p in (self.arena, self.params_arena):
            if p:
                gpu.free(p)
        self.arena = self.params_arena = 0


def _layout(entries) -> tuple[dict[str, int], int]:
    """Offsets of tensors packed back to back in an arena, each 256-byte aligned; and the total size."""
    offsets, off = {}, 0
    for name, nbytes in entries:
        offsets[name] = off
        off = round_up(off + nbytes, ALIGN)
    return offsets, max(off, ALIGN)


def _upload_params(gpu: Gpu, small: dict[str, np.ndarray], out: DeviceWeights) -> None:
    offsets, total = _layout((n, a.size * 4) for n, a in small.items())
    out.params_arena, out.params_bytes = gpu.alloc(total), total
    host = np.zeros(total, np.uint8)
    for n, a in small.items():
        host[offsets[n]:offsets[n] + a.size * 4] = np.ascontiguousarray(a, np.float32).reshape(-1).view(np.uint8)
        out.params[n] = out.params_arena + offsets[n]
    gpu.upload(out.params_arena, host)


def load_artifact(gpu: Gpu, artifact, groups=("text",), progress=None) -> DeviceWeights:
    """Copy the artifact's tensors of `groups` to the device. progress(done_bytes, total_bytes) is called
    as chunks land. The tied lm_head is the embedding's entry (no copy)."""
    t0 = time.perf_counter()
    wanted = [e for e in artifact.tensors.values() if e.group in groups]
    mats = [e for e in wanted if not is_small_param(e.name, e.shape)]
    small = {e.name: artifact.decode(e.name) for e in wanted if is_small_param(e.name, e.shape)}
    out = DeviceWeights()
    offsets, total = _layout((e.name, e.nbytes) for e in mats)
    out.arena, out.arena_bytes = gpu.alloc(total), total
    to_copy = sum(e.nbytes for e in mats)
    stages = [PinnedBuffer(STAGE_BYTES), PinnedBuffer(STAGE_BYTES)]
    done_ev = [Event(), Event()]
    used = [False, False]
    done, turn = 0, 0
    try:
        for e in mats:
            raw = artifact.raw(e.name)
            dst = out.arena + offsets[e.name]
            for i in range(0, e.nbytes, STAGE_BYTES):
                n = min(STAGE_BYTES, e.nbytes - i)
                if used[turn]:
                    done_ev[turn].synchronize()  # the copy that last used this buffer has finished
                stages[turn].array[:n] = np.frombuffer(raw[i:i + n], dtype=np.uint8)
                gpu.upload(dst + i, stages[turn].array[:n], stream=gpu.stream)
                done_ev[turn].record(gpu.stream)
                used[turn] = True
                turn ^= 1
                done += n
                if progress:
                    progress(done, to_copy)
            out.matrices[e.name] = DeviceWeight(e.name, e.format, tuple(e.shape), dst)
        gpu.synchronize()
    finally:
        for s in stages:
            s.free()
    _upload_params(gpu, small, out)
    out.load_s = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------- synthetic


def synthetic_table(spec, recipe, groups: tuple[str, ...] = ("text",)) -> list[tuple[str, tuple[int, ...], str]]:
    """(artifact name, shape, format) of every tensor of `groups` a checkpoint of `spec` packed with `recipe` has."""
    from ninfer_rt.layout import plan_tensors
    from ninfer_rt.recipe import resolve_plans

    info = spec.tensor_shapes()
    shapes = {n: tuple(i.shape) for n, i in info.items() if i.group in groups}
    plans = plan_tensors(spec, list(shapes), shapes)
    formats, _ = resolve_plans(recipe, plans, shapes)
    return [(p.name, tuple(p.shape), formats[p.name]) for p in plans]


class _Filler:
    """Fills device memory with valid random data by tiling pre-uploaded random blocks (fast for 20+ GB)."""

    BLOCK = 32 << 20

    def __init__(self, gpu: Gpu, rng: np.random.Generator):
        self.gpu = gpu
        raw = rng.integers(0, 256, self.BLOCK, dtype=np.uint8)
        # fp16 scales of a plausible magnitude; bf16 values ~N(0, 0.02)
        scales = (rng.uniform(0.5, 1.5, self.BLOCK // 2) * 2e-3).astype(np.float16).view(np.uint8)
        bf16 = f32_to_bf16_bits(rng.standard_normal(self.BLOCK // 2).astype(np.float32) * 0.02).view(np.uint8)
        self.blocks = {}
        for kind, host in (("bytes", raw), ("f16", scales), ("bf16", bf16)):
            p = gpu.alloc(self.BLOCK)
            gpu.upload(p, host)
            self.blocks[kind] = p

    def fill(self, dst: int, nbytes: int, kind: str, phase: int) -> None:
        src, off = self.blocks[kind], (phase * 4096) % (self.BLOCK // 2)
        i = 0
        while i < nbytes:
            n = min(nbytes - i, self.BLOCK - off)
            self.gpu.copy(dst + i, src + off, n)
            i += n
            off = 0

    def free(self) -> None:
        for p in self.blocks.values():
            self.gpu.free(p)


def _synthetic_small(name: str, shape, rng) -> np.ndarray:
    if name.endswith("A_log"):
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(-1, 1, shape).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)
    if name.endswith("linear_attn.norm.weight"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    return (rng.standard_normal(shape) * 0.05).astype(np.float32)  # zero-centred norm weights


def synthetic_weights(gpu: Gpu, spec, recipe, seed: int = 0, progress=None,
                      groups: tuple[str, ...] = ("text",)) -> DeviceWeights:
    """Random weights of the exact shapes and formats `recipe` gives a checkpoint of `spec`'s tensor `groups`,
    on the device."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    table = synthetic_table(spec, recipe, groups)
    mats = [(n, s, f) for n, s, f in table if not is_small_param(n, s)]
    offsets, total = _layout((n, get_format(f).nbytes(s)) for n, s, f in mats)
    out = DeviceWeights()
    out.arena, out.arena_bytes = gpu.alloc(total), total
    filler = _Filler(gpu, rng)
    try:
        done = 0
        for i, (name, shape, fmt) in enumerate(mats):
            base = out.arena + offsets[name]
            f = get_format(fmt)
            for p in f.planes(shape):
                # fp16 scales and raw bf16/f16 values must be finite; codes may be any bytes
                kind = "f16" if p.name == "scales" else {"bf16": "bf16", "f16": "f16"}.get(fmt, "bytes")
                filler.fill(base + p.offset, p.nbytes, kind, i)
            out.matrices[name] = DeviceWeight(name, fmt, shape, base)
            done += f.nbytes(shape)
            if progress:
                progress(done, total)
        gpu.synchronize()
    finally:
        filler.free()
    _upload_params(gpu, {n: _synthetic_small(n, s, rng) for n, s, _ in table if is_small_param(n, s)}, out)
    out.load_s = time.perf_counter() - t0
    return out


def fill_random(gpu: Gpu, dst: int, nbytes: int, kind: str, seed: int = 0) -> None:
    """Valid random contents for a cache region: kind 'bytes' (int8 codes), 'bf16' or 'f32' (positive, ~0.01)."""
    rng = np.random.default_rng(seed)
    n = min(nbytes, 16 << 20)
    if kind == "bytes":
        host = rng.integers(0, 256, n, dtype=np.uint8)
    elif kind == "bf16":
        host = f32_to_bf16_bits(rng.standard_normal(n // 2).astype(np.float32)).view(np.uint8)
    else:
        host = (rng.uniform(0.5, 1.5, n // 4).astype(np.float32) * 0.01).view(np.uint8)
    blk = gpu.alloc(host.nbytes)
    try:
        gpu.upload(blk, host)
        for i in range(0, nbytes, host.nbytes):
            gpu.copy(dst + i, blk, min(host.nbytes, nbytes - i))
        gpu.synchronize()
    finally:
        gpu.free(blk)

