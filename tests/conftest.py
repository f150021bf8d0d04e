"""Shared test fixtures: tests/ on sys.path (hf_tiny, checkpoints, cli_runner), one torch thread per module,
tiny HF models (per module), the built-in tiny MoE checkpoint and its artifact (built once per session,
read-only for tests). Option --shard K/N: the K-th of N contiguous parts of the selected tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shards import shard_bounds  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="K/N", default=None,
                     help="run only the K-th of N contiguous parts of the selected tests (1 <= K <= N; sizes differ "
                          "by at most one), so a GPU suite longer than one device call runs over several calls")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs: shards split what would run
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    lo, hi = shard_bounds(spec, len(items))
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on small shared machines: torch's thread pool only adds contention (10x slower seen here)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def rng():
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    import numpy as np

    seed = int(np.random.SeedSequence().entropy % (2**32))
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def models():
    """Tiny HF models (4 layers: three DeltaNet, one attention), built once per module."""
    import hf_tiny

    return {"vlm_moe": hf_tiny.make_vlm(True, num_layers=4), "vlm_dense": hf_tiny.make_vlm(False, num_layers=4),
            "causal_moe": hf_tiny.make_causal_lm(True, num_layers=4),
            "causal_dense": hf_tiny.make_causal_lm(False, num_layers=4)}


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """The built-in tiny MoE checkpoint directory, generated into a private cache."""
    from ninfer_pack.tiny import materialize_builtin

    return materialize_builtin("builtin:tiny-moe", cache_dir=tmp_path_factory.mktemp("builtin"))


@pytest.fixture(scope="session")
def packed(tiny_moe, tmp_path_factory):
    """tiny_moe quantized with the tiny recipe (every format family), through the library."""
    from ninfer_pack.pipeline import quantize

    out = tmp_path_factory.mktemp("art") / "tiny.ninfer"
    quantize(str(tiny_moe), "tiny", out)
    return out


@pytest.fixture(scope="module")
def packed_model(packed, one_thread):
    """The packed tiny MoE on the CPU reference (ninfer_rt.load, with serve's two cache slots), one per module,
    one torch thread."""
    from ninfer_rt import load

    m = load(packed, "cpu", cache_slots=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def srv(packed_model):
    """ninfer-rt serve over packed_model on a loopback port (serve_client.Running), one per module."""
    from serve_client import Running

    with Running(packed_model) as r:
        yield r
