"""bench/decode_timeline.py's host side on hand-made stamps: how a launch's warps become its row (release, gap,
work, tail, late blocks), how grids are matched to the launches the engine enqueued, and the labels. Oracle: the
numbers worked out by hand from the stamps below (integer nanoseconds, so the µs values are exact decimals)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from decode_timeline import (MARKS, RECORD, _block_stats, _family, _launch_rows, _marks, _wait_return,  # noqa: E402
                             _warp_records)


def stamps(rows, marks=None) -> np.ndarray:
    """Records from (grid, block, warp, pre, post, exit) tuples, in ns; block b runs on SM 100 + b; marks[i]: row
    i's NINFER_TL_MARK times by slot (0: not reached)."""
    r = np.zeros(len(rows), RECORD)
    for i, (grid, block, warp, pre, post, exit_) in enumerate(rows):
        m = [0] * MARKS
        for slot, t in (marks or {}).get(i, {}).items():
            m[slot] = t
        r[i] = (grid, pre, post, exit_, m, block, warp, 100 + block, 0)
    return r


def test_the_record_is_the_header_struct():
    """RECORD mirrors NinferTlRecord in kernels/common.cuh: 4 + NINFER_TL_MARKS u64, then 4 u32, no padding."""
    import re
    header = (Path(__file__).resolve().parents[1] / "kernels" / "common.cuh").read_text()
    assert int(re.search(r"#define NINFER_TL_MARKS (\d+)", header).group(1)) == MARKS
    assert RECORD.itemsize == 8 * (4 + MARKS) + 4 * 4


def test_marks_are_reported_per_slot_after_the_release():
    # released at 1000 ns; slot 0 reached by three warps at 1500, 2000, 4000; slot 2 by one at 1256; the rest never
    r = stamps([(3, 0, 0, 0, 1000, 5000), (3, 0, 1, 0, 1200, 5000), (3, 1, 0, 0, 1100, 5000)],
               marks={0: {0: 1500, 2: 1256}, 1: {0: 2000}, 2: {0: 4000}})
    m = _marks(r)
    assert m[0] == [1.0, 3.0] and m[2] == [0.256, 0.256]  # [median, last] µs after the release
    assert m[1] is None and all(v is None for v in m[3:])
    assert _wait_return(r) == [0.1, 0.2]  # the warps' own waits returned at 1000, 1200, 1100: median, last
    w = _warp_records(r)
    assert [x[:3] for x in w] == [[0, 0, 100], [0, 1, 100], [1, 0, 101]]  # by block, then warp
    assert w[1][3:7] == [-1.0, 0.2, 4.0, 1.0]  # entry, wait return, exit, mark 0: µs after the release
    assert w[0][8] == 0.256 and w[0][7] is None and w[1][8] is None


def test_block_stats_separate_late_blocks_and_their_lag():
    # block 0 waits from 0, released at 1000, its warps exit at 5000 and 5400; block 1 enters at 3000 (late: more
    # than 500 ns after the release) and exits at 9000
    r = stamps([(7, 0, 0, 0, 1000, 5000), (7, 0, 1, 100, 1000, 5400), (7, 1, 0, 3000, 3000, 9000)])
    s = _block_stats(r)
    assert s["late_blocks"] == 0.5 and s["last_out_was_late"]
    assert s["exit_max"] == 8.0 and s["exit_p50"] == 6.2  # (5400 + 9000) / 2 - 1000 ns
    assert s["late_exit_lag"] == pytest.approx(3.6)  # 9000 - 5400
    assert s["warp_spread"] == pytest.approx(0.2)  # block 0: 400 ns, block 1: 0
    assert s["last_out_sms"] == [101, 100]  # the last block out first
    assert s["entry_index_corr"] == pytest.approx(1.0)  # block 1 entered after block 0
    r2 = stamps([(7, 0, 0, 900, 1000, 5000), (7, 1, 0, 0, 1000, 5000), (7, 2, 0, 500, 1000, 5000)])
    assert _block_stats(r2)["entry_index_corr"] == pytest.approx(-0.5)  # entry ranks 2, 0, 1 against 0, 1, 2


def test_launch_rows_match_grids_in_order_per_image_and_chain_the_gaps():
    a = stamps([(5, 0, 0, 0, 500, 2000), (5, 1, 0, 0, 600, 2500),     # launch 0, image a
                (9, 0, 0, 4000, 4000, 6000)])                          # launch 2, image a (later grid id)
    b = stamps([(7, 0, 0, 2000, 3000, 3500), (7, 0, 1, 2100, 3000, 3600)])  # launch 1, image b
    rows = _launch_rows([("gemv_q8_s1 w1", "a", "main"), ("moe_down_t1_q5g64", "b", "main"),
                         ("gemv_q6_s1 w2", "a", "main")], {"a": a, "b": b})
    assert [r["kernel"] for r in rows] == ["gemv_q8_s1 w1", "moe_down_t1_q5g64", "gemv_q6_s1 w2"]
    assert [r["blocks"] for r in rows] == [2, 1, 1] and [r["warps"] for r in rows] == [2, 2, 1]
    assert [r["release"] for r in rows] == [0.5, 3.0, 4.0]  # µs from the first stamp
    assert [r["gap"] for r in rows] == [0.0, pytest.approx(0.5), pytest.approx(0.4)]  # release - previous last exit
    assert [r["work"] for r in rows] == [2.0, pytest.approx(0.6), 2.0]
    kept = _launch_rows([("gemv_q8_s1 w1", "a", "main"), ("moe_down_t1_q5g64", "b", "main"),
                         ("gemv_q6_s1 w2", "a", "main")], {"a": a, "b": b}, keep="moe_down")
    assert ["warp_records" in r for r in kept] == [False, True, False] and len(kept[1]["warp_records"]) == 2


def test_a_launch_without_stamps_stops_the_match():
    with pytest.raises(SystemExit, match="no stamps"):
        _launch_rows([("k", "a", "main"), ("k", "a", "main")], {"a": stamps([(5, 0, 0, 0, 1, 2)])})


def test_family_drops_the_format_and_keeps_the_weight():
    assert _family("gemv_q6_s1 mlp.down_proj.weight") == "gemv_*_s1 mlp.down_proj.weight"
    assert _family("moe_gate_up_routed_t2_q4g64") == "moe_gate_up_routed_t2_*"
    assert _family("attn_decode_fast_int8_d256") == "attn_decode_fast_int8_d256"


def test_records_read_each_image_ring_as_it_was_built():
    """_records takes the ring's records per SM from the image's own sizes (NINFER_TL_PER_SM is not restated), the
    first `count` of each SM's slice, and skips an image with no stamps without reading its ring."""
    from types import SimpleNamespace

    from decode_timeline import _records
    ring = np.zeros(2 * 3, RECORD)  # 2 SMs x 3 records
    ring["grid"] = np.arange(6)
    mem = {1: np.array([2, 1], np.uint32), 2: ring, 3: np.zeros(2, np.uint32)}
    reads = []

    class Image:
        def __init__(self, name, counts, recs):
            self.name, self.counts, self.recs = name, counts, recs

        def global_address(self, var):
            return (self.counts, 8) if var == "ninfer_tl_count" else (self.recs, ring.nbytes)

    def download(p, shape, dtype):
        reads.append(p)
        return mem[p].view(dtype).reshape(shape)

    out = _records(SimpleNamespace(download=download),
                   SimpleNamespace(modules=[Image("a", 1, 2), Image("b", 3, 4)]))
    assert list(out) == ["a"] and out["a"]["grid"].tolist() == [0, 1, 3]  # SM 0: records 0, 1; SM 1: record 3
    assert 4 not in reads
