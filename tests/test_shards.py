"""--shard K/N (conftest.py, shards.py): the N shards of a selection run every selected test once, in order."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from shards import shard_bounds

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tests/test_json_schema.py"  # many parametrized tests, light imports


def collected(*args: str) -> tuple[list[str], str]:
    """The node ids `pytest --collect-only` selects from TARGET with args, and its summary line."""
    r = subprocess.run([sys.executable, "-m", "pytest", TARGET, "--collect-only", "-q", "-p", "no:cacheprovider",
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    return [line for line in lines if "::" in line], next(line for line in lines if "collected" in line)


@pytest.mark.parametrize("count", [0, 1, 2, 5, 16, 17, 1256])
@pytest.mark.parametrize("n", [1, 2, 3, 7, 8])
def test_the_shards_tile_the_items(count, n):
    """Consecutive shards meet end to start from 0 to count, each within one item of count / n."""
    bounds = [shard_bounds(f"{k}/{n}", count) for k in range(1, n + 1)]
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == count


def test_shards_of_a_real_selection_are_its_tests_in_order():
    """Through pytest itself: with -k, the two shards' ids, concatenated, are what -k selects (the option
    deselects after -k, so shards split what would run)."""
    picked, summary = collected("-k", "refused")
    assert len(picked) > 10 and "deselected" in summary  # -k left some out
    first, _ = collected("-k", "refused", "--shard", "1/2")
    second, _ = collected("-k", "refused", "--shard", "2/2")
    assert first + second == picked and abs(len(first) - len(second)) <= 1


@pytest.mark.parametrize("spec", ["0/2", "3/2", "2", "a/b", "1/0", "-1/2", "1/2/3", "", "²/2", " 1/2"])
def test_a_bad_shard_is_refused(spec):
    with pytest.raises(pytest.UsageError, match=re.escape(f"--shard takes K/N with 1 <= K <= N, got {spec!r}")):
        shard_bounds(spec, 10)


def test_a_bad_shard_on_the_command_line_is_one_line_and_exit_4():
    r = subprocess.run([sys.executable, "-m", "pytest", TARGET, "--collect-only", "-q", "-p", "no:cacheprovider",
                        "--shard=3/2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4  # pytest's usage error
    assert r.stderr.strip() == "ERROR: --shard takes K/N with 1 <= K <= N, got '3/2'"
