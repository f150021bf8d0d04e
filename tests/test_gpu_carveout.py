"""CPU test of the shared-memory carveout a decode step's GEMVs share (ninfer_rt/gpu/kernels.py share_carveout), on
test_gpu_plans' made-up GPU: the oracle is the size formula (blocks per SM times dynamic, static and reserved shared
memory, taken to the next SM configuration)."""

from __future__ import annotations

from tests.test_gpu_plans import fake_kernels


def test_shared_carveout_holds_the_largest_launch(monkeypatch):
    """Kernels.share_carveout on a made-up H200 (132 SMs, 228 KiB of shared memory an SM, 1 KiB reserved a block):
    the smallest SM configuration that holds each shared launch's blocks per SM (its grid over the SMs, at most its
    occupancy) with its dynamic, static and reserved bytes, asked for exactly as a percent rounded up; a launch
    that alone needs more than half the SM keeps the driver's choice, and the carveout only grows. Launches then
    prefer it for the shared entry points only, and the driver's choice (-1) for the rest."""
    from ninfer_rt.gpu import kernels

    monkeypatch.setattr(kernels, "SHARED_CARVEOUT", ("",))
    k = fake_kernels(9, 0, smem_optin=227 * 1024)
    k.gpu.info.max_smem_per_sm = 228 * 1024
    k.gpu.static_smem = lambda fn: 512
    k.gpu.max_active_blocks = lambda fn, threads, smem: 3 if fn.startswith("attn") else 2
    set_to = {}
    k.gpu.set_smem_carveout = lambda fn, percent: set_to.__setitem__(fn, percent)
    big, small = 53_264, 13_840  # the 27B's gate|up (x, norm_w and x̂ slab) and o_proj (records) per block
    launches = [("gemv_q4_s1bw", (264,), (256,), big), ("gemv_q6_s1r", (264,), (256,), small),
                ("gemv_q6_m1", (4000,), (256,), 12_000),  # waves of blocks: 2 a SM at a time, not 17
                ("attn_decode_fast_int8_d256", (1, 132, 4), (128,), 76_032)]  # 3 a SM: 230 KiB, unshared
    # 2 blocks of big: 107 KiB, so the 132 KiB configuration, asked for exactly (100 KiB would be the nearer one
    # to 107 KiB's percentage, and holds one block)
    assert 100 * 1024 < 2 * (big + 512 + 1024) <= 132 * 1024
    want = -(-100 * 132 // 228)
    assert k.share_carveout(launches) == want
    assert k.shared_names == {"gemv_q4_s1bw", "gemv_q6_s1r", "gemv_q6_m1"}
    assert k.share_carveout([("gemv_q6_s1r", (264,), (256,), small)]) == want  # a smaller step does not lower it
    k.launch("gemv_q6_s1r", (264,), 256, [], small)
    k.launch("attn_decode_fast_int8_d256", (1, 132, 4), 128, [], 76_032)
    assert set_to == {"gemv_q6_s1r": want}  # the decode kept the driver's choice: never set
    monkeypatch.setattr(kernels, "SHARED_CARVEOUT", ("attn_",))  # a filter: nothing new to share
    assert k.share_carveout(launches) == want and "attn_decode_fast_int8_d256" not in k.shared_names
