"""A chain of M = 1 stream GEMVs in one resident grid (kernels/chain.cu chain_gemv_q8): the persistent decode
kernel's first op family.

A decode step is hundreds of short launches; each boundary costs a launch's ramp-up, its predecessor's drain and
the wait between them (perf.md "Where 900 tok/s must come from"). Here op i of a chain waits on a counter of op
i - 1's block arrivals instead, with its first weight tiles already in flight. Each op is exactly gemv_q8_s1 with
x copied by cp.async, so a chain's outputs equal linear.gemv's launches at the same blocks and d to the bit
(`sequential`). q8 weights, one activation row, store or add: the 35B's attention and DeltaNet projections.
Measured (perf.md v111): the waits cost 0.6-0.8 µs a boundary more than the launches they replace, which sit only
~0.6 µs a boundary above the same stream without waits (NO_WAIT); a measuring tool, not a decode path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ninfer_rt.gpu import linear
from ninfer_rt.gpu.driver import GpuError, i32, ptr
from ninfer_rt.gpu.weights import DeviceWeight

KERNEL = "chain_gemv_q8"
THREADS = 256
MAX_BLOCKS_PER_SM = 2  # the kernel's launch bounds
# kernels/chain.cu ChainGemv: six pointers, then N, K, kp, gshift, mode, d, eps and a pad (80 bytes)
CHAIN_GEMV = np.dtype([("qs", "<u8"), ("qh", "<u8"), ("sc", "<u8"), ("x", "<u8"), ("y", "<u8"), ("norm_w", "<u8"),
                       ("N", "<i4"), ("K", "<i4"), ("kp", "<i4"), ("gshift", "<i4"), ("mode", "<i4"), ("d", "<i4"),
                       ("eps", "<f4"), ("pad", "<i4")])
_CHAIN_MODES = ("store", "add")
# how an op waits for the one before (kernels/chain.cu ChainWait): 0 polls the arrivals' counter, 1 the same with a
# sleep between polls, 2 a flag the last arrival sets (perf.md v111: 0 is the fastest); 3 no wait, for ops that
# read nothing any op writes (chain_bench's bound: the weight stream without its waits)
WAITS = (0, 1, 2, 3)
NO_WAIT = 3


@dataclass(frozen=True)
class ChainOp:
    """y = W x̂ (store) or y += W x̂ (add), x̂ = rmsnorm(x) · (1 + norm_w) where norm_w, else x (device pointers,
    fp32, one row; x and norm_w 16-byte aligned)."""

    w: DeviceWeight
    x: int
    y: int
    mode: str = "store"
    norm_w: int = 0
    eps: float = 1e-6


@dataclass(frozen=True)
class ChainPlan:
    """The chain's launch: `blocks` resident blocks, `smem` dynamic shared memory, each op's register-tile depth."""

    blocks: int
    smem: int
    d: tuple[int, ...]


def _op_smem(op: ChainOp) -> int:
    # the op's x̂ slab (int16 chunk records) and its fp32 copies of x and norm_w (kernels/gemv_stream.cuh, xvec 2)
    k = op.w.shape[1]
    return (k // 32) * linear.x_chunk_bytes(1, True) + 4 * k * (2 if op.norm_w else 1)


def check_ops(ops: list[ChainOp]) -> None:
    """One-line GpuErrors for what the kernel cannot run: q8 weights, store or add, aligned x and norm_w."""
    if not ops:
        raise GpuError("a GEMV chain needs at least one op")
    for i, op in enumerate(ops):
        w = op.w
        linear._check_matrix(w, f"chain op {i}")
        if not (w.quantized and w.bits == 8):
            raise GpuError(f"{w.name}: the GEMV chain takes q8 weights only, got {w.fmt}")
        if op.mode not in _CHAIN_MODES:
            raise GpuError(f"{w.name}: a chain op's mode is store or add, got {op.mode!r}")
        if not op.x or not op.y or op.x % 16 or op.norm_w % 16:
            raise GpuError(f"{w.name}: a chain op needs device pointers x and y, x and norm_w 16-byte aligned; "
                           f"got x={op.x:#x}, y={op.y:#x}, norm_w={op.norm_w:#x}")
        if w.shape[1] > linear._stream_k_cap(w):
            raise GpuError(f"{w.name}: a chain op stages all of K in shared memory, K <= {linear._stream_k_cap(w)}")


def plan_chain(k, ops: list[ChainOp], blocks: int | None = None) -> ChainPlan:
    """The grid every op shares: as many blocks as the GPU holds at once with the largest op's shared memory (at
    most MAX_BLOCKS_PER_SM an SM, or `blocks`), each op at its stream plan's register-tile depth."""
    check_ops(ops)
    smem = max(_op_smem(op) for op in ops)
    k.opt_in_smem(KERNEL, smem)
    sms = k.gpu.info.sm_count
    resident = min(k.gpu.max_active_blocks(k.fn(KERNEL), THREADS, smem), MAX_BLOCKS_PER_SM) * sms
    if blocks is None:
        blocks = resident
    if not 1 <= blocks <= resident:
        raise GpuError(f"a GEMV chain's blocks must all be resident: 1..{resident} here, got {blocks}")
    return ChainPlan(blocks=blocks, smem=smem, d=tuple(linear.plan_stream(op.w, sms).d for op in ops))


def pack_ops(ops: list[ChainOp], plan: ChainPlan) -> np.ndarray:
    """The ops as the kernel's ChainGemv records."""
    rec = np.zeros(len(ops), CHAIN_GEMV)
    for i, op in enumerate(ops):
        qs, qh, sc = op.w.planes()
        n, kk = op.w.shape
        rec[i] = (qs, qh, sc, op.x, op.y, op.norm_w, n, kk, op.w.kp, int(op.w.group).bit_length() - 1,
                  _CHAIN_MODES.index(op.mode), plan.d[i], op.eps, 0)
    return rec


def independent(ops: list[ChainOp]) -> bool:
    """Whether no op reads (x, norm_w) or writes (y) bytes that another op writes: each y apart from every y and
    every input but its own op's (an add reads its own y)."""
    ys = [(op.y, op.y + 4 * op.w.shape[0]) for op in ops]
    ins = [(op.x, op.x + 4 * op.w.shape[1]) for op in ops] + [(op.norm_w, op.norm_w + 4 * op.w.shape[1])
                                                               for op in ops if op.norm_w]
    return all(not (a < e and s < b) for i, (a, b) in enumerate(ys) for j, (s, e) in enumerate(ys + ins)
               if j != i)


class Chain:
    """A planned chain on the device: its op records and counters, launched as one kernel (capturable: the
    counters are zeroed by a memset node before each launch)."""

    def __init__(self, k, ops: list[ChainOp], blocks: int | None = None, how: int = 0):
        if how not in WAITS:
            raise GpuError(f"a chain's wait is one of {', '.join(map(str, WAITS))}, got {how}")
        if how == NO_WAIT and not independent(ops):
            raise GpuError("a chain without waits takes only ops that read nothing an op writes")
        self.k, self.ops, self.how = k, list(ops), how
        self.plan = plan_chain(k, self.ops, blocks)
        rec = pack_ops(self.ops, self.plan)
        self.records = k.gpu.alloc(rec.nbytes)
        self.done = k.gpu.alloc(8 * len(self.ops))  # counters, then flags
        k.gpu.upload(self.records, rec)

    def launch(self, stream=None) -> None:
        gpu = self.k.gpu
        gpu.memset(self.done, 0, 8 * len(self.ops), stream)
        self.k.launch(KERNEL, (self.plan.blocks,), (THREADS,),
                      [ptr(self.records), i32(len(self.ops)), ptr(self.done), i32(self.how)], self.plan.smem, stream)

    def free(self) -> None:
        self.k.gpu.free(self.records)
        self.k.gpu.free(self.done)


def sequential(k, ops: list[ChainOp], plan: ChainPlan, stream=None) -> None:
    """The same ops as one gemv_q8_s1 launch each (linear.gemv's kernel, x copied by cp.async) at the chain's
    blocks and depths: the launches a chain replaces, and its bit-exact oracle."""
    sms = k.gpu.info.sm_count
    for op, d in zip(ops, plan.d):
        p = replace(linear.plan_stream(op.w, sms, d=d), blocks=plan.blocks)  # the chain's row split, even past N/4
        linear._launch_gemv(k, op.w, p, x=op.x, y=op.y, ldx=op.w.shape[1], ldy=op.w.shape[0], mode=op.mode,
                            norm_w=op.norm_w, norm_eps=op.eps, row_scale=0, stream=stream, x_copy=True,
                            x_bulk=False)
