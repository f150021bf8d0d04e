"""bench/tree_ab.py's host side: the base tree from git, the rows it reads from planner_ab.py's JSON, the summary of
the rows, and one-line misuse.

Oracles: `git show REV:path` for the extracted files; gpu_common's own JSON writer for the rows; medians of
hand-picked odd-length lists (the middle value) for the summary; the timing itself needs a GPU and is not run here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import tree_ab  # noqa: E402

needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                               reason="needs git and this checkout's history")


@needs_git
def test_extract_tree_is_the_revision_s_files(tmp_path):
    """The base tree holds HEAD's kernels and planner_ab.py byte for byte, and nothing outside TREE_PATHS."""
    dest = tree_ab.extract_tree("HEAD", tmp_path / "base")
    for rel in ("kernels/gemv_stream.cu", "bench/planner_ab.py", "ninfer_rt/gpu/linear.py"):
        want = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{rel}"], capture_output=True, check=True).stdout
        assert (dest / rel).read_bytes() == want, rel
    assert {p.name for p in dest.iterdir()} <= set(tree_ab.TREE_PATHS)


@needs_git
def test_unknown_revision_is_an_ab_error(tmp_path):
    with pytest.raises(tree_ab.AbError, match="nosuchrev"):
        tree_ab.extract_tree("nosuchrev", tmp_path / "base")


def test_summary_takes_each_tree_s_median_against_the_base():
    """Every default row of every round counts; the change is the new median over the base median, per model and
    context; the base row has none to compare with."""
    ms = {("27b", "base"): [5.53, 5.54, 5.52], ("27b", "new"): [5.60, 5.58, 5.59, 5.61, 5.62],
          ("35b", "base"): [1.54]}
    rows = [{"model": m, "context": 8192, "tree": t, "ms": v} for (m, t), vs in ms.items() for v in vs]
    got = {(s["model"], s["tree"]): s for s in tree_ab.summarize(rows)}
    assert got[("27b", "base")]["median"] == 5.53 and got[("27b", "base")]["vs_base"] == 0
    new = got[("27b", "new")]
    assert (new["runs"], new["min"], new["median"], new["max"]) == (5, 5.58, 5.60, 5.62)
    assert new["vs_base"] == pytest.approx(5.60 / 5.53 - 1, rel=1e-12)
    assert ("35b", "new") not in got and got[("35b", "base")]["runs"] == 1


@pytest.mark.parametrize("argv, what", [
    (["--base-tree", "/"], "not a source tree"),
    (["--base", "HEAD", "--rounds", "0"], "--rounds"),
])
def test_misuse_is_one_line(argv, what):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "tree_ab.py"), *argv], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and what in p.stderr, p.stderr


def test_default_rows_read_what_planner_ab_writes(tmp_path):
    """The rows come from the JSON planner_ab.py writes through gpu_common.step_rows_out (its writer, not a copy of
    its layout): only the "default" and "default again" rows; a document without rows is one AbError."""
    import io
    import json
    from types import SimpleNamespace

    from rich.console import Console

    import gpu_common

    rows = [{"model": "m", "variant": v, "context": 8192, "ms": ms}
            for v, ms in (("default", 5.5), ("a variant", 5.4), ("default again", 5.6))]
    gpu = SimpleNamespace(info=SimpleNamespace(name="GPU", arch="sm_90a"))
    out = tmp_path / "rows.json"
    gpu_common.step_rows_out(Console(file=io.StringIO()), gpu, "t", [("variant", True)], lambda r: (r["variant"],),
                             rows, out)
    assert [r["ms"] for r in tree_ab.default_rows(json.loads(out.read_text()))] == [5.5, 5.6]
    for bad in ([], {"rows": None}, {"device": "GPU"}):
        with pytest.raises(tree_ab.AbError, match="rows"):
            tree_ab.default_rows(bad)


def test_rounds_rotate_every_tree_through_every_place():
    """Two trees alternate; with more, over len(names) rounds each tree is timed once in every place."""
    assert [tree_ab.round_order(["new", "base"], r) for r in range(3)] == [["new", "base"], ["base", "new"],
                                                                           ["new", "base"]]
    names = ["new", "base", "a", "b"]
    orders = [tree_ab.round_order(names, r) for r in range(len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert all(sorted(o[i] for o in orders) == sorted(names) for i in range(len(names)))
