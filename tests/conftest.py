"""Shared test fixtures: tests/ on sys.path (hf_tiny, checkpoints, cli_runner), one torch thread per module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on small shared machines: torch's thread pool only adds contention (10x slower seen here)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
