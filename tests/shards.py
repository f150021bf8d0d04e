"""The --shard K/N option's arithmetic (conftest.py registers the option): which of the selected tests a shard runs."""

from __future__ import annotations

import re

import pytest


def shard_bounds(spec: str, count: int) -> tuple[int, int]:
    """The [lo, hi) of the items of shard spec "K/N" among count, in collection order: contiguous, so a module's
    fixtures are set up in one shard only (bar the module a boundary cuts), and sizes differ by at most one."""
    m = re.fullmatch(r"([0-9]+)/([0-9]+)", spec)
    if not (m and 1 <= int(m[1]) <= int(m[2])):
        raise pytest.UsageError(f"--shard takes K/N with 1 <= K <= N, got {spec!r}")
    k, n = int(m[1]), int(m[2])
    return count * (k - 1) // n, count * k // n
