"""The GPU runtime's launch plans on a made-up GPU, no GPU needed: shared-memory opt-ins, the fused MoE's plan, the
routed gate/up's build per row count, the sampler's, the DeltaNet step's clusters and the prefill kernels' plans for
each target GPU, and the kernels' shared-memory carveout."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_rt.gpu.build import TARGETS

def fake_kernels(major: int, minor: int, targets=TARGETS, *, sm_count: int = 132, smem_optin: int = 0,
                 blocks_per_sm: int = 2, clusters_at_once: int = 1 << 20):
    """A Kernels on a made-up GPU of compute capability major.minor whose images were built for `targets`, with
    sm_count SMs and smem_optin bytes of shared memory a block may opt into, 1280 bytes of static shared memory in
    every entry point, blocks_per_sm blocks of any entry point an SM and clusters_at_once clusters of any entry
    point on the GPU (or {cluster size: clusters}); its launches are recorded in k.gpu.launches as (entry point,
    grid, block, cluster), its opt-ins in k.gpu.opt_ins as (entry point, bytes)."""
    from pathlib import Path
    from types import SimpleNamespace

    from ninfer_rt.gpu.build import BuildResult
    from ninfer_rt.gpu.driver import DeviceInfo
    from ninfer_rt.gpu.kernels import Kernels

    class Module:
        def function(self, name):
            return name

    k = Kernels.__new__(Kernels)
    launches, smems = [], []  # smems: each launch's dynamic shared memory, in launch order
    opt_ins = []
    k.gpu = SimpleNamespace(info=DeviceInfo("fake", major, minor, sm_count, 0, 0, smem_optin), launches=launches,
                            launch=lambda fn, grid, block, args, smem, stream, cluster:
                            launches.append((fn, grid, block, cluster)) or smems.append(smem), smems=smems,
                            opt_ins=opt_ins,
                            set_max_dynamic_smem=lambda fn, nbytes: opt_ins.append((fn, nbytes)),
                            static_smem=lambda fn: 1280,
                            max_active_blocks=lambda fn, threads, smem: blocks_per_sm,
                            max_active_clusters=lambda fn, grid, block, smem, cluster:
                            clusters_at_once.get(cluster[0], 0) if isinstance(clusters_at_once, dict)
                            else clusters_at_once)
    k.build = BuildResult(Path("."), {}, "nvcc", tuple(targets), True)
    k.modules, k._fns, k._smem, k._carveout = [Module()], {}, {}, {}
    k.shared_carveout, k.shared_names, k._unshared, k._waves = 0, set(), set(), {}
    return k


def test_dynamic_shared_memory_opts_in_past_48_kb_less_the_static():
    """A launch may take 48 KiB of shared memory without opting in, static and dynamic together: an entry point
    with 1280 static bytes opts in from 47,873 dynamic bytes on (the 27B's gate|up stream GEMV at M = 4 takes
    48,640), once per larger size; past the GPU's per-block limit is a one-line error."""
    from ninfer_rt.gpu.driver import GpuError

    k = fake_kernels(9, 0, smem_optin=227 * 1024)
    k.opt_in_smem("gemv_q4_s4", 48 * 1024 - 1280)
    assert k.gpu.opt_ins == []
    k.opt_in_smem("gemv_q4_s4", 48640)
    k.opt_in_smem("gemv_q4_s4", 40000)
    k.opt_in_smem("gemv_q4_s4", 48640)
    k.opt_in_smem("gemv_q4_s4", 60000)
    assert k.gpu.opt_ins == [("gemv_q4_s4", 48640), ("gemv_q4_s4", 60000)]
    with pytest.raises(GpuError, match="^gemv_q4_s4 needs 300000 bytes of shared memory; this GPU allows 232448$"):
        k.opt_in_smem("gemv_q4_s4", 300000)


def test_fused_moe_plan_and_misuse():
    """moe.fused_kernel on a made-up GPU with the 35B's MoE shapes: the entry point named by the format triple,
    max(k·I/16, I/2, H/16) = 256 blocks, and dynamic shared memory max(2·H/32, (k+1)·I/32) int16 chunk records;
    None when the SMs cannot hold every block at once (the grid barrier would wait forever). moe.fused launches
    that plan and refuses misuse in one line before launching."""
    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.driver import GpuError
    from ninfer_rt.gpu.weights import DeviceWeight

    k = fake_kernels(9, 0, smem_optin=227 * 1024)
    k.gpu.max_active_blocks = lambda fn, threads, smem: 2
    ws = (DeviceWeight("gu", "q4g64", (256, 1024, 2048), 256), DeviceWeight("dn", "q5g64", (256, 2048, 512), 256),
          DeviceWeight("sgu", "q8g32", (1024, 2048), 256), DeviceWeight("sdn", "q8g32", (2048, 512), 256))
    plan = moe.fused_kernel(k, *ws, 8)
    assert plan == ("moe_fused_t2_q4g64_q5g64_q8g32", 256, max(2 * 2048 // 32, 9 * 512 // 32) * moe.QCHUNK)
    ok = dict(x=1 << 20, norm_w=1 << 21, eps=1e-6, logits=1 << 22, E=256, top_k=8, ids=1 << 23, weights=1 << 24,
              shared_scale=1 << 25, act=1 << 26, act_s=1 << 27, barrier=1 << 28)
    moe.fused(k, plan, *ws, **ok)
    assert k.gpu.launches == [(plan[0], 256, 256, None)]  # (entry point, grid, block, cluster)
    for change, what in [(dict(x=(1 << 20) + 4), "16-byte aligned"), (dict(barrier=0), "barrier is a null pointer"),
                         (dict(E=128), "holds 256 experts"), (dict(top_k=17), "top_k=17 outside")]:
        with pytest.raises(GpuError, match=what):
            moe.fused(k, plan, *ws, **{**ok, **change})
    k.gpu.max_active_blocks = lambda fn, threads, smem: 1  # 132 blocks at once: fewer than 256
    assert moe.fused_kernel(k, *ws, 8) is None


@pytest.mark.parametrize("fmt, M, blocks_per_sm, want", [
    ("q4g64", 1, 3, "moe_gate_up_routed_t2_q4g64"),  # one row: the one-row kernel (moe.fused runs it in the engine)
    ("q4g64", 2, 3, "moe_gate_up_routed_b3_t2_q4g64"),
    ("q5g64", 8, 3, "moe_gate_up_routed_b3_t2_q5g64"),
    ("q4g64", 2, 2, "moe_gate_up_routed_t2_q4g64"),  # 2: the planner's way back to the one-row kernel
    ("q4g32", 2, 3, "moe_gate_up_routed_t2_q4g32"),  # no b3 build of this format
])
def test_routed_gate_up_build_per_row_count(monkeypatch, fmt, M, blocks_per_sm, want):
    """moe.gate_up_routed of the 35B's bank [256, 1024, 2048] picks the build at 3 blocks an SM
    (moe.GATE_UP_BLOCKS_PER_SM) for several rows of a format that has one, on the same grid (M·k, 2I/32) and shared
    memory (H/32 records)."""
    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.weights import DeviceWeight

    monkeypatch.setattr(moe, "GATE_UP_BLOCKS_PER_SM", blocks_per_sm)
    k = fake_kernels(9, 0, smem_optin=227 * 1024)
    w = DeviceWeight("gu", fmt, (256, 1024, 2048), 256)
    moe.gate_up_routed(k, w, x=1 << 20, norm_w=1 << 21, eps=1e-6, logits=1 << 22, ld=257, M=M, E=256, top_k=8,
                       ids=1 << 23, weights=1 << 24, shared_scale=1 << 25, act=1 << 26)
    assert k.gpu.launches == [(want, (8 * M, 1024 // 32), 256, None)]


@pytest.mark.parametrize("fmt, M, blocks_per_sm, want", [
    ("q4g64", 1, 3, "moe_gate_up_routed_acc_t2_q4g64"),
    ("q4g64", 2, 3, "moe_gate_up_routed_acc_b3_t2_q4g64"),
    ("q5g64", 4, 2, "moe_gate_up_routed_acc_t2_q5g64"),
    ("q4g32", 2, 3, None),  # no _acc build of this format: refused, never launched
])
def test_routed_gate_up_on_a_router_fold(monkeypatch, fmt, M, blocks_per_sm, want):
    """v87: moe.gate_up_routed with acc (a router fold's rows) takes the _acc build of the kernel it would run on
    logits, acc as its last argument, and moe.acc_fits agrees; moe.down with the acc passes it and its row stride
    to the fast build, which zeroes the rows."""
    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.driver import GpuError
    from ninfer_rt.gpu.weights import DeviceWeight

    monkeypatch.setattr(moe, "GATE_UP_BLOCKS_PER_SM", blocks_per_sm)
    k = fake_kernels(9, 0, smem_optin=227 * 1024)
    args = []
    k.gpu.launch = lambda fn, grid, block, a, smem, stream, cluster: args.append((fn, grid, a))
    w = DeviceWeight("gu", fmt, (256, 1024, 2048), 256)
    dn = DeviceWeight("dn", "q5g64", (256, 2048, 512), 256)
    kw = dict(x=1 << 20, norm_w=1 << 21, eps=1e-6, logits=0, ld=264, M=M, E=256, top_k=8, ids=1 << 23,
              weights=1 << 24, shared_scale=1 << 25, act=1 << 26, acc=1 << 27)
    assert moe.acc_fits(w, 256, dn) == (want is not None)
    if want is None:
        with pytest.raises(GpuError, match="routing on a router fold needs a q4g64 or q5g64 bank"):
            moe.gate_up_routed(k, w, **kw)
        assert args == []
        return
    moe.gate_up_routed(k, w, **kw)
    moe.down(k, dn, act=1 << 26, ids=1 << 23, weights=1 << 24, M=M, top_k=8, y=1 << 20, acc=1 << 27, acc_ld=264)
    (gu_fn, gu_grid, gu_args), (_, dn_grid, dn_args) = args
    assert (gu_fn, gu_grid) == (want, (8 * M, 1024 // 32))
    assert gu_args[-1].value == gu_args[10].value == 1 << 27  # acc last; logits (unused) points at it too
    assert dn_grid == (M, 2048 // 8) and [a.value for a in dn_args[-2:]] == [1 << 27, 264]


@pytest.mark.parametrize("fmt, M, blocks_per_sm, want", [
    ("q5g64", 2, 3, "moe_down_b3_t1_q5g64"), ("q6g64", 4, 3, "moe_down_b3_t1_q6g64"),
    ("q5g64", 1, 3, "moe_down_t1_q5g64"),  # one row: the one-row build
    ("q5g64", 2, 2, "moe_down_t1_q5g64"),  # 2: the planner's way back to it
    ("q4g64", 2, 3, "moe_down_t1_q4g64"),  # no b3 build of this format
])
def test_down_build_per_row_count(monkeypatch, fmt, M, blocks_per_sm, want):
    """moe.down of the 35B's down bank [256, 2048, 512] picks the build at 3 blocks an SM (moe.DOWN_BLOCKS_PER_SM)
    for several rows of a format that has one, on the same grid (M, H/8) and shared memory (k·I/32 records)."""
    from ninfer_rt.gpu import moe
    from ninfer_rt.gpu.weights import DeviceWeight

    monkeypatch.setattr(moe, "DOWN_BLOCKS_PER_SM", blocks_per_sm)
    k = fake_kernels(9, 0, smem_optin=227 * 1024)
    w = DeviceWeight("dn", fmt, (256, 2048, 512), 256)
    moe.down(k, w, act=1 << 20, ids=1 << 21, weights=1 << 22, M=M, top_k=8, y=1 << 23)
    assert k.gpu.launches == [(want, (M, 2048 // 8), 256, None)]

def test_sampler_plan():
    """misc.sample on 2 rows of the family's 248,320-entry vocabulary: the histogram zeroed, then sample_hist and
    sample_compact over 31 segments of 8192 entries per row, then one sample_rows block per row; the scratch holds
    the histograms, the segment counts and a (key, index) slot for every entry. A vocabulary past 256 segments is
    refused in one line."""
    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.driver import GpuError
    k = fake_kernels(9, 0)
    memsets = []
    k.gpu.memset = lambda p, v, n, stream=None: memsets.append((p, v, n))
    V, M, scratch = 248320, 2, 1 << 30
    misc.sample(k, logits=1 << 20, ld=V, M=M, V=V, params=1 << 21, out=1 << 22, scratch=scratch)
    assert memsets == [(scratch, 0, M * 2048 * 4)]
    assert [(fn, grid, block) for fn, grid, block, _ in k.gpu.launches] == [
        ("sample_hist", (31, M), 512), ("sample_compact", (31, M), 512), ("sample_rows", M, 1024)]
    assert misc.sample_scratch_bytes(M, V) == M * (2048 * 4 + 31 * 4 + 4 + 31 * 8192 * 8)
    with pytest.raises(GpuError, match="exceeds"):
        misc.sample(k, logits=1 << 20, ld=257 * 8192, M=1, V=257 * 8192, params=1 << 21, out=1 << 22,
                    scratch=scratch)


def test_support_rows_decode_as_the_probs_rows_entries():
    """misc.split_support of a support row as sample_rows writes it (count, then (id, fp32 bits) by probability,
    highest first): the ids ascending with their fp32 values widened, exactly the probs row's entries > 0; a kept
    token whose probability rounded to 0 has none, and a count past the cap is refused in one line."""
    import numpy as np

    from ninfer_rt.gpu import misc
    from ninfer_rt.gpu.driver import GpuError
    rng = np.random.default_rng(3)
    V, ids = 5000, np.asarray([4011, 7, 2999, 12, 4999, 0], np.int64)
    probs = rng.random(ids.size).astype(np.float32)
    probs[3] = 0.0  # rounded to 0: listed by the kernel, absent from the probs row
    order = np.argsort(-probs, kind="stable")
    row = np.zeros(misc.SUPPORT_INTS, np.int32)
    row[0] = ids.size
    row[1:1 + 2 * ids.size:2], row[2:2 + 2 * ids.size:2] = ids[order], probs[order].view(np.int32)
    dense = np.zeros(V, np.float32)
    dense[ids] = probs
    got_ids, got_p = misc.split_support(row)
    assert np.array_equal(got_ids, np.flatnonzero(dense > 0)) and got_p.dtype == np.float64
    assert np.array_equal(got_p, dense[got_ids].astype(np.float64))
    row[0] = misc.SAMPLE_MAX_CANDIDATES + 1
    with pytest.raises(GpuError, match="support: a count of"):
        misc.split_support(row)


@pytest.mark.parametrize("cc, targets, dv, want", [
    ((9, 0), TARGETS, 128, 4), ((12, 0), TARGETS, 128, 4), ((9, 0), TARGETS, 16, 4),
    ((9, 0), TARGETS, 24, 1), ((9, 0), TARGETS, 8, 1),      # dv/4 columns not whole warps of 4
    ((8, 6), TARGETS, 128, 1), ((8, 0), TARGETS, 128, 1),   # no clusters before sm_90
    ((10, 0), TARGETS, 128, 1), ((9, 0), ("sm_80",), 128, 1),  # running the compute_80 PTX: none compiled in
])
def test_step_cluster_choice(cc, targets, dv, want):
    from ninfer_rt.gpu import deltanet
    assert deltanet.step_cluster(fake_kernels(*cc, targets), dv=dv) == want


@pytest.mark.parametrize("B, clusters_at_once, blocks_per_sm, want, without_pairs", [
    (1, 20, 1, 4, 4),                  # one sequence: the cluster kernel whatever the waves
    (2, 64, 1, 4, 4),                  # 32·B = 64 clusters, 64 at once: one wave each way, the most blocks a head
    (2, 60, 1, 1, 1),                  # 64 clusters of 4 or 2 in two waves, 64 blocks of C = 1 in one
    (2, {4: 62, 2: 128}, 1, 2, 1),     # the H100's 62 clusters of 4: pairs and single blocks in one, pairs kept
    (4, {4: 62, 2: 128}, 1, 2, 1),     # 128 pairs at once: one wave, as 128 blocks in 132 slots
    (4, {4: 62, 2: 100}, 1, 1, 1),     # pairs in two waves
    (8, 60, 2, 1, 1),                  # 256 clusters in five waves, 256 blocks in 264 slots: one
    (8, 130, 1, 4, 4),                 # two waves each way (256 blocks in 132 slots): the clusters of 4 kept
])
def test_step_cluster_by_waves(monkeypatch, B, clusters_at_once, blocks_per_sm, want, without_pairs):
    """At B > 1 sequences, where STEP_CLUSTER_WAVES asks, the step takes of 4, 2 and 1 blocks a head the size whose
    32·B clusters (blocks) take the fewest waves (the counts from the occupancy queries), the most blocks a head
    among equals; without STEP_PAIRS of 4 and 1 only; the switch off keeps 4. Every size writes x̂ records at
    dv = 128 (whole 32-column chunks a block)."""
    from ninfer_rt.gpu import deltanet
    monkeypatch.setattr(deltanet, "STEP_CLUSTER_WAVES", True)
    k = fake_kernels(9, 0, clusters_at_once=clusters_at_once, blocks_per_sm=blocks_per_sm)
    assert deltanet.step_cluster(k, dv=128, dk=128, nv=32, B=B) == want
    assert deltanet.records_fit(k, dv=128, dk=128, nv=32, B=B)
    monkeypatch.setattr(deltanet, "STEP_PAIRS", False)
    assert deltanet.step_cluster(k, dv=128, dk=128, nv=32, B=B) == without_pairs
    monkeypatch.setattr(deltanet, "STEP_CLUSTER_WAVES", False)
    assert deltanet.step_cluster(k, dv=128, dk=128, nv=32, B=B) == 4


def _step_args(dv=128, nv=32, nk=16, dk=128, H=2048, B=3, T=1):
    from ninfer_rt.gpu.weights import DeviceWeight
    return dict(x=1, H=H, in_norm_w=1, eps_in=1e-6, w_ba=DeviceWeight("ba", "bf16", (2 * nv, H), 1), mixed=1,
                ld_mixed=2 * nk * dk + 2 * nv * dv, conv_w=1, A_log=1, dt_bias=1, norm_w=1, conv_state=1,
                ssm_state=1, slot=1, pos=1, B=B, T=T, nk=nk, nv=nv, dk=dk, dv=dv, Kc=4, eps=1e-6, out=1)


def test_step_launches_a_cluster_per_head_on_sm90():
    """deltanet.step: on sm_90+ a cluster of 4 blocks of 256 threads per (head, sequence), grid (4·nv, B);
    with cluster=2 (v89) clusters of 2 blocks of 4·dv/2 threads; elsewhere, or with cluster=1, one block of 4·dv
    threads per head; a cluster it cannot run is a GpuError."""
    from ninfer_rt.gpu import deltanet
    from ninfer_rt.gpu.driver import GpuError
    h100, a100 = fake_kernels(9, 0), fake_kernels(8, 0)
    deltanet.step(h100, **_step_args())
    deltanet.step(h100, **_step_args(), cluster=1)
    deltanet.step(h100, **_step_args(), cluster=2)
    deltanet.step(a100, **_step_args(nv=48, H=5120))
    deltanet.step(h100, **_step_args(dv=24))
    assert h100.gpu.launches == [("deltanet_step_dk128_c4", (128, 3), 256, (4, 1, 1)),
                                 ("deltanet_step_dk128", (32, 3), 512, None),
                                 ("deltanet_step_dk128_c2", (64, 3), 256, (2, 1, 1)),
                                 ("deltanet_step_dk128", (32, 3), 96, None)]
    assert a100.gpu.launches == [("deltanet_step_dk128", (48, 3), 512, None)]
    for k, change in [(a100, dict(cluster=4)), (a100, dict(cluster=2)), (h100, dict(cluster=3)),
                      (h100, dict(cluster=4, dv=24))]:
        args = {**_step_args(dv=change.get("dv", 128)), **{n: v for n, v in change.items() if n != "dv"}}
        with pytest.raises(GpuError, match="cluster"):
            deltanet.step(k, **args)


def test_step_trail_takes_the_trail_kernels():
    """deltanet.step(trail=...): the same shapes on deltanet_step_trail_dk*: a cluster of 4 (one sequence's choice
    on sm_90+) or one block a head, and no cluster of 2 (no such entry: batched steps keep no trail)."""
    from ninfer_rt.gpu import deltanet
    from ninfer_rt.gpu.driver import GpuError
    h100, a100 = fake_kernels(9, 0), fake_kernels(8, 0)
    deltanet.step(h100, **_step_args(B=1, T=4), trail=256)
    deltanet.step(h100, **_step_args(B=1, T=4), trail=256, cluster=1)
    deltanet.step(a100, **_step_args(B=1, T=4), trail=256)
    assert h100.gpu.launches == [("deltanet_step_trail_dk128_c4", (128, 1), 256, (4, 1, 1)),
                                 ("deltanet_step_trail_dk128", (32, 1), 512, None)]
    assert a100.gpu.launches == [("deltanet_step_trail_dk128", (32, 1), 512, None)]
    with pytest.raises(GpuError, match="trail"):
        deltanet.step(h100, **_step_args(B=1, T=4), trail=256, cluster=2)


@pytest.mark.parametrize("dv, C, n, H, nv, want", [
    (128, 4, 257, 2048, 32, True),    # the 35B on clusters: a block of 32 columns, 256 threads, a logit each + 1
    (128, 4, 258, 2048, 32, False),
    (128, 1, 257, 2048, 32, True),    # v88: one block of 512 threads over 4 fold blocks, a pair a logit + 1
    (128, 1, 258, 2048, 32, False),
    (128, 2, 257, 2048, 32, True),    # v89: clusters of 2, 256 threads over 2 fold blocks, a logit each + 1
    (128, 2, 258, 2048, 32, False),
    (128, 1, 257, 2049, 32, False),   # x past the fold blocks' 16 elements each (nv·dv / 2)
    (64, 1, 129, 1024, 32, False),    # one block of 64 columns: no whole 4 fold blocks
    (64, 4, 129, 1024, 32, False),    # 16 columns a block of the cluster
])
def test_step_fold_fits(dv, C, n, H, nv, want):
    """deltanet.fold_fits: the step folds where each block holds whole 32-column fold blocks (STEP_FOLD: one on a
    cluster of 4, two on one of 2, four in one block), its threads cover n - 1 logits (one a thread, a pair in one
    block) and the fold
    blocks' 16 elements of x cover H; deltanet.step launches such a fold and refuses the others in one line."""
    from ninfer_rt.gpu import deltanet
    from ninfer_rt.gpu.driver import GpuError
    assert deltanet.fold_fits(dv=dv, C=C, n=n, H=H, nv=nv) == want
    k = fake_kernels(9, 0)
    args = {**_step_args(dv=dv, nv=nv, H=H, B=2), "fold": (1, 1, 1, 1, 1, 264, n), "cluster": C}
    if not deltanet.cluster_fits(dv, C):
        return
    if want:
        deltanet.step(k, **args)
        assert k.gpu.launches == [(f"deltanet_step_dk128{f'_c{C}' if C > 1 else ''}", (C * nv, 2),
                                   deltanet.STEP_LANES[C] * dv // C, (C, 1, 1) if C > 1 else None)]
    else:
        with pytest.raises(GpuError, match="the router fold needs"):
            deltanet.step(k, **args)


def test_batch_fold_follows_the_steps_kernel(monkeypatch):
    """router_fold.mixer_folds: a DeltaNet layer of the 35B folds at B > 1 whichever kernel step_cluster picks
    there, clusters of 4 or (STEP_CLUSTER_WAVES, too few clusters at once) one block a head (v88), and not at an H
    whose rows of x are not 16-byte aligned; one sequence needs no alignment."""
    from types import SimpleNamespace

    from ninfer_rt.gpu import deltanet, router_fold
    spec = SimpleNamespace(hidden_size=2048, layer_types=["linear_attention"], linear_value_head_dim=128,
                           linear_key_head_dim=128, linear_num_value_heads=32, num_experts=256)
    monkeypatch.setattr(deltanet, "STEP_CLUSTER_WAVES", True)
    for at_once, C in [(1 << 10, 4), (60, 1)]:
        k = fake_kernels(9, 0, clusters_at_once=at_once, blocks_per_sm=1)
        assert deltanet.step_cluster(k, dv=128, dk=128, nv=32, B=2) == C
        assert router_fold.mixer_folds(k, spec, 0, 2)
    spec.hidden_size = 2046
    assert not router_fold.mixer_folds(k, spec, 0, 2) and router_fold.mixer_folds(k, spec, 0, 1)


def test_high_priority_streams_and_graphs(monkeypatch):
    """Gpu.new_stream(high_priority=True) creates its stream at the greatest priority the context reports
    (cuCtxGetStreamPriorityRange), the plain one with cuStreamCreate; end_capture instantiates with
    CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY only when node_priority asks (v90)."""
    from types import SimpleNamespace

    from ninfer_rt.gpu import driver
    calls = []
    fake = SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=0),
        CUstream_flags=SimpleNamespace(CU_STREAM_NON_BLOCKING=1),
        CUgraphInstantiate_flags=SimpleNamespace(CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY=8),
        cuCtxGetStreamPriorityRange=lambda: (0, 0, -5),
        cuStreamCreate=lambda flags: calls.append(("create", flags)) or (0, "s0"),
        cuStreamCreateWithPriority=lambda flags, prio: calls.append(("create_p", flags, prio)) or (0, "s1"),
        cuStreamEndCapture=lambda h: (0, "graph"),
        cuGraphInstantiate=lambda g, flags: calls.append(("instantiate", g, flags)) or (0, "exec"))
    monkeypatch.setattr(driver, "_driver", lambda: fake)
    g = driver.Gpu.__new__(driver.Gpu)
    g.stream = SimpleNamespace(handle="main")
    assert g.new_stream().handle == "s0" and g.new_stream(high_priority=True).handle == "s1"
    g.end_capture()
    g.end_capture(node_priority=True)
    assert calls == [("create", 1), ("create_p", 1, -5), ("instantiate", "graph", 0), ("instantiate", "graph", 8)]


def test_cluster_launches_go_through_launch_kernel_ex(monkeypatch):
    """Gpu.launch with `cluster`: cuLaunchKernelEx with the cluster-dimension attribute (after the PDL one when
    PDL is on, alone when it is off); without a cluster and PDL, plain cuLaunchKernel; a cluster that does not
    divide the grid is a GpuError before any launch."""
    from types import SimpleNamespace

    from ninfer_rt.gpu import driver
    calls = []
    fake = SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=0),
        CUlaunchAttributeID=SimpleNamespace(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION="cluster"),
        CUlaunchAttribute=lambda: SimpleNamespace(id=None, value=SimpleNamespace(
            clusterDim=SimpleNamespace(x=0, y=0, z=0))),
        CUlaunchConfig=SimpleNamespace,
        cuLaunchKernelEx=lambda cfg, fn, args, extra: calls.append(("ex", cfg)) or (0,),
        cuLaunchKernel=lambda fn, *dims_etc: calls.append(("plain", dims_etc[:6])) or (0,))
    monkeypatch.setattr(driver, "_driver", lambda: fake)
    g = driver.Gpu.__new__(driver.Gpu)
    g.stream, g._pdl_attr, g._cluster_attrs = SimpleNamespace(handle="stream"), "pdl", {}

    def attrs(cfg):
        return [a if a == "pdl" else (a.id, a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z)
                for a in cfg.attrs[:cfg.numAttrs]]

    g.pdl = False
    g.launch("f", (8, 2), 256, [], cluster=4)
    g.launch("f", (8, 2), 256, [])
    g.pdl = True
    g.launch("f", (8, 2), 256, [], cluster=(4, 2))
    g.launch("f", (8, 2), 256, [], cluster=1)
    (k0, c0), (k1, d1), (k2, c2), (k3, c3) = calls
    assert k0 == "ex" and (c0.gridDimX, c0.gridDimY, c0.blockDimX) == (8, 2, 256)
    assert attrs(c0) == [("cluster", 4, 1, 1)]
    assert k1 == "plain" and d1 == (8, 2, 1, 256, 1, 1)
    assert k2 == "ex" and attrs(c2) == ["pdl", ("cluster", 4, 2, 1)]
    assert k3 == "ex" and attrs(c3) == ["pdl"]
    g.launch("f", (8, 2), 256, [], cluster=4)
    assert calls[-1][1].attrs[1] is c0.attrs[0]  # one attribute object per cluster shape
    with pytest.raises(driver.GpuError, match="divide the grid"):
        g.launch("f", (6, 2), 256, [], cluster=4)
    assert len(calls) == 5


# Shared memory a block may opt into, per compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"), and the SM counts of an H200, A100, RTX 3090, RTX 4090 and RTX 5090.
GPUS = {"H200": ((9, 0), 132, 227 * 1024), "A100": ((8, 0), 108, 163 * 1024), "RTX 3090": ((8, 6), 82, 99 * 1024),
        "RTX 4090": ((8, 9), 128, 99 * 1024), "RTX 5090": ((12, 0), 170, 99 * 1024)}


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("model, nv", [("35B-A3B", 32), ("27B", 48)])
def test_prefill_delta_rule_plan(gpu, model, nv):
    """deltanet.prefill of 4096 tokens at the family's head shapes, on each target GPU: conv, the chunked prep
    (a block per chunk and value head), the chunked state kernel (a block per head and 32 columns) and the gated
    norm. The state kernel takes two record stages (131 KB) only where they fit a block and its blocks fit one
    wave at one per SM: the 35B's 128 on the H200; else the one-stage _s1 (73 KB): on the ~99 KB GPUs, the
    A100's 108 SMs, the 27B's 192 blocks. Every launch's shared memory fits the GPU (opt_in_smem raises if not)."""
    from ninfer_rt.gpu import deltanet
    cc, sms, optin = GPUS[gpu]
    k = fake_kernels(*cc, sm_count=sms, smem_optin=optin)
    T, nk, dk, dv = 4096, 16, 128, 128
    deltanet.prefill(k, mixed=1, ld_mixed=2 * nk * dk + 2 * nv * dv, ba=1, conv_w=1, A_log=1, dt_bias=1, norm_w=1,
                     conv_state=1, ssm_state=1, slot=1, pos=1, B=1, T=T, nk=nk, nv=nv, dk=dk, dv=dv, Kc=4, eps=1e-6,
                     out=1, scratch=1)
    two_stages = gpu == "H200" and model == "35B-A3B"
    assert [(fn, grid, block) for fn, grid, block, _ in k.gpu.launches[1:3]] == [
        ("deltanet_chunk_prep_dk128", (T // 32, nv, 1), 256),
        ("deltanet_chunk_state_dk128" + ("" if two_stages else "_s1"), (dv // 32, nv, 1), 256)]


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("dtype, warps", [("int8", 8), ("bf16", 4)])
def test_prefill_attention_plan(gpu, dtype, warps):
    """attention.prefill of 4096 tokens at the 35B-A3B's heads (16 query heads over 2 KV heads of 256) on each
    target GPU: attn_prefill_<dtype>_d256 in blocks of `warps` warps of 16 query rows (8 for an int8 cache, 4 for
    bf16), one split, then the combine; on the H200 (sm_90a cubin) an int8 cache takes attn_prefill_wgmma_int8_d256
    in blocks of 256 threads and 128 query rows instead, which merges its one split itself (no combine). Every
    launch's shared memory fits its GPU's opt-in limit."""
    from ninfer_rt.gpu import attention
    cc, sms, optin = GPUS[gpu]
    k = fake_kernels(*cc, sm_count=sms, smem_optin=optin)
    T, nH, nKV, d = 4096, 16, 2, 256
    cache = attention.KVCache(k=1, v=1, k_scale=int(dtype == "int8"), v_scale=int(dtype == "int8"), slots=1,
                              max_ctx=T, nKV=nKV, d=d, dtype=dtype)
    attention.prefill(k, q=1, gate=1, ld_gate=nH * d, pos=1, slot=1, T=T, nH=nH, cache=cache, out=1, scratch=1,
                      ctx_bucket=T)
    names = [fn for fn, *_ in k.gpu.launches]
    fn, grid, block, _ = k.gpu.launches[0]
    if gpu == "H200" and dtype == "int8":  # one split: merged and gated in the kernel, no combine
        want, rows, threads, smem = ["attn_prefill_wgmma_int8_d256"], 128, 256, attention._prefill_wgmma_smem(d)
    else:
        want, rows, threads = [f"attn_prefill_{dtype}_d256", "attn_combine"], 16 * warps, 32 * warps
        smem = attention._prefill_smem(d, dtype)
    assert (names, grid, block) == (want, (T * nH // nKV // rows, 1, nKV), threads)
    assert k.gpu.smems[0] == smem <= optin  # the launch asks for the layout's size, and it fits
    assert (fn, smem) in k.gpu.opt_ins or smem <= 48 * 1024  # past 48 KB a kernel must opt in first


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("M", [8192, 512])
def test_prefill_gemm_dequantized_plan(gpu, M, monkeypatch):
    """gemm.gemm with a scratch, 35B in_proj_qkv|z [12288, 2048] q8g32: on the H200 from WGMMA_SS_MIN_ROWS rows,
    gemm_wgmma_dequant_q8g32 (a thread per 8 weights) into the scratch, then gemm_wgmma_ss over it: a TMA descriptor
    of the scratch as bf16 [N, K] (box 256 rows × 64 k, 128-byte swizzle) and one of x, the wgmma grid, its shared
    memory within the opt-in limit. Below that, or elsewhere, the register-path plan of test_prefill_gemm_plan."""
    from ninfer_rt.gpu import gemm
    from ninfer_rt.gpu.weights import DeviceWeight
    maps = []
    monkeypatch.setattr(gemm, "_MAPS", {})
    monkeypatch.setattr(gemm, "tensor_map_2d", lambda base, **kw: maps.append((base, kw)) or object())
    cc, sms, optin = GPUS[gpu]
    k = fake_kernels(*cc, sm_count=sms, smem_optin=optin)
    N, K = 12288, 2048
    w = DeviceWeight("w", "q8g32", (N, K), 1 << 20)
    scratch = 1 << 32
    gemm.gemm(k, w, x=1 << 30, M=M, y=1 << 31, scratch=scratch, scratch_bytes=N * K * 2)
    names = [fn for fn, *_ in k.gpu.launches]
    if gpu == "H200" and M >= gemm.WGMMA_SS_MIN_ROWS:
        assert [(fn, grid, block) for fn, grid, block, _ in k.gpu.launches] == [
            ("gemm_wgmma_dequant_q8g32", N * K // 8 // 256, 256), ("gemm_wgmma_ss", (N // 256, M // 128), 512)]
        assert maps[0] == (scratch, dict(dtype="bf16", inner=K, rows=N, row_bytes=2 * K, box_inner=64,
                                         box_rows=256, swizzle_128b=True))
        assert gemm.ss_smem_bytes() <= optin
    else:
        assert names == ["gemm_wgmma_q8g32" if gpu == "H200" else "gemm_q8g32"]


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("N, K, M", [(9216, 2048, 8192), (9216, 2048, 512), (2048, 4096, 512), (9216, 2048, 64)])
def test_prefill_gemm_plan(gpu, N, K, M, monkeypatch):
    """gemm.gemm and gemm.moe_grouped at the 35B-A3B's shapes on each target GPU. On the H200 (sm_90a cubin), from
    128 rows and where the tiles cover the 132 SMs (not o_proj at 512 rows: 8 × 4 tiles): gemm_wgmma_<fmt> in tiles
    of 256 weight rows × 128 x rows, 512 threads, with TMA descriptors of the qs plane (box 256 rows × 64 k) and of
    x (box 128 rows × 64 k, 128-byte swizzle); the grouped down projection's covers the whole bank. Elsewhere the
    mma.sync tiles of 128 × 128. Every launch's shared memory fits its GPU."""
    from ninfer_rt.gpu import gemm
    from ninfer_rt.gpu.weights import DeviceWeight
    maps = []
    monkeypatch.setattr(gemm, "_MAPS", {})
    monkeypatch.setattr(gemm, "tensor_map_2d", lambda base, **kw: maps.append((base, kw)) or object())
    cc, sms, optin = GPUS[gpu]
    k = fake_kernels(*cc, sm_count=sms, smem_optin=optin)
    wg = gpu == "H200" and M >= gemm.WGMMA_MIN_ROWS and N // 256 * -(-M // 128) >= 132
    w = DeviceWeight("w", "q8g32", (N, K), 1 << 20)
    gemm.gemm(k, w, x=1 << 30, M=M, y=1 << 31)
    fn, grid, block, _ = k.gpu.launches[-1]
    rows = 256 if wg else 128
    assert (fn, tuple(grid), block) == ("gemm_wgmma_q8g32" if wg else "gemm_q8g32", (N // rows, -(-M // 128)),
                                        512 if wg else 256)
    if wg:
        assert maps == [(w.planes()[0], dict(dtype="u8", inner=K, rows=N, row_bytes=K, box_inner=64, box_rows=256)),
                        (1 << 30, dict(dtype="bf16", inner=K, rows=M, row_bytes=2 * K, box_inner=64, box_rows=128,
                                       swizzle_128b=True))]
    gu = DeviceWeight("gate_up", "q4g64", (256, 1024, 2048), 1 << 22)
    dn = DeviceWeight("down", "q5g64", (256, 2048, 512), 1 << 23)
    took = gemm.moe_grouped(k, gu, dn, x=1 << 30, M=M, ids=1, weights=1, top_k=8, act=1 << 24, y=1 << 31,
                            scratch=1 << 25)
    assert took == ("large" if M == 8192 else "small")
    if took == "large":
        names = [fn for fn, *_ in k.gpu.launches[-2:]]
        assert names == (["moe_gemm_wgmma_q4g64", "moe_gemm_wgmma_q5g64"] if wg else
                         ["moe_gemm_q4g64", "moe_gemm_q5g64"])
        if wg:
            assert maps[-1] == (dn.planes()[0], dict(dtype="u8", inner=256, rows=256 * 2048, row_bytes=256,
                                                     box_inner=32, box_rows=256))
    # ordered: the down stores one row a slot (no atomics) and moe_sum_slots adds each row's 8 in order
    gemm.moe_grouped(k, gu, dn, x=1 << 30, M=M, ids=1, weights=1, top_k=8, act=1 << 24, y=1 << 31,
                     scratch=1 << 25, slot_y=1 << 26)
    assert [(fn, tuple(np.atleast_1d(grid))) for fn, grid, *_ in k.gpu.launches[-1:]] == [
        ("moe_sum_slots", (2048 // 256, M))]


def test_a_carveout_preference_is_set_once_per_change(monkeypatch):
    """kernels.SMEM_CARVEOUT reaches each entry point through one attribute call when it changes (None: -1, the
    driver's choice, which needs no call on an entry point never given another)."""
    from ninfer_rt.gpu import kernels
    k = fake_kernels(9, 0)
    calls = []
    k.gpu.set_smem_carveout = lambda fn, percent: calls.append((fn, percent))
    k.launch("a", 1, 32, [])
    assert calls == []
    monkeypatch.setattr(kernels, "SMEM_CARVEOUT", 100)
    k.launch("a", 1, 32, [])
    k.launch("a", 1, 32, [])
    k.launch("b", 1, 32, [])
    monkeypatch.setattr(kernels, "SMEM_CARVEOUT", None)
    k.launch("a", 1, 32, [])
    k.launch("a", 1, 32, [])
    assert calls == [("a", 100), ("b", 100), ("a", -1)] and len(k.gpu.launches) == 6


def test_records_rows_by_kind_of_step(monkeypatch):
    """linear.records_rows takes RECORDS_ROWS for B sequences of one token and RECORDS_TOKENS for one sequence's
    verification of T tokens (v91: the two kinds of step run different DeltaNet steps and differ in what records
    are worth)."""
    from ninfer_rt.gpu import linear

    monkeypatch.setattr(linear, "RECORDS_ROWS", (1, 2))
    monkeypatch.setattr(linear, "RECORDS_TOKENS", (3,))
    assert linear.records_rows(1, 1) and linear.records_rows(2, 1) and not linear.records_rows(3, 1)
    assert not linear.records_rows(1, 2) and linear.records_rows(1, 3)
