"""The GEMV chain's host side (ninfer_rt/gpu/chain.py) on a made-up GPU, no GPU needed: the op records against the
kernel's struct in kernels/chain.cu, the grid and shared memory the plan takes, and one-line refusals."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ninfer_rt.gpu import chain, linear
from ninfer_rt.gpu.build import kernels_dir
from ninfer_rt.gpu.driver import GpuError
from ninfer_rt.gpu.weights import DeviceWeight
from tests.test_gpu_plans import fake_kernels

A = 1 << 32  # a made-up device address, 256-byte aligned


def w(fmt: str, n: int, k: int, base: int = A) -> DeviceWeight:
    return DeviceWeight("w", fmt, (n, k), base)


def test_op_records_lay_out_as_the_kernel_s_struct():
    """CHAIN_GEMV's fields are ChainGemv's members in order (8-byte pointers, then 4-byte ints and the float), and
    its size is the one the kernel's static_assert pins: a field out of step would feed every op wrong values."""
    src = (kernels_dir() / "chain.cu").read_text()
    body = re.search(r"struct ChainGemv \{(.*?)\n\};", src, re.S).group(1)
    members = []
    for line in body.splitlines():
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:
            kind, names = re.match(r"((?:const )?\w+\*?)\s+(.*)", decl).groups()
            members += [(n.strip(), 8 if kind.endswith("*") else 4) for n in names.split(",")]
    assert [(n, chain.CHAIN_GEMV[n].itemsize) for n in chain.CHAIN_GEMV.names] == members
    size = int(re.search(r"static_assert\(sizeof\(ChainGemv\) == (\d+)", src).group(1))
    assert chain.CHAIN_GEMV.itemsize == size == sum(b for _, b in members)


def test_plan_takes_the_resident_grid_the_largest_op_s_memory_and_each_op_s_depth():
    """Blocks: what the GPU holds at once, at most 2 an SM (the launch bounds); shared memory: the largest op's slab
    and copies of x (and norm_w); d: each op's own stream plan."""
    k = fake_kernels(9, 0, sm_count=132, smem_optin=227 * 1024, blocks_per_sm=3)
    ops = [chain.ChainOp(w("q8g32", 12288, 2048), A, A, "store", A), chain.ChainOp(w("q8g32", 2048, 4096), A, A, "add"),
           chain.ChainOp(w("q8g64", 64, 128), A, A)]
    plan = chain.plan_chain(k, ops)
    assert plan.blocks == 2 * 132
    rec = linear.x_chunk_bytes(1, True)
    assert plan.smem == max(2048 // 32 * rec + 8 * 2048, 4096 // 32 * rec + 4 * 4096)
    assert plan.d == tuple(linear.plan_stream(op.w, 132).d for op in ops) == (2, 2, 1)
    assert chain.plan_chain(fake_kernels(9, 0, sm_count=10, smem_optin=227 * 1024, blocks_per_sm=1), ops).blocks == 10
    assert chain.plan_chain(k, ops, blocks=5).blocks == 5


def test_pack_ops_writes_each_op_s_planes_shape_group_and_mode():
    ops = [chain.ChainOp(w("q8g64", 300, 512), A + 256, A + 512, "add", 0, 1e-5),
           chain.ChainOp(w("q8g128", 96, 256), A + 1024, A + 2048, "store", A + 4096)]
    rec = chain.pack_ops(ops, chain.ChainPlan(blocks=7, smem=0, d=(2, 1)))
    for r, op, d in zip(rec, ops, (2, 1)):
        assert (int(r["qs"]), int(r["qh"]), int(r["sc"])) == op.w.planes()
        assert (int(r["x"]), int(r["y"]), int(r["norm_w"])) == (op.x, op.y, op.norm_w)
        assert (r["N"], r["K"], r["kp"], r["d"]) == (*op.w.shape, op.w.kp, d)
        assert 1 << int(r["gshift"]) == op.w.group
        assert r["mode"] == linear.MODES[op.mode] and r["eps"] == np.float32(op.eps)


@pytest.mark.parametrize("ops,match", [
    ([], "at least one op"),
    ([chain.ChainOp(w("q4g64", 64, 256), A, A)], "q8 weights only"),
    ([chain.ChainOp(w("bf16", 64, 256), A, A)], "q8 weights only"),
    ([chain.ChainOp(w("q8g32", 64, 256), A, A, "swiglu")], "store or add"),
    ([chain.ChainOp(w("q8g32", 64, 256), A + 4, A)], "16-byte aligned"),
    ([chain.ChainOp(w("q8g32", 64, 256), A, A, "store", A + 8)], "16-byte aligned"),
    ([chain.ChainOp(w("q8g32", 64, 256), 0, A)], "device pointers"),
    ([chain.ChainOp(w("q8g32", 64, 32768), A, A)], "K <="),
])
def test_what_the_kernel_cannot_run_is_a_one_line_error(ops, match):
    with pytest.raises(GpuError, match=match) as e:
        chain.check_ops(ops)
    assert "\n" not in str(e.value)


def test_a_grid_past_the_resident_blocks_is_refused():
    k = fake_kernels(9, 0, sm_count=4, smem_optin=227 * 1024, blocks_per_sm=2)
    ops = [chain.ChainOp(w("q8g32", 64, 256), A, A)]
    with pytest.raises(GpuError, match=r"resident: 1\.\.8 here, got 9"):
        chain.plan_chain(k, ops, blocks=9)


def test_only_ops_apart_from_each_other_s_outputs_run_without_waits():
    """A layer chain (each in_proj writing what out_proj reads, out_proj adding into what in_proj reads) is not
    independent, and a chain of it without waits is refused before anything reaches the GPU; ops on their own
    buffers are (an add reading its own y is not another op's output)."""
    layer = [chain.ChainOp(w("q8g32", 768, 256), A, A + 4096, "store", A + 8192),
             chain.ChainOp(w("q8g32", 256, 512), A + 4096, A, "add")]
    assert not chain.independent(layer)
    apart = [chain.ChainOp(w("q8g32", 768, 256), A, A + 4096, "store", A + 8192),
             chain.ChainOp(w("q8g32", 256, 512), A + 16384, A + 32768, "add")]
    assert chain.independent(apart)
    assert not chain.independent([apart[0], chain.ChainOp(w("q8g32", 64, 256), A + 16384, A + 8192 + 512)])
    with pytest.raises(GpuError, match="without waits"):
        chain.Chain(None, layer, how=chain.NO_WAIT)
